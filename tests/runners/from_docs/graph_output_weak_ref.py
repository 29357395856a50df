"""A TensorRT-LLM-style generation runner whose graph outputs and graph metadata share one pool.

The engine mechanism (TensorRT-LLM's PyTorch backend: `CUDAGraphRunner.capture`, the attention
metadata that `create_cuda_graph_metadata` makes per graph, and `memory_buffer_utils.Buffers`,
which allocates metadata buffers inside the shared graph pool): every CUDA graph of the engine is
captured into ONE memory pool, and the buffers each graph's attention metadata owns are carved from
that same pool when the graph is first needed. A graph's output (here its logits) is a block of the
pool too. After the capture TensorRT-LLM keeps that output only through `make_weak_ref`: a tensor
that aliases the block without owning it. The graph still writes its logits there at every replay,
but the allocator counts the block as free.

Here: a one-layer float32 decoder (token + learned position embedding, two-head attention over a
slot-major paged KV cache read through block tables, SiLU MLP, LM head). Generation batches (every
request continuing, all with the same query length q = 1 + drafts, up to 8 requests) replay a graph
keyed `(rows, q)`, rows padded to 1, 2, 4 or 8 with padding rows that write and read only the null
block; a graph is captured the first time its key is needed (warm-up and capture on an all-padding
batch, then the live batch is prepared and replayed). Everything else (prefills, mixed and uneven
speculative batches, more than 16 padded tokens) runs eagerly through the same forward, as does the
eager twin. Sampling is Gumbel-max with noise hashed from (seed, position, token id), on the host
side of the step, after the graph.

The shared pool is modelled by `GraphPoolArena`: one device byte tensor with a best-fit allocator,
standing for the pool's blocks. Two things are carved from it per graph, in this order at the
graph's first use: its metadata block (the query-start offsets of a uniform generation batch,
`arange(0, rows * q + 1, q)`, which never change for that graph and are therefore written once, when
the metadata is made: a value the replay reads but nobody rewrites before a replay) and its output
block (the capture's last operation writes the logits there, standing for the last kernel writing
its result into a block of the pool). The static inputs (tokens, positions, block tables) are
ordinary max-shape buffers rewritten before every replay.

The bug (`make_buggy_target`, `weak_graph_output=True`): after the capture the output block is given
back to the pool while the graph stays replayable, as a weak reference lets the allocator do. The
next graph captured takes its metadata (and output) from that freed block, best fit. From then on,
each replay of the earlier graph writes its logits over the later graph's query starts, and the
later graph's next replay reads logits bits as offsets: wrong rows, wrong KV slots or an index out
of range (an illegal memory access on a GPU). It shows only for a step order: graph A captured, then
graph B captured, then A replayed, then B replayed.
Reported as NVIDIA/TensorRT-LLM nvbugs 6525011 and fixed by PR #17010, "Store the owning output
tensor in _graph_output_refs for each graph's lifetime"
(https://github.com/NVIDIA/TensorRT-LLM/pull/17010): the capture kept the graph output only as a
non-owning weak ref, so a shared-graph-pool allocation could land on top of a live graph's output.
The fix keeps an owning reference per graph for as long as the graph lives (released only when the
graphs are reset), and still hands callers the weak view; here: the output block stays allocated
until `close()`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime import backends

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),  # rows of a generation graph; its tokens are rows * q
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
ROW_BUCKETS = SPEC.capture_sizes
POOL_BYTES = 1 << 16
POOL_ALIGN = 64  # the caching allocator rounds blocks; keeps every dtype view aligned
_M32 = 0xFFFFFFFF


@dataclass
class PoolBlock:
    offset: int
    size: int


class GraphPoolArena:
    """Best-fit blocks of one device byte tensor: the graph pool every capture shares."""

    def __init__(self, device: Any) -> None:
        self.memory = torch.zeros(POOL_BYTES, dtype=torch.uint8, device=device)
        self.free: list[PoolBlock] = [PoolBlock(0, POOL_BYTES)]

    def allocate(self, nbytes: int) -> PoolBlock:
        size = -(-nbytes // POOL_ALIGN) * POOL_ALIGN
        fitting = [b for b in self.free if b.size >= size]
        if not fitting:
            raise MemoryError(f"graph pool exhausted: {nbytes} bytes requested")
        best = min(fitting, key=lambda b: (b.size, b.offset))  # smallest block that fits
        self.free.remove(best)
        if best.size > size:
            self.free.append(PoolBlock(best.offset + size, best.size - size))
        return PoolBlock(best.offset, size)

    def release(self, block: PoolBlock) -> None:
        blocks = sorted([*self.free, PoolBlock(block.offset, block.size)], key=lambda b: b.offset)
        merged: list[PoolBlock] = []
        for b in blocks:  # coalesce neighbours, as the allocator merges free blocks of a segment
            if merged and merged[-1].offset + merged[-1].size == b.offset:
                merged[-1].size += b.size
            else:
                merged.append(b)
        self.free = merged

    def view(self, block: PoolBlock, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.memory[block.offset : block.offset + nbytes].view(dtype).view(shape)


@dataclass
class CapturedGraph:
    graph: Any
    query_start: Tensor  # the graph's metadata, in the pool, written once
    logits: Tensor  # the graph's output, in the pool
    output_block: PoolBlock | None  # owned while not None


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos_embed": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: the captured graphs read these tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _M32
    return x ^ (x >> 15)


class GenerationGraphRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, weak_graph_output: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.weak_graph_output = SPEC, mode, weak_graph_output
        self.be: Any = backends.get(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.arena = GraphPoolArena(dev)
            self.pool = self.be.graph_pool_handle()
            self.buffers = {  # shared by every graph, sliced per key, rewritten before each replay
                "tokens": torch.zeros(SPEC.max_num_tokens, dtype=torch.int32, device=dev),
                "positions": torch.zeros(SPEC.max_num_tokens, dtype=torch.int32, device=dev),
                "tables": torch.zeros(
                    SPEC.max_num_reqs, SPEC.max_blocks_per_req, dtype=torch.int32, device=dev
                ),
            }

    # -- the model ------------------------------------------------------------------------------

    def forward(self, tokens: Tensor, positions: Tensor, query_start: Tensor, tables: Tensor):
        """Logits at each row's last query token; stores this step's keys and values first."""
        w, dev = self.w.t, tokens.device
        starts = query_start.long()
        token_idx = torch.arange(tokens.shape[0], device=dev)
        row_of_token = (token_idx[:, None] >= starts[None, 1:]).sum(-1)
        pos = positions.long()
        table = tables.long()[row_of_token]  # [T, max_blocks]
        slot = table.gather(1, (pos // SPEC.block_size)[:, None]).squeeze(1) * SPEC.block_size
        slot = slot + pos % SPEC.block_size
        x = w["embed"][tokens.long()] + w["pos_embed"][pos]
        h = _rms(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slot, (h @ w["wk"]).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slot, (h @ w["wv"]).view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(SPEC.block_size, device=dev)
        ctx_slots = (table[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT]
        visible = torch.arange(CONTEXT, device=dev)[None, :] <= pos[:, None]
        scores = torch.einsum("thd,tchd->thc", q, self.k_cache[ctx_slots]) / math.sqrt(HEAD_DIM)
        scores = torch.where(visible[:, None, :], scores, torch.full((), -math.inf, device=dev))
        # masked values by `where`: a slot outside the row's context may hold NaN (the null block)
        vals = torch.where(
            visible[:, :, None, None], self.v_cache[ctx_slots], torch.zeros((), device=dev)
        )
        attn = torch.einsum("thc,tchd->thd", scores.softmax(-1), vals).flatten(1)
        x = x + attn @ w["wo"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        return _rms(x[starts[1:] - 1]) @ w["lm_head"]

    # -- routing --------------------------------------------------------------------------------

    def graph_key(self, batch: Batch) -> tuple[tuple[int, int] | None, str | None]:
        if self.mode == "eager":
            return None, "eager twin"
        reqs = batch.requests
        q = len(reqs[0].tokens)
        if any(len(r.tokens) != q or r.context_len == 0 for r in reqs):
            return None, "not a uniform generation batch"
        if batch.num_reqs > ROW_BUCKETS[-1]:
            return None, "more rows than the largest graph"
        rows = next(b for b in ROW_BUCKETS if b >= batch.num_reqs)
        if rows * q > SPEC.max_num_tokens:
            return None, "padded tokens exceed the static buffers"
        return (rows, q), None

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        key, reason = self.graph_key(batch)
        if key is None:
            return self.run_eager(batch, reason)
        entry = self.graphs.get(key) or self.capture(*key)
        self.prepare(batch.requests, *key)
        entry.graph.replay()
        logits = entry.logits[: batch.num_reqs].clone()  # the next replay overwrites the output
        return StepResult(logits, self.sample(logits, batch.requests), "full", key)

    # -- graph mode -----------------------------------------------------------------------------

    def prepare(self, reqs: Sequence[Request], rows: int, q: int) -> None:
        """Every row the graph reads, valid or padding: padding rows write the null block only."""
        tokens, positions, tables = [], [], []
        for r in reqs:
            tokens += r.tokens
            positions += range(r.context_len, r.context_len + q)
            tables.append(
                list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
            )
        for _ in range(rows - len(reqs)):
            tokens += [0] * q
            positions += range(q)
            tables.append([SPEC.null_block] * SPEC.max_blocks_per_req)
        buf = self.buffers
        buf["tokens"][: rows * q].copy_(torch.tensor(tokens, dtype=torch.int32))
        buf["positions"][: rows * q].copy_(torch.tensor(positions, dtype=torch.int32))
        buf["tables"][:rows].copy_(torch.tensor(tables, dtype=torch.int32))

    def capture(self, rows: int, q: int) -> CapturedGraph:
        # the graph's metadata, made at its first use from the shared pool
        meta_block = self.arena.allocate((rows + 1) * 4)
        query_start = self.arena.view(meta_block, torch.int32, (rows + 1,))
        # a uniform generation graph's query starts never change: written once, here
        query_start.copy_(torch.arange(0, rows * q + 1, q, dtype=torch.int32))
        output_block = self.arena.allocate(rows * SPEC.vocab_size * 4)
        logits = self.arena.view(output_block, torch.float32, (rows, SPEC.vocab_size))
        self.prepare((), rows, q)  # warm-up and capture on padding rows only
        buf = self.buffers
        inputs = (buf["tokens"][: rows * q], buf["positions"][: rows * q], query_start)
        self.forward(*inputs, buf["tables"][:rows])  # warm-up, outside the capture
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            logits.copy_(self.forward(*inputs, buf["tables"][:rows]))
        owned: PoolBlock | None = output_block
        if self.weak_graph_output:
            # make_weak_ref: the graph keeps writing there, but nobody owns the block any more
            self.arena.release(output_block)
            owned = None
        entry = self.graphs[(rows, q)] = CapturedGraph(graph, query_start, logits, owned)
        return entry

    # -- eager mode -----------------------------------------------------------------------------

    def run_eager(self, batch: Batch, reason: str | None) -> StepResult:
        reqs, dev = batch.requests, self.device
        tokens = [t for r in reqs for t in r.tokens]
        positions = [r.context_len + i for r in reqs for i in range(len(r.tokens))]
        starts = [0]
        for r in reqs:
            starts.append(starts[-1] + len(r.tokens))
        tables = [
            list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for r in reqs
        ]
        logits = self.forward(
            torch.tensor(tokens, dtype=torch.int32, device=dev),
            torch.tensor(positions, dtype=torch.int32, device=dev),
            torch.tensor(starts, dtype=torch.int32, device=dev),
            torch.tensor(tables, dtype=torch.int32, device=dev),
        )
        return StepResult(logits, self.sample(logits, reqs), "eager", None, reason)

    def sample(self, logits: Tensor, reqs: Sequence[Request]) -> Tensor:
        """Gumbel-max with noise from (seed, position of the last query token, token id)."""
        dev = logits.device
        seeds = torch.tensor([0 if r.seed is None else r.seed & _M32 for r in reqs], device=dev)
        pos = torch.tensor([r.seq_len - 1 for r in reqs], device=dev)
        temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
        sampled = torch.tensor([r.seed is not None for r in reqs], dtype=torch.bool, device=dev)
        key = _hash32(_hash32(seeds) ^ ((pos * 0x27D4EB2F) & _M32))
        ids = torch.arange(SPEC.vocab_size, device=dev)
        bits = _hash32(key[:, None] ^ ((ids * 0x165667B1) & _M32)[None, :])
        uniform = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
        noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
        return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))

    # -- contract -------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers  # not the pool: its metadata is written once per graph

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for entry in self.graphs.values():
            entry.graph.reset()
            if entry.output_block is not None:  # the owning reference dies with the graph
                self.arena.release(entry.output_block)
        self.graphs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return GenerationGraphRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return GenerationGraphRunner(mode, seed=seed, backend=backend, weak_graph_output=True)
