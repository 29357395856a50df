"""A padded decode runner whose LM head is a split-K GEMM with a cached scratch, with one real bug.

The mechanism: PyTorch's CUDA graph memory pools. A tensor allocated while a stream captures comes
from the graph's private pool (here one pool shared by every captured size, captured largest
first, as serving engines do), and that pool hands a capture the blocks that temporaries of the
same capture, or of an earlier capture into the same pool, gave back. The kernels that wrote those
temporaries are already recorded, so every replay of their graph writes the block again, whoever
owns it now. Memory a graph allocates is only safe to keep past the capture if it is the graph's
own output and nobody else relies on what it holds between replays.

The runner: decode graphs for 1, 2, 4 and 8 rows (one request a row, padding rows pointing at the
null block), everything else eager. For skinny batches (4 rows or fewer) the LM head runs as a
split-K GEMM: SPLITS partial products go to a workspace, each output row counts the splits that
arrived in an int32 arrival counter, and only the split that sees the counter reach SPLITS
reduces the partials into the row and puts the counter back to zero. The protocol needs the
counter to be zero whenever a launch starts; the launch that completes leaves it so. The
workspace and counter ("scratch") are made once per stream and cached by the stream, as the
kernel library's helper caches them per (device, stream).

The bug (`scratch_made_in_capture=True`): the captures run on a capture stream that no eager call
used, so the first split-K launch inside a capture (the 4-row graph, the largest split-K size)
misses the cache and makes the scratch there: from the shared graph pool, on blocks the 8-row
graph's temporaries used, with its zero-fill recorded in the 4-row graph alone. The 2- and 1-row
graphs, captured later, hit the cache and record no zero-fill. After construction (where a
capture runs nothing, so the counter holds what the pool held) or after any replay of the 8-row
graph (whose temporaries land on the counter), a 1- or 2-row replay that no 4-row replay
preceded finds a dirty counter: the arrivals never sum to SPLITS, no split reduces, the counter is
never reset, and the logits are whatever the output tile's memory held. A 4-row replay heals it
for a while. So it shows only for some sequences of batch sizes. Reported in ROCm/aiter for the
FlyDSL split-K GEMM under vLLM's graph capture:
https://github.com/ROCm/aiter/pull/5393 (the scratch cached per (device, stream) is allocated
inside the capture, aliases a transient, and later-captured graphs run with a dirty semaphore),
https://github.com/ROCm/aiter/pull/5430 (same defect, the minimal PyTorch demonstration of a
capture-time allocation aliasing a freed temporary of the capture) and, for why a capture is a
cache miss and why the zeroing must not hide in one graph,
https://github.com/ROCm/aiter/pull/4494 and https://github.com/ROCm/aiter/pull/4916.

The fix (`scratch_made_in_capture=False`): the scratch the captures will use is made before any
capture begins, from the ordinary allocator, as aiter's fixes allocate it on the eager path:
no graph's temporaries can land on it, and no graph needs to have run first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_POSITIONS = SPEC.max_blocks_per_req * SPEC.block_size
TABLE_SLOTS = SPEC.max_blocks_per_req * SPEC.block_size  # slots one row's block table covers
NULL_SLOT = SPEC.null_block * SPEC.block_size
SPLITS = 4  # split-K factor of the LM head GEMM
SPLIT_K_MAX_ROWS = 4  # the LM head takes the split-K kernel for this many rows or fewer
_LOW32 = 0xFFFFFFFF


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_POSITIONS, HIDDEN),
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
        for name in sorted(self.t):  # copied in place: the captured graphs read these tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


class SplitKScratch:
    """The split-K kernel's workspace for partial products and its per-row arrival counter."""

    def __init__(self, device: Any) -> None:
        self.workspace = torch.empty(SPLITS, SPLIT_K_MAX_ROWS, SPEC.vocab_size, device=device)
        self.arrivals = torch.zeros(SPLIT_K_MAX_ROWS, dtype=torch.int32, device=device)


