"""A tiny MoE decoder with Switch-style capacity routing, graph mode via the facade.

One layer: token embedding + learned positions, attention over a slot-major paged KV cache (block
tables), then a top-1 mixture-of-experts MLP with a per-expert capacity
ceil(1.25 * tokens / experts) computed from the tokens of the forward. Tokens are admitted to their
expert in batch-prioritized order (higher gate probability first, ties by row); tokens over capacity
are dropped (MLP output zero). Graph mode captures one decode graph per capture size (facade:
backend.Graph / backend.graph) and replays decode batches that fit; everything else runs eagerly.

make_target: the MoE sees a `valid` mask of the padded batch; padding rows are not routed and the
capacity is computed from the real token count. make_buggy_target: the graph's MoE routes every row
of the padded batch (padding included) and computes the capacity from the padded row count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=128,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    batch_invariant=False,  # capacity routing: a token may be dropped for its company
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
EXPERTS, FFN = 4, 64
CAPACITY_NUM, CAPACITY_DEN = 5, 4  # capacity factor 1.25
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temps: Tensor  # [R]
    sampled: Tensor  # [R] bool
    valid: Tensor | None = None  # [T] bool, None: every row is a real token
    last: Tensor | None = None  # [R] last token of each request; None: T == R


class MoEDecoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "router": (HIDDEN, EXPERTS),
            "up": (EXPERTS, HIDDEN, FFN),
            "down": (EXPERTS, FFN, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            fan_in = t.shape[-2] if t.dim() > 1 else 1
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(fan_in)).to(t.device))

    def forward(self, x_in: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][x_in.tokens] + w["pos"][x_in.positions]
        h = norm(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, x_in.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x_in.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + paged_attention(q, k_cache, v_cache, x_in) @ w["wo"]
        x = x + self.moe(norm(x), x_in.valid)
        if x_in.last is not None:
            x = x[x_in.last]
        return norm(x) @ w["lm_head"]

    def moe(self, h: Tensor, valid: Tensor | None) -> Tensor:
        w = self.w
        rows = h.shape[0]
        idx = torch.arange(rows, device=h.device)
        if valid is None:
            valid = torch.ones(rows, dtype=torch.bool, device=h.device)
        gate, expert = (h @ w["router"]).softmax(-1).max(-1)  # top-1
        count = valid.to(torch.int64).sum()
        capacity = torch.div(
            count * CAPACITY_NUM + CAPACITY_DEN * EXPERTS - 1,
            CAPACITY_DEN * EXPERTS,
            rounding_mode="floor",
        )
        # rank of token i in its expert's queue: valid tokens of the same expert ahead of it
        ahead = (gate[None, :] > gate[:, None]) | (
            (gate[None, :] == gate[:, None]) & (idx[None, :] < idx[:, None])
        )
        same = expert[None, :] == expert[:, None]
        rank = (same & ahead & valid[None, :]).to(torch.int64).sum(-1)
        keep = valid & (rank < capacity)
        up = torch.einsum("th,ehf->tef", h, w["up"])
        out = torch.einsum("tef,efh->teh", torch.nn.functional.silu(up), w["down"])
        chosen = out.gather(1, expert[:, None, None].expand(rows, 1, HIDDEN)).squeeze(1)
        return torch.where(keep[:, None], chosen * gate[:, None], torch.zeros((), device=h.device))


def norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, x_in: Inputs) -> Tensor:
    bs = SPEC.block_size
    slots = (x_in.tables[:, :, None] * bs + torch.arange(bs, device=q.device)).flatten(1)
    keys, values = k_cache[slots], v_cache[slots]  # [T, CONTEXT, heads, dim]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= x_in.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def sample(logits: Tensor, x_in: Inputs) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id)."""
    pos = x_in.positions if x_in.last is None else x_in.positions[x_in.last]
    key = hash32(hash32(x_in.seeds) ^ ((pos * 0x61C88647) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = hash32(key[:, None] ^ ((ids * 0x3243F6A9) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / x_in.temps[:, None] - torch.log(-torch.log(u))
    return torch.where(x_in.sampled, noisy.argmax(-1), logits.argmax(-1))


PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
    "valid": False,
}


def slot_of(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def table_of(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def sampling_of(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


class MoERunner:
    def __init__(self, mode: str, *, seed: int, backend: str, route_padding: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.route_padding = route_padding
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = MoEDecoder(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            rows, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.zeros(rows, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(rows, dtype=i64, device=dev),
                "temps": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
                "valid": torch.zeros(rows, dtype=torch.bool, device=dev),
            }
            self.capture()

    # graph mode
    def graph_inputs(self, size: int) -> Inputs:
        x_in = Inputs(**{k: b[:size] for k, b in self.buffers.items()})
        if self.route_padding:
            x_in.valid = None  # BUG: the MoE routes every row of the padded batch
        return x_in

    def run(self, x_in: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(x_in, self.k_cache, self.v_cache)
        return logits, sample(logits, x_in)

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in reversed(SPEC.capture_sizes):
            self.prepare(Batch(()), size)
            x_in = self.graph_inputs(size)
            self.run(x_in)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[size] = self.run(x_in)
            self.graphs[size] = g

    def prepare(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        samp = [sampling_of(r) for r in reqs]
        values = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [slot_of(r, r.context_len) for r in reqs],
            "tables": [table_of(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temps": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
            "valid": [True] * n,
        }
        for name, vals in values.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(vals, dtype=buf.dtype))
            buf[n:size].fill_(PAD[name])

    def replay(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        size = next(s for s in SPEC.capture_sizes if s >= n)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # both modes
    def eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.be.device
        tokens, positions, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                tokens.append(t)
                positions.append(r.context_len + i)
                slots.append(slot_of(r, r.context_len + i))
                tables.append(table_of(r))
            last.append(len(tokens) - 1)
        samp = [sampling_of(r) for r in batch.requests]

        def t(v: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(v, dtype=dtype, device=dev)

        x_in = Inputs(
            tokens=t(tokens),
            positions=t(positions),
            slots=t(slots),
            tables=t(tables).view(-1, SPEC.max_blocks_per_req),
            seeds=t([s[0] for s in samp]),
            temps=t([s[1] for s in samp], torch.float32),
            sampled=t([s[2] for s in samp], torch.bool),
            valid=None,  # every row of an eager step is a real token
            last=t(last),
        )
        logits, next_tokens = self.run(x_in)
        return StepResult(logits, next_tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
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
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.k_cache, "v0": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> MoERunner:
    return MoERunner(mode, seed=seed, backend=backend, route_padding=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> MoERunner:
    return MoERunner(mode, seed=seed, backend=backend, route_padding=True)
