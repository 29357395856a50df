"""A decode runner modelled on vLLM's FlashAttention-3 backend with ahead-of-time scheduler
metadata under FULL CUDA graphs, with one real bug.

The engine mechanism: FA3's varlen forward can take `scheduler_metadata`, made ahead of time by
`get_scheduler_metadata` (the "prepare" step) from the batch's sequence lengths, instead of
preparing it inside the attention call. With full CUDA graphs vLLM builds it in the metadata
builder, outside the graph, and copies it into one persistent buffer that every captured graph
reads (zeroing the buffer past the part it wrote). The buffer is a concatenation of per-request
vectors: since FA3's sort/swizzle update (sources at the end) they are the dynamic split count of
each request, its number of query tiles, and the longest-first order in which the persistent
kernel visits requests, each vector starting at a multiple of `round_up(batch_size, 4)`. The
kernel finds the vectors with the batch size it is launched with, and inside a captured graph that
is the batch size of the capture.

Here: a one-layer float32 decoder (token and learned position embeddings, two-head attention over
a slot-major paged KV cache, SiLU MLP, LM head). Attention is one split-KV kernel for every path:
each query token is a "request row" of the kernel with its own sequence length (its position + 1)
and block table; the kernel reads the three vectors from the metadata buffer with the stride of
the row count it was called with, visits rows in the planned order, cuts each row's context into
its planned number of chunks (at most `MAX_SPLITS`, the split workspace the grid was captured
with), merges the chunks by log-sum-exp and writes each visited row of its output buffer; a row
it never visits (or visits with no tiles) keeps what the buffer held, as FA3 leaves `out` alone.
Decode batches (one query token per request) of up to 16 requests replay a graph captured per
padded request count (capture sizes 1, 2, 4, 8, 16, like vLLM's default ladder), whose padding
rows have sequence length 0 and point at the null block. Everything else, and every step of the
eager twin, runs the same kernel eagerly with metadata planned for exactly its rows. Sampling runs
after the forward: Gumbel-max with noise hashed from (seed, position, token id).

The bug (`plan_unpadded=True`): the metadata is planned for the batch's real request count `n`
and copied into the persistent buffer (tail zeroed) while the replayed graph's kernel reads it as
planned for the padded count `B` it was captured with. vLLM built attention metadata before it
decided how far a batch is padded for its graph, so an ahead-of-time scheduler saw fewer requests
than the graph runs (https://github.com/vllm-project/vllm/issues/23789, which names FA3 and
FlashMLA). While the per-request vectors sat at a fixed offset this was harmless (the padding rows
read the zeroed tail); with vectors at multiples of `round_up(b, 4)` the kernel reads the
query-tile counts and the visiting order at the wrong offsets whenever `round_up(n, 4) !=
round_up(B, 4)`: here only for 9 to 12 requests on the graph of 16 (5-8 on the graph of 8 and 3-4
on the graph of 4 share their graph's stride, and the bug stays silent there). Most rows are then
never visited and keep an earlier replay's attention output; others are cut short by a split
count read from the wrong vector. In vLLM's Model Runner V2 the same mismatch hung decoding under
FA3 full graphs; https://github.com/vllm-project/vllm/pull/35918 (closed without being merged)
padded the request count to the captured one before building the metadata. The v1 runner was
fixed the same way, by padding before building attention metadata
(https://github.com/vllm-project/vllm/pull/28579). That is what the correct runner does: it plans
for `B` rows, the padding rows with sequence length 0 (no splits, no tiles), so the plan's layout
is the one the graph reads. Upstream layout: vllm-project/flash-attention PR #82
(https://github.com/vllm-project/flash-attention/pull/82), brought into vLLM by
https://github.com/vllm-project/vllm/pull/34043.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=128,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=16,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8, 16),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_CTX = SPEC.max_blocks_per_req * SPEC.block_size
MAX_ROWS = max(SPEC.max_num_tokens, SPEC.capture_sizes[-1])
NULL_SLOT = SPEC.null_block * SPEC.block_size
MAX_SPLITS = 4  # split workspace of the kernel's grid (vLLM fixes max_num_splits under graphs)
KV_TILE = 8  # positions per KV tile: a row is never cut into more chunks than it has tiles
NUM_SMS = 16  # the split heuristic fills this many "SMs" with (row, head, split) tiles
META_ALIGN = 4  # FA3 rounds the batch up to 4 for 16-byte aligned vectors
META_VECTORS = 3  # per row: split count, query tiles; then the visiting order
_M32 = 0xFFFFFFFF


def meta_stride(rows: int) -> int:
    return -(-rows // META_ALIGN) * META_ALIGN


META_LEN = META_VECTORS * meta_stride(MAX_ROWS)


def planned_splits(seq_len: int, rows: int) -> int:
    """Split count of one row: enough tiles to fill the SMs, no more chunks than KV tiles."""
    if seq_len <= 0:
        return 0
    wanted = -(-NUM_SMS // (rows * HEADS))
    return max(1, min(wanted, -(-seq_len // KV_TILE), MAX_SPLITS))


def plan_schedule(seq_lens: Sequence[int]) -> list[int]:
    """The ahead-of-time scheduler metadata for exactly these rows (FA3's prepare step)."""
    rows = len(seq_lens)
    pad = [0] * (meta_stride(rows) - rows)
    splits = [planned_splits(n, rows) for n in seq_lens]
    query_tiles = [1 if n > 0 else 0 for n in seq_lens]  # one query token per row here
    order = sorted(range(rows), key=lambda i: (-seq_lens[i], i))  # longest first
    return splits + pad + query_tiles + pad + order + pad


def split_kv_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    seq_lens: Tensor,
    meta: Tensor,
    rows: int,
    out: Tensor,
) -> Tensor:
    """The kernel: `rows` is a launch argument, so a captured graph keeps the capture's."""
    stride = meta_stride(rows)
    order = meta[2 * stride : 2 * stride + rows].long()  # visit i handles row order[i]
    splits = meta[0:rows].long()[order]
    query_tiles = meta[stride : stride + rows].long()[order]
    qv, lens, table = q[order], seq_lens[order], tables[order]
    pos = torch.arange(MAX_CTX, device=q.device)
    slots = table[:, pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size
    keys, vals = k_cache[slots], v_cache[slots]  # [rows, MAX_CTX, heads, dim]
    chunk = torch.clamp(-(-lens // torch.clamp(splits, min=1)), min=1)
    split_of = pos[None, :] // chunk[:, None]
    # chunks past the workspace are never launched: the grid was sized for MAX_SPLITS
    live = (pos[None, :] < lens[:, None]) & (split_of < splits[:, None]) & (split_of < MAX_SPLITS)
    scores = torch.einsum("rhd,rchd->rhc", qv, keys) / math.sqrt(HEAD_DIM)
    neg_inf = torch.full((), -math.inf, device=q.device)
    zero = torch.zeros((), device=q.device)
    vals = torch.where(live[:, :, None, None], vals, zero)  # masked slots may hold NaN
    part_out, part_lse = [], []
    for split in range(MAX_SPLITS):
        mask = (live & (split_of == split))[:, None, :]
        masked = torch.where(mask, scores, neg_inf)
        lse = torch.logsumexp(masked, -1)  # [rows, heads]; -inf for an empty chunk
        finite = torch.isfinite(lse)
        probs = torch.where(
            mask, torch.exp(masked - torch.where(finite, lse, zero)[..., None]), zero
        )
        part_out.append(torch.einsum("rhc,rchd->rhd", probs, vals))
        part_lse.append(lse)
    lse_all = torch.stack(part_lse)  # [splits, rows, heads]
    total = torch.logsumexp(lse_all, 0)
    total = torch.where(torch.isfinite(total), total, zero)
    weights = torch.where(torch.isfinite(lse_all), torch.exp(lse_all - total), zero)
    merged = (weights[..., None] * torch.stack(part_out)).sum(0)
    visited = ((splits > 0) & (query_tiles > 0))[:, None, None]
    out.index_copy_(0, order, torch.where(visited, merged, out[order]))
    return out[:rows]


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_CTX, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: the captured graphs read these tensors
            w = self.t[name]
            w.copy_(
                (torch.randn(w.shape, generator=gen) * 1.5 / math.sqrt(w.shape[0])).to(w.device)
            )


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _M32
    return x ^ (x >> 15)


class Fa3AotScheduleRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, plan_unpadded: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.plan_unpadded = SPEC, mode, plan_unpadded
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.graph_logits: dict[int, Tensor] = {}
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=torch.int64, device=dev),
                "positions": torch.zeros(rows, dtype=torch.int64, device=dev),
                "slots": torch.zeros(rows, dtype=torch.int64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=torch.int64, device=dev),
                "seq_lens": torch.zeros(rows, dtype=torch.int64, device=dev),
                "scheduler_metadata": torch.zeros(META_LEN, dtype=torch.int32, device=dev),
            }
            # the attention output the kernel writes in place: not an input, never rewritten
            self.attn_out = torch.zeros(rows, HEADS, HEAD_DIM, device=dev)
            self.capture()

    # -- model ------------------------------------------------------------------------------------

    def forward(self, tokens, positions, slots, tables, seq_lens, meta, rows: int, out, last=None):
        w = self.w.t
        x = w["embed"][tokens] + w["pos"][positions]
        h = _norm(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, (h @ w["wk"]).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, (h @ w["wv"]).view(-1, HEADS, HEAD_DIM))
        attn = split_kv_attention(q, self.k_cache, self.v_cache, tables, seq_lens, meta, rows, out)
        x = x + attn.flatten(1) @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        if last is not None:
            x = x[last]
        return _norm(x) @ w["head"]

    # -- graphs -----------------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):  # largest first, one pool
            self.prepare(Batch(()), size)  # every row is padding while warming up and capturing
            args = self.graph_args(size)
            self.forward(*args)
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.graph_logits[size] = self.forward(*args)
            self.graphs[size] = graph

    def graph_args(self, size: int) -> tuple:
        b = self.buffers
        return (
            b["tokens"][:size],
            b["positions"][:size],
            b["slots"][:size],
            b["tables"][:size],
            b["seq_lens"][:size],
            b["scheduler_metadata"],
            size,
            self.attn_out,
        )

    def prepare(self, batch: Batch, size: int) -> None:
        """Write the batch into the static buffers' first rows and reset rows n..size."""
        reqs, pad = batch.requests, size - batch.num_reqs
        b, dev = self.buffers, self.device
        seq_lens = [r.seq_len for r in reqs]
        tables = [_table_row(r.block_ids) for r in reqs] + [_table_row(())] * pad
        b["tokens"][:size].copy_(torch.tensor([r.tokens[0] for r in reqs] + [0] * pad))
        b["positions"][:size].copy_(torch.tensor([r.context_len for r in reqs] + [0] * pad))
        slots = [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs]
        b["slots"][:size].copy_(torch.tensor(slots + [NULL_SLOT] * pad))
        b["tables"][:size].copy_(torch.tensor(tables, dtype=torch.int64))
        b["seq_lens"][:size].copy_(torch.tensor(seq_lens + [0] * pad))
        if self.plan_unpadded:  # planned before the batch is padded for the graph
            plan = plan_schedule(seq_lens)
        else:  # padded first: the plan covers every row the graph's kernel visits
            plan = plan_schedule(seq_lens + [0] * pad)
        meta = torch.zeros(META_LEN, dtype=torch.int32)
        meta[: len(plan)] = torch.tensor(plan, dtype=torch.int32)
        b["scheduler_metadata"].copy_(meta.to(dev))  # the tail past the plan zeroed, as vLLM does

    def graph_size(self, batch: Batch) -> int | None:
        if batch.num_reqs == 0 or any(r.query_len != 1 for r in batch.requests):
            return None  # prefill, mixed and speculative rows: more than one query token
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    # -- steps ------------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        if self.mode == "eager":
            return self.run_eager(batch, "eager twin")
        size = self.graph_size(batch)
        if size is None:
            return self.run_eager(batch, "not a decode batch a captured graph fits")
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits = self.graph_logits[size][: batch.num_reqs].clone()
        return StepResult(logits, self.sample(logits, batch.requests), "full", ("decode", size))

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        reqs, dev = batch.requests, self.device
        tokens, positions, slots, tables, seq_lens, last = [], [], [], [], [], []
        for r in reqs:
            for i, token in enumerate(r.tokens):
                pos = r.context_len + i
                tokens.append(token)
                positions.append(pos)
                slots.append(kv_slot(r.block_ids, pos, SPEC.block_size))
                tables.append(_table_row(r.block_ids))
                seq_lens.append(pos + 1)  # causal: a token sees its request up to itself
            last.append(len(tokens) - 1)
        rows = len(tokens)
        logits = self.forward(
            torch.tensor(tokens, device=dev),
            torch.tensor(positions, device=dev),
            torch.tensor(slots, device=dev),
            torch.tensor(tables, dtype=torch.int64, device=dev),
            torch.tensor(seq_lens, device=dev),
            torch.tensor(plan_schedule(seq_lens), dtype=torch.int32, device=dev),
            rows,
            torch.zeros(rows, HEADS, HEAD_DIM, device=dev),
            last=torch.tensor(last, device=dev),
        )
        return StepResult(logits, self.sample(logits, reqs), "eager", None, reason)

    def sample(self, logits: Tensor, reqs: Sequence[Request]) -> Tensor:
        dev = self.device
        seeds = torch.tensor([0 if r.seed is None else r.seed & _M32 for r in reqs], device=dev)
        pos = torch.tensor([r.seq_len - 1 for r in reqs], device=dev)
        temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
        sampled = torch.tensor([r.seed is not None for r in reqs], device=dev)
        ids = torch.arange(SPEC.vocab_size, device=dev)
        key = _hash(_hash(seeds) ^ ((pos * 0x9E3779B1) & _M32))
        bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
        uniform = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
        noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
        return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_logits.clear()


def _table_row(block_ids: Sequence[int]) -> list[int]:
    ids = list(block_ids)
    return ids + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(ids))


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return Fa3AotScheduleRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return Fa3AotScheduleRunner(mode, seed=seed, backend=backend, plan_unpadded=True)
