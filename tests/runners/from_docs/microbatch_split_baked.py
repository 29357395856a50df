"""A decode runner with dual-batch overlap (DBO / two-batch overlap): two micro-batches per step.

The model: token embedding + learned positions, two layers of (attention over a slot-major paged KV
cache read through block tables, SiLU MLP), LM head, counter-based sampling. Every step of two or
more tokens is split into two micro-batches, the first holding the first ceil(T/2) tokens, and the
layers run interleaved (micro-batch 0 layer i, micro-batch 1 layer i, ...), as an engine does to
overlap one micro-batch's communication with the other's compute (vLLM's DBO `ubatch_slices`,
SGLang's `--enable-two-batch-overlap`). Each micro-batch has its own attention metadata (its
slot mapping, block tables and query positions, re-based to its own row 0), built on the host
from the live batch's split, as vLLM's `split_attn_metadata` builds one per ubatch; in graph mode
those per-micro-batch metadata live in persistent buffers the graph reads.

Graph mode: one decode graph per (capture size, split point). The split point is derived from the
live batch (ceil(n/2) of its n real rows), so a capture size S has one graph for every split a
batch padded to S can have (S=8 serves n=5..8: splits 3 and 4). The micro-batches are static row
slices of the padded batch: micro-batch 0 is rows [0, split), micro-batch 1 rows [split, S), its
tail being the padding rows. Prefill, mixed and speculative steps and batches above the largest
capture size run eagerly through the same micro-batched forward.

Bug (`make_buggy_target`): the graphs are keyed by the capture size alone, and the split used to
slice the micro-batches is computed on the host at capture time from the capture (dummy) batch,
which fills all S rows, and baked in as a Python int slice (split = ceil(S/2)). The per-micro-batch
attention metadata are still built at replay from the live batch. A replay for a smaller batch
(n < S padded to S, with ceil(n/2) != ceil(S/2), e.g. n=5 or 6 on S=8) then slices the rows at
the wrong place: real rows of micro-batch 0 past the live split read padding rows' metadata (the
null block), and micro-batch 1's rows read the metadata of other rows (other requests' block
tables and slots). Full batches (n == S) are unaffected.

Modelled on: SGLang's two-batch-overlap CUDA-graph plugin, whose children's per-micro-batch
`num_token_non_padded` must be recomputed at replay from the live batch and written into a
persistent device buffer (https://github.com/sgl-project/sglang/pull/22404 "adjust capture time
num-non-padded-tokens to align capture with replay"; the review in
https://github.com/sgl-project/sglang/pull/33871 on the TBO child split computed from the padded
`len(input_ids)` vs the real token count, capture vs replay); and vLLM's DBO graph capture
(https://github.com/vllm-project/vllm/issues/43145: a ubatch CUDA graph stored under the wrong
token count, i.e. a graph key missing part of the ubatch split). No code was copied.
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
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 2, 16, 2
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
MIN_SPLIT_TOKENS = 2  # below this a step runs as one micro-batch
M32 = 0xFFFFFFFF


def split_point(num_tokens: int) -> int:
    """Rows in the first micro-batch: half the real tokens, rounded up (num_tokens if no split)."""
    return num_tokens if num_tokens < MIN_SPLIT_TOKENS else (num_tokens + 1) // 2


@dataclass
class UbMeta:
    """One micro-batch's attention metadata, rows re-based to the micro-batch's first row."""

    slots: Tensor  # [t] KV slot each token writes
    tables: Tensor  # [t, max_blocks]
    qpos: Tensor  # [t] query position (seq_len - 1)


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & M32
    x = ((x ^ (x >> 15)) * 0x735A2D97) & M32
    return x ^ (x >> 15)


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        for i in range(LAYERS):
            shapes.update(
                {
                    f"qkv{i}": (HIDDEN, 3 * HIDDEN),
                    f"o{i}": (HIDDEN, HIDDEN),
                    f"up{i}": (HIDDEN, 2 * HIDDEN),
                    f"down{i}": (2 * HIDDEN, HIDDEN),
                }
            )
        self.device = device
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(self.device))

    def layer(self, i: int, x: Tensor, meta: UbMeta, kv: tuple[Tensor, Tensor]) -> Tensor:
        w = self.w
        q, k, v = (_rms(x) @ w[f"qkv{i}"]).split(HIDDEN, dim=-1)
        k_cache, v_cache = kv
        k_cache.index_copy_(0, meta.slots, k.reshape(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, meta.slots, v.reshape(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        ctx = (meta.tables[:, :, None] * bs + torch.arange(bs, device=x.device)).flatten(1)
        keys, vals = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= meta.qpos[:, None]
        s = torch.einsum("thd,tchd->thc", q.reshape(-1, HEADS, HEAD_DIM), keys)
        p = (s / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", p, vals).flatten(1) @ w[f"o{i}"]
        return x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        split: int,
        metas: list[UbMeta],
        kv: list[tuple[Tensor, Tensor]],
    ) -> Tensor:
        """Micro-batch 0 is rows [0, split), micro-batch 1 the rest; layers interleave."""
        x = self.w["embed"][tokens] + self.w["pos"][positions]
        parts = [x[:split], x[split:]] if len(metas) == 2 else [x]
        for i in range(LAYERS):
            for u, meta in enumerate(metas):
                parts[u] = self.layer(i, parts[u], meta, kv[i])
        x = torch.cat(parts) if len(parts) == 2 else parts[0]
        return _rms(x) @ self.w["head"]


def sample(
    logits: Tensor, positions: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor
) -> Tensor:
    key = _hash(_hash(seeds) ^ ((positions * 0x5851F42D) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x4C957F2D) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _samp(r: Request) -> tuple[int, float, bool]:
    return (0, 1.0, False) if r.seed is None else (r.seed & M32, r.temperature, True)


def _token_rows(batch: Batch) -> dict[str, list[Any]]:
    """Per-token host rows of a batch, requests in order."""
    rows: dict[str, list[Any]] = {"tokens": [], "positions": [], "slots": [], "tables": []}
    for r in batch.requests:
        for i, t in enumerate(r.tokens):
            rows["tokens"].append(t)
            rows["positions"].append(r.context_len + i)
            rows["slots"].append(_slot(r, r.context_len + i))
            rows["tables"].append(_table(r))
    return rows


PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "qpos": 0,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
}


class DboRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, key_by_split: bool = True
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec, self.mode, self.key_by_split = SPEC, mode, key_by_split
        self.be: Any = get_backend(backend)
        dev = self.be.device
        with torch.inference_mode():
            self.model = Model(seed, dev)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.kv = [
                (torch.zeros(shape, device=dev), torch.zeros(shape, device=dev))
                for _ in range(LAYERS)
            ]
            self.graphs: dict[tuple[int, int], Any] = {}
            self.outputs: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            if mode == "graph":
                self.allocate(SPEC.capture_sizes[-1])
                self.capture()

    # -- graph mode --------------------------------------------------------------------------

    def allocate(self, n: int) -> None:
        dev, i64 = self.be.device, torch.int64
        b = {
            "tokens": torch.zeros(n, dtype=i64, device=dev),
            "positions": torch.zeros(n, dtype=i64, device=dev),
            "seeds": torch.zeros(n, dtype=i64, device=dev),
            "temps": torch.ones(n, device=dev),
            "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
        }
        for u in range(2):  # per-micro-batch attention metadata, each sized for a whole batch
            b[f"ub{u}_slots"] = torch.zeros(n, dtype=i64, device=dev)
            b[f"ub{u}_tables"] = torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev)
            b[f"ub{u}_qpos"] = torch.zeros(n, dtype=i64, device=dev)
        self.buffers = b

    def graph_keys(self) -> list[tuple[int, int]]:
        keys, prev = [], 0
        for size in SPEC.capture_sizes:
            if self.key_by_split:
                keys += sorted({(size, split_point(n)) for n in range(prev + 1, size + 1)})
            else:
                keys.append((size, split_point(size)))  # the capture batch fills all rows
            prev = size
        return keys

    def key_for(self, n: int) -> tuple[int, int]:
        size = next(s for s in SPEC.capture_sizes if s >= n)
        return (size, split_point(n)) if self.key_by_split else (size, split_point(size))

    def run_graph_inputs(self, size: int, split: int) -> tuple[Tensor, Tensor]:
        b = self.buffers
        metas = [UbMeta(b["ub0_slots"][:split], b["ub0_tables"][:split], b["ub0_qpos"][:split])]
        if split < size:
            rest = size - split
            metas.append(
                UbMeta(b["ub1_slots"][:rest], b["ub1_tables"][:rest], b["ub1_qpos"][:rest])
            )
        logits = self.model.forward(
            b["tokens"][:size], b["positions"][:size], split, metas, self.kv
        )
        toks = sample(
            logits, b["positions"][:size], b["seeds"][:size], b["temps"][:size], b["sampled"][:size]
        )
        return logits, toks

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size, split in sorted(self.graph_keys(), reverse=True):
            self.prepare(Batch(()), size)
            self.run_graph_inputs(size, split)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[(size, split)] = self.run_graph_inputs(size, split)
            self.graphs[(size, split)] = g

    def write(self, name: str, vals: list[Any], size: int) -> None:
        buf, n = self.buffers[name], len(vals)
        if n:
            buf[:n].copy_(torch.tensor(vals, dtype=buf.dtype))
        buf[n:size].fill_(PAD[name.split("_")[-1]])

    def prepare(self, batch: Batch, size: int) -> None:
        """Full-row inputs, then each micro-batch's metadata from the live batch's split."""
        rows, n = _token_rows(batch), batch.num_reqs
        split = split_point(n)
        samp = [_samp(r) for r in batch.requests]
        self.write("tokens", rows["tokens"], size)
        self.write("positions", rows["positions"], size)
        self.write("seeds", [s[0] for s in samp], size)
        self.write("temps", [s[1] for s in samp], size)
        self.write("sampled", [s[2] for s in samp], size)
        bounds = [(0, split), (split, n)]
        for u, (lo, hi) in enumerate(bounds):
            self.write(f"ub{u}_slots", rows["slots"][lo:hi], size)
            self.write(f"ub{u}_tables", rows["tables"][lo:hi], size)
            self.write(f"ub{u}_qpos", rows["positions"][lo:hi], size)

    def replay(self, batch: Batch) -> StepResult:
        key = self.key_for(batch.num_reqs)
        self.prepare(batch, key[0])
        self.graphs[key].replay()
        logits, toks = self.outputs[key]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), toks[:n].clone(), "full", ("decode", *key))

    # -- eager -------------------------------------------------------------------------------

    def eager(self, batch: Batch, reason: str) -> StepResult:
        rows = _token_rows(batch)
        dev, i64 = self.be.device, torch.int64

        def t(vals: list[Any], dtype: torch.dtype = i64) -> Tensor:
            return torch.tensor(vals, dtype=dtype, device=dev)

        num_tokens = len(rows["tokens"])
        split = split_point(num_tokens)
        bounds = [(0, split), (split, num_tokens)] if split < num_tokens else [(0, num_tokens)]
        metas = [
            UbMeta(
                t(rows["slots"][lo:hi]),
                t(rows["tables"][lo:hi]).view(-1, SPEC.max_blocks_per_req),
                t(rows["positions"][lo:hi]),
            )
            for lo, hi in bounds
        ]
        logits = self.model.forward(t(rows["tokens"]), t(rows["positions"]), split, metas, self.kv)
        last, end = [], 0
        for r in batch.requests:
            end += r.query_len
            last.append(end - 1)
        idx = t(last)
        logits = logits[idx]
        samp = [_samp(r) for r in batch.requests]
        toks = sample(
            logits,
            t(rows["positions"])[idx],
            t([s[0] for s in samp]),
            t([s[1] for s in samp], torch.float32),
            t([s[2] for s in samp], torch.bool),
        )
        return StepResult(logits, toks, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode" or any(q != 1 for q in batch.query_lens):
            return f"{batch.phase} batch / query length > 1"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    # -- contract ----------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            return self.replay(batch) if reason is None else self.eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{n}{i}": kv[j] for i, kv in enumerate(self.kv) for j, n in enumerate("kv")}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DboRunner:
    return DboRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DboRunner:
    # BUG: graphs keyed by capture size only; the split was computed at capture from the capture
    # batch (all S rows) and baked into the graph as a Python int slice.
    return DboRunner(mode, seed=seed, backend=backend, key_by_split=False)
