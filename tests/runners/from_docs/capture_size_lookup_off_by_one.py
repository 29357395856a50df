"""A small paged-KV decode runner written against plain `torch.cuda` (CUDA graphs per capture size).

Graph mode captures one `torch.cuda.CUDAGraph` per capture size (1, 2, 4, 8), largest first into one
shared pool. Inputs live in static max-size buffers (one int64 row matrix, one float32 temperature
vector) that are staged in pinned host memory and uploaded on a side stream; each graph writes its
results into the first `size` rows of static max-size output buffers. A decode batch of n requests
replays the graph of the smallest capture size >= n, with rows n..size padded onto the null block.
Prefill, mixed, speculative-decode and oversize batches run eagerly.

`make_target` is the correct runner; `make_buggy_target` has the classic bisect mistake in the
capture-size lookup (largest size <= n instead of smallest size >= n).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM, FFN = 48, 3, 16, 96
SPEC = TargetSpec(
    num_blocks=48,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=160,
    max_num_reqs=10,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
# int64 row layout: token, position, slot, seed (31 bits), sampled flag, then the block table
TOKEN, POSITION, SLOT, SEED, SAMPLED, TABLE = 0, 1, 2, 3, 4, 5
WIDTH = TABLE + SPEC.max_blocks_per_req
MASK31 = (1 << 31) - 1


def _seed31(seed: int) -> int:
    return (seed ^ (seed >> 31) ^ (seed >> 62)) & MASK31


def _row(request: Request, i: int) -> list[int]:
    """The int64 row of query token i of `request`."""
    position = request.context_len + i
    table = list(request.block_ids) + [SPEC.null_block] * (
        SPEC.max_blocks_per_req - len(request.block_ids)
    )
    sampled = request.seed is not None
    seed = _seed31(request.seed) if sampled else 0
    return [
        request.tokens[i],
        position,
        kv_slot(request.block_ids, position, SPEC.block_size),
        seed,
        int(sampled),
        *table,
    ]


def _temperature(request: Request) -> float:
    return float(request.temperature) if request.seed is not None else 1.0


PADDING_ROW = [0, 0, NULL_SLOT, 0, 0] + [SPEC.null_block] * SPEC.max_blocks_per_req


def _mix(x: Tensor) -> Tensor:
    """A 31-bit integer hash, elementwise, with no overflow in int64."""
    for mul, add in ((1103515245, 12345), (214013, 2531011), (69069, 1)):
        x = (x * mul + add) & MASK31
        x = x ^ (x >> 13)
    return x


class DecodeRunner:
    def __init__(self, *, graphs: bool, seed: int, buggy: bool) -> None:
        self.device = torch.device("cuda")
        self.buggy = buggy
        self.sizes = sorted(SPEC.capture_sizes)
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "w1": (HIDDEN, FFN),
            "w2": (FFN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {n: torch.empty(s, device=self.device) for n, s in shapes.items()}
        self.load_weights(seed)
        slots = SPEC.num_slots
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if graphs:
            rows = self.sizes[-1]
            self.staging = torch.zeros(rows, WIDTH, dtype=torch.int64, pin_memory=True)
            self.staging_temps = torch.ones(rows, dtype=torch.float32, pin_memory=True)
            self.static_rows = torch.zeros(rows, WIDTH, dtype=torch.int64, device=self.device)
            self.static_temps = torch.ones(rows, dtype=torch.float32, device=self.device)
            self.out_logits = torch.zeros(rows, SPEC.vocab_size, device=self.device)
            self.out_tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self.copy_stream = torch.cuda.Stream()
            self.uploaded = torch.cuda.Event()
            self._capture()

    def load_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))  # in place: the graphs read these tensors

    # -- graphs ---------------------------------------------------------------------------------

    def capture_size(self, n: int) -> int | None:
        """The capture size whose graph serves a decode batch of n requests."""
        if n < 1 or n > self.sizes[-1]:
            return None
        if self.buggy:
            i = bisect.bisect_right(self.sizes, n) - 1  # BUG: largest size <= n
        else:
            i = bisect.bisect_left(self.sizes, n)  # smallest size >= n
        return self.sizes[i]

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._upload([], [], size)  # every row is padding during warm-up and capture
            self._graph_body(size)  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._graph_body(size)
            self.graphs[size] = graph

    def _graph_body(self, size: int) -> None:
        logits, tokens = self._forward(self.static_rows[:size], self.static_temps[:size])
        self.out_logits[:size].copy_(logits)
        self.out_tokens[:size].copy_(tokens)

    def _upload(self, rows: Sequence[list[int]], temps: Sequence[float], size: int) -> None:
        """Stage the batch's rows then padding rows up to `size` in pinned memory, upload them on
        the copy stream, and make the current stream wait for the upload."""
        self.uploaded.synchronize()  # the previous upload has read the staging buffers
        for i in range(size):
            if i < len(rows):
                self.staging[i] = torch.tensor(rows[i], dtype=torch.int64)
                self.staging_temps[i] = temps[i]
            else:
                self.staging[i] = torch.tensor(PADDING_ROW, dtype=torch.int64)
                self.staging_temps[i] = 1.0
        current = torch.cuda.current_stream()
        self.copy_stream.wait_stream(current)  # earlier work has read the static buffers
        with torch.cuda.stream(self.copy_stream):
            self.static_rows[:size].copy_(self.staging[:size], non_blocking=True)
            self.static_temps[:size].copy_(self.staging_temps[:size], non_blocking=True)
            self.uploaded.record()
        current.wait_event(self.uploaded)

    def decode(self, batch: Batch) -> tuple[Tensor, Tensor, int]:
        n = batch.num_reqs
        size = self.capture_size(n)
        assert size is not None
        rows = [_row(r, 0) for r in batch.requests]
        temps = [_temperature(r) for r in batch.requests]
        self._upload(rows, temps, size)
        self.graphs[size].replay()
        return self.out_logits[:n].clone(), self.out_tokens[:n].clone(), size

    # -- eager ----------------------------------------------------------------------------------

    def eager(self, batch: Batch) -> tuple[Tensor, Tensor]:
        rows, temps, last = [], [], []
        for request in batch.requests:
            for i in range(request.query_len):
                rows.append(_row(request, i))
                temps.append(_temperature(request))
            last.append(len(rows) - 1)
        host = torch.tensor(rows, dtype=torch.int64).view(-1, WIDTH)
        logits, tokens = self._forward(
            host.to(self.device), torch.tensor(temps, dtype=torch.float32).to(self.device)
        )
        index = torch.tensor(last, dtype=torch.int64).to(self.device)
        return logits[index], tokens[index]

    # -- the model (no host reads) --------------------------------------------------------------

    def _forward(self, rows: Tensor, temps: Tensor) -> tuple[Tensor, Tensor]:
        w = self.weights
        tokens, positions, slots = rows[:, TOKEN], rows[:, POSITION], rows[:, SLOT]
        tables = rows[:, TABLE:]
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = (x @ w[n] for n in ("wq", "wk", "wv"))
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(SPEC.block_size, device=self.device)
        context = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT]
        keys, values = self.k_cache[context], self.v_cache[context]
        visible = torch.arange(CONTEXT, device=self.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)
        h = x + attended @ w["wo"]
        h = h + torch.nn.functional.silu(h @ w["w1"]) @ w["w2"]
        logits = h @ w["head"]
        return logits, self._sample(logits, rows, temps)

    def _sample(self, logits: Tensor, rows: Tensor, temps: Tensor) -> Tensor:
        """Gumbel-max with noise hashed from (seed, position, token id); greedy rows take argmax."""
        vocab = torch.arange(SPEC.vocab_size, device=self.device)[None, :]
        seeds, positions = rows[:, SEED, None], rows[:, POSITION, None]
        h = _mix(_mix(_mix(seeds) ^ positions) ^ vocab)
        u = ((h >> 7).to(torch.float32) + 0.5) / float(1 << 24)
        gumbel = -torch.log(-torch.log(u))
        sampled_tokens = (logits / temps[:, None] + gumbel).argmax(-1)
        greedy_tokens = logits.argmax(-1)
        return torch.where(rows[:, SAMPLED] != 0, sampled_tokens, greedy_tokens)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()


class Target:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, buggy: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.runner = DecodeRunner(graphs=mode == "graph", seed=seed, buggy=buggy)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode (query length > 1)"
        if self.runner.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            logits, tokens, size = self.runner.decode(batch)
            return StepResult(logits, tokens, "full", ("decode", size))
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.runner.device)
            return StepResult(
                empty,
                torch.zeros(0, dtype=torch.int64, device=self.runner.device),
                "eager",
                None,
                reason,
            )
        logits, tokens = self.runner.eager(batch)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.runner.k_cache, "v": self.runner.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode != "graph":
            return {}
        return {"rows": self.runner.static_rows, "temps": self.runner.static_temps}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.load_weights(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Target:
    return Target(mode, seed=seed, buggy=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Target:
    return Target(mode, seed=seed, buggy=True)
