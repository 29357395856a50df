"""A small paged-KV decode graph runner whose attention kernel takes int32 indices.

The scheduler's metadata (slot mapping, block tables, sequence lengths) is kept in persistent
int64 graph-input buffers, as the scheduler produces it; the attention kernel wants int32, so the
runner keeps persistent int32 buffers too and, every step before the replay, converts the int64
buffers into them in place. Graph mode captures one decode graph per capture size (padded by
requests) through the backend facade; everything else runs eagerly.

`make_buggy_target` carries a metadata-builder bug seen in public engines: the int32 copies are made
once, at capture time and outside the captured region (`x64.to(torch.int32)`), and the graphs read
those copies; every step writes the new batch into the int64 buffers, which the graphs never read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 48, 3, 16
MAX_LEN = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF
INDEX = ("slots", "tables", "seq_lens")  # the int64 metadata the attention kernel wants as int32


@dataclass
class Inputs:
    tokens: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    slots: Tensor  # [T] int32: the KV slot each token writes
    tables: Tensor  # [T, max_blocks_per_req] int32
    seq_lens: Tensor  # [T] int32: slots visible to each token (its position + 1)
    seeds: Tensor  # [R] int64
    temps: Tensor  # [R] float32
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] each request's last token (None: one token per request)


class Model:
    """One decoder layer over a slot-major paged KV cache; no host reads in forward."""

    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "emb": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_LEN, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "w1": (HIDDEN, 2 * HIDDEN),
            "w2": (2 * HIDDEN, HIDDEN),
            "lm": (HIDDEN, SPEC.vocab_size),
        }
        self.device = device
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(self.device))

    def forward(self, x: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        h = w["emb"][x.tokens] + w["pos"][x.positions]
        n = norm(h)
        q, k, v = n @ w["wq"], n @ w["wk"], n @ w["wv"]
        k_cache.index_put_((x.slots,), k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_put_((x.slots,), v.view(-1, HEADS, HEAD_DIM))
        h = h + attend(q, k_cache, v_cache, x) @ w["wo"]
        h = h + torch.nn.functional.silu(norm(h) @ w["w1"]) @ w["w2"]
        if x.last is not None:
            h = h[x.last]
        return norm(h) @ w["lm"]


def norm(h: Tensor) -> Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, x: Inputs) -> Tensor:
    """Paged attention with int32 slot/table/length metadata."""
    bs = SPEC.block_size
    offs = torch.arange(bs, dtype=torch.int32, device=q.device)
    ctx = (x.tables[:, :, None] * bs + offs).flatten(1)  # [T, MAX_LEN] int32 slots
    keys, vals = k_cache[ctx], v_cache[ctx]
    idx = torch.arange(MAX_LEN, dtype=torch.int32, device=q.device)
    visible = idx[None, :] < x.seq_lens[:, None]  # [T, MAX_LEN]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    scores = torch.where(visible[:, None, :], scores, torch.full((), -1e30, device=q.device))
    probs = scores.softmax(-1)
    vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, vals).flatten(1)


def hash32(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x7FEB352D) & M32
    x = (((x >> 15) ^ x) * 0x846CA68B) & M32
    return (x >> 16) ^ x


def sample(logits: Tensor, x: Inputs) -> Tensor:
    """Gumbel-max with noise from a hash of (seed, position, token id)."""
    pos = x.positions if x.last is None else x.positions[x.last]
    key = hash32(hash32(x.seeds & M32) ^ ((pos * 0x9E3779B9) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = hash32(key[:, None] ^ ((ids * 0x632BE5AB) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / x.temps[:, None] - torch.log(-torch.log(u))
    return torch.where(x.sampled, noisy.argmax(-1), logits.argmax(-1))


PAD: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seq_lens": 1,  # a padding row sees only the null slot it wrote itself
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
}


def table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


class Int32MetaRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, bug: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"unknown mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.bug = bug
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buf64: dict[str, Tensor] = {}
        self.buf32: dict[str, Tensor] = {}
        if mode == "graph":
            self.allocate(SPEC.capture_sizes[-1])
            self.capture()

    # -- graph mode ------------------------------------------------------------------------------

    def allocate(self, rows: int) -> None:
        dev, i64 = self.be.device, torch.int64
        self.buf64 = {
            "tokens": torch.zeros(rows, dtype=i64, device=dev),
            "positions": torch.zeros(rows, dtype=i64, device=dev),
            "slots": torch.zeros(rows, dtype=i64, device=dev),
            "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
            "seq_lens": torch.ones(rows, dtype=i64, device=dev),
            "seeds": torch.zeros(rows, dtype=i64, device=dev),
            "temps": torch.ones(rows, device=dev),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
        }
        # the int32 copies the attention kernel reads, refreshed from buf64 before every replay
        self.buf32 = {k: torch.zeros_like(self.buf64[k], dtype=torch.int32) for k in INDEX}

    def graph_inputs(self, size: int) -> Inputs:
        b64, b32 = self.buf64, self.buf32
        return Inputs(
            tokens=b64["tokens"][:size],
            positions=b64["positions"][:size],
            slots=b32["slots"][:size],
            tables=b32["tables"][:size],
            seq_lens=b32["seq_lens"][:size],
            seeds=b64["seeds"][:size],
            temps=b64["temps"][:size],
            sampled=b64["sampled"][:size],
        )

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        self.prepare(Batch(()), SPEC.capture_sizes[-1])
        if self.bug:  # BUG: the int32 copies are made once, at capture, outside the graphs
            self.buf32 = {k: self.buf64[k].to(torch.int32) for k in INDEX}
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inputs = self.graph_inputs(size)
            self.run(inputs)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[size] = self.run(inputs)
            self.graphs[size] = g

    def prepare(self, batch: Batch, size: int) -> None:
        """Write the batch into the int64 buffers' prefix, padding rows after it, then convert."""
        n = batch.num_reqs
        rs = batch.requests
        samp = [sampling(r) for r in rs]
        rows: dict[str, list[Any]] = {
            "tokens": [r.tokens[0] for r in rs],
            "positions": [r.context_len for r in rs],
            "slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in rs],
            "tables": [table(r) for r in rs],
            "seq_lens": [r.context_len + 1 for r in rs],
            "seeds": [s[0] for s in samp],
            "temps": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        for name, values in rows.items():
            buf = self.buf64[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(PAD[name])
        if not self.bug:  # the correct runner converts into the persistent int32 buffers
            for name in INDEX:
                self.buf32[name][:size].copy_(self.buf64[name][:size])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ------------------------------------------------------------------------------

    def run(self, x: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(x, self.k_cache, self.v_cache)
        return logits, sample(logits, x)

    def eager_inputs(self, batch: Batch) -> Inputs:
        toks, pos, slots, tabs, lens, last = [], [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                p = r.context_len + i
                toks.append(t)
                pos.append(p)
                slots.append(kv_slot(r.block_ids, p, SPEC.block_size))
                tabs.append(table(r))
                lens.append(p + 1)
            last.append(len(toks) - 1)
        samp = [sampling(r) for r in batch.requests]
        dev = self.be.device

        def t(v: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(v, dtype=dtype, device=dev)

        return Inputs(
            tokens=t(toks),
            positions=t(pos),
            slots=t(slots).to(torch.int32),
            tables=t(tabs).view(-1, SPEC.max_blocks_per_req).to(torch.int32),
            seq_lens=t(lens).to(torch.int32),
            seeds=t([s[0] for s in samp]),
            temps=t([s[1] for s in samp], torch.float32),
            sampled=t([s[2] for s in samp], torch.bool),
            last=t(last),
        )

    def fallback(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "above the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback(batch)
        if reason is None:
            return self.replay(batch)
        logits, tokens = self.run(self.eager_inputs(batch))
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode == "eager":
            return {}
        return {**self.buf64, **{f"{k}_i32": v for k, v in self.buf32.items()}}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Int32MetaRunner:
    return Int32MetaRunner(mode, seed=seed, backend=backend, bug=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> Int32MetaRunner:
    return Int32MetaRunner(mode, seed=seed, backend=backend, bug=True)