class SplitKHead:
    """LM head GEMM; skinny inputs take the split-K kernel, whose scratch is cached per stream."""

    def __init__(self, weight: Tensor, backend: Any) -> None:
        self.weight, self.be = weight, backend
        self.scratch_by_stream: dict[int, SplitKScratch] = {}

    def scratch_for(self, stream: Any) -> SplitKScratch:
        key = stream.cuda_stream
        if key not in self.scratch_by_stream:  # made on the current stream, whatever it does
            self.scratch_by_stream[key] = SplitKScratch(self.weight.device)
        return self.scratch_by_stream[key]

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        if rows > SPLIT_K_MAX_ROWS:
            return x @ self.weight
        scratch = self.scratch_for(self.be.current_stream())
        chunk = HIDDEN // SPLITS
        partial = torch.einsum(
            "msk,skn->smn", x.view(rows, SPLITS, chunk), self.weight.view(SPLITS, chunk, -1)
        )
        workspace = scratch.workspace[:, :rows]
        workspace.copy_(partial)
        arrivals = scratch.arrivals[:rows]
        arrivals.add_(SPLITS)  # every split of a row arrives once
        # the split that brings the count to SPLITS is the last: only it reduces, and it resets
        # the counter; a counter that was not zero at the start never gets there
        reduced_here = arrivals == SPLITS
        untouched_tile = torch.empty(rows, SPEC.vocab_size, device=x.device)
        out = torch.where(reduced_here[:, None], workspace.sum(0), untouched_tile)
        arrivals.masked_fill_(reduced_here, 0)
        return out


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix of non-negative int64 values below 2**32 (no int64 overflow)."""
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _LOW32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _LOW32
    return x ^ (x >> 15)


def sample(logits: Tensor, seeds: Tensor, positions: Tensor, sampled: Tensor, temps: Tensor):
    """Gumbel-max with noise from (seed, position, token id): the same draw in any batch."""
    key = _hash32(_hash32(seeds & _LOW32) ^ positions)
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash32((key[:, None] + ids[None, :] * 0x9E37) & _LOW32)
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class SplitKDecodeRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, scratch_made_in_capture: bool):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.head = SplitKHead(self.w.t["head"], self.be)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            rows = max(SPEC.capture_sizes)
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=torch.int64, device=dev),
                "positions": torch.zeros(rows, dtype=torch.int64, device=dev),
                "slots": torch.zeros(rows, dtype=torch.int64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=torch.int64, device=dev),
                "seeds": torch.zeros(rows, dtype=torch.int64, device=dev),
                "temps": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
            }
            self.capture_stream = self.be.Stream()
            if not scratch_made_in_capture:
                # the fix: the captures' scratch comes from the ordinary allocator, now
                self.head.scratch_for(self.capture_stream)
            self.capture_all()

    # -- the model ---------------------------------------------------------------------------------

    def forward(self, tokens, positions, slots, tables, last: Tensor | None = None) -> Tensor:
        """Logits for T query tokens: each writes its K/V at `slots`, then attends to the slots of
        its row's block table up to its own position (causal within a prefill chunk)."""
        w = self.w.t
        x = w["embed"][tokens] + w["pos"][positions]
        q = (x @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        k = (x @ w["wk"]).view(-1, HEADS, HEAD_DIM)
        v = (x @ w["wv"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        offsets = torch.arange(SPEC.block_size, device=x.device)
        table_slots = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, S]
        visible = torch.arange(TABLE_SLOTS, device=x.device)[None, :] <= positions[:, None]
        keys, vals = self.k_cache[table_slots], self.v_cache[table_slots]  # [T, S, H, D]
        zero = torch.zeros((), device=x.device)
        keys = torch.where(visible[:, :, None, None], keys, zero)  # unlisted slots may hold NaN
        vals = torch.where(visible[:, :, None, None], vals, zero)
        scores = torch.einsum("thd,tshd->ths", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), -math.inf, device=x.device)
        )
        attn = torch.einsum("ths,tshd->thd", scores.softmax(-1), vals).flatten(1)
        x = x + attn @ w["wo"]
        x = x + torch.nn.functional.silu(x @ w["up"]) @ w["down"]
        if last is not None:
            x = x[last]
        return self.head(x)

    def decode_step(self, inputs: Mapping[str, Tensor], rows: int) -> tuple[Tensor, Tensor]:
        logits = self.forward(
            inputs["tokens"][:rows],
            inputs["positions"][:rows],
            inputs["slots"][:rows],
            inputs["tables"][:rows],
        )
        tokens = sample(
            logits,
            inputs["seeds"][:rows],
            inputs["positions"][:rows],
            inputs["sampled"][:rows],
            inputs["temps"][:rows],
        )
        return logits, tokens

    # -- graph mode --------------------------------------------------------------------------------

    def capture_all(self) -> None:
        self.pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):  # largest first, one shared pool
            self.prepare(Batch(()), size)
            self.decode_step(self.buffers, size)  # warm-up, eager, on the current stream
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=self.pool, stream=self.capture_stream):
                self.outputs[size] = self.decode_step(self.buffers, size)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        """Write every row the graph reads: the batch's, then padding rows on the null block."""
        rows = list(batch.requests)
        pad = size - len(rows)
        table_width = SPEC.max_blocks_per_req
        tables = [
            list(r.block_ids) + [SPEC.null_block] * (table_width - len(r.block_ids)) for r in rows
        ]
        host = {
            "tokens": [r.tokens[0] for r in rows] + [0] * pad,
            "positions": [r.context_len for r in rows] + [0] * pad,
            "slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in rows]
            + [NULL_SLOT] * pad,
            "tables": tables + [[SPEC.null_block] * table_width] * pad,
            "seeds": [0 if r.seed is None else r.seed & _LOW32 for r in rows] + [0] * pad,
            "temps": [float(r.temperature) for r in rows] + [1.0] * pad,
            "sampled": [r.seed is not None for r in rows] + [False] * pad,
        }
        for name, values in host.items():
            buf = self.buffers[name]
            buf[:size].copy_(torch.tensor(values, dtype=buf.dtype).to(self.device))

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if any(len(r.tokens) != 1 for r in batch.requests):
            return "query length above one (prefill or mixed)"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more rows than the largest graph"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self.run_eager(batch, reason)
        n = batch.num_reqs
        size = next(s for s in SPEC.capture_sizes if s >= n)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        reqs = batch.requests
        dev = self.device

        def tensor(values: list, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        positions = [r.context_len + i for r in reqs for i in range(len(r.tokens))]
        slots = [
            kv_slot(r.block_ids, p, SPEC.block_size)
            for r in reqs
            for p in range(r.context_len, r.seq_len)
        ]
        tables = [
            list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for r in reqs
            for _ in r.tokens
        ]
        last, end = [], 0
        for r in reqs:
            end += len(r.tokens)
            last.append(end - 1)
        logits = self.forward(
            tensor([t for r in reqs for t in r.tokens]),
            tensor(positions),
            tensor(slots),
            tensor(tables),
            last=tensor(last),
        )
        tokens = sample(
            logits,
            tensor([0 if r.seed is None else r.seed & _LOW32 for r in reqs]),
            tensor([r.seq_len - 1 for r in reqs]),
            tensor([r.seed is not None for r in reqs], torch.bool),
            tensor([float(r.temperature) for r in reqs], torch.float32),
        )
        return StepResult(logits, tokens, "eager", None, reason)

    # -- contract ----------------------------------------------------------------------------------

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
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return SplitKDecodeRunner(mode, seed=seed, backend=backend, scratch_made_in_capture=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return SplitKDecodeRunner(mode, seed=seed, backend=backend, scratch_made_in_capture=True)
