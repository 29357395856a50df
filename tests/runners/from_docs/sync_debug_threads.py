"""A decode runner on plain `torch.cuda` that guards its replay path against hidden host syncs
and prepares its host inputs on a background thread.

What it does (all through plain `torch.cuda`; on sim the harness's drop-in stands in for it):

- One `torch.cuda.CUDAGraph` per capture size, captured largest first into one pool with
  `torch.cuda.graph(g, pool=..., capture_error_mode="thread_local")`: while the main thread
  captures size S, the preparing thread already stages the padding rows of the next size into the
  pinned buffer (host work on another thread is what "thread_local" lets through).
- A background "prep" thread (a one-worker `ThreadPoolExecutor`, started from the constructor)
  turns a step's rows into numpy arrays, writes them into ONE reused pinned staging tensor
  (through its `.numpy()` view, as engines' CPU/GPU buffer pairs do), and uploads it with a
  `non_blocking` copy on its own `torch.cuda.Stream`; it hands the inputs to the main stream with
  a `torch.cuda.Event` that the main stream waits on. Before rewriting the pinned buffer it waits
  for the event that the previous upload from it recorded (`self.uploaded.synchronize()`).
- Around the replay path (event wait, replay, copy-out) the runner switches
  `torch.cuda.set_sync_debug_mode(...)` on ("warn" by default, as serving engines' tests do to
  prove a replay never blocks the host) and restores `torch.cuda.get_sync_debug_mode()` after.

The bug (`make_buggy_target`): the prep thread rewrites the pinned staging buffer for step N+1
without waiting for step N's non_blocking upload from it, which may still be queued on the copy
stream (async scheduling prepares N+1 while N runs). Step N's graph then reads step N+1's tokens,
positions, slots or block tables. Modelled on vLLM's reused pinned CPU buffers under async
scheduling: https://github.com/vllm-project/vllm/pull/32799 ("we do not pin reused CPU buffers to
avoid a race condition between step N async copies to GPU and step N+1 buffer updates"), and on
https://github.com/NVIDIA/Megatron-LM/pull/5715 (pinned bookkeeping buffer overwritten while its
async H2D copy is in flight -> illegal memory access) and
https://github.com/vllm-project/vllm-ascend/pull/12071 (query_start_loc CPU buffer overwritten
before the queued H2D copy consumed it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NULL_BLOCK = 0
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 24, 4, 6
VOCAB = 48
CAPTURE_SIZES = (1, 2, 4)
CONTEXT = MAX_BLOCKS * BLOCK_SIZE
COLS = 3 + MAX_BLOCKS  # token, position, slot, block table

SPEC = TargetSpec(
    num_blocks=NUM_BLOCKS,
    block_size=BLOCK_SIZE,
    max_blocks_per_req=MAX_BLOCKS,
    vocab_size=VOCAB,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=CAPTURE_SIZES,
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=NULL_BLOCK,
)


def _row_values(request: Request, i: int) -> list[int]:
    position = request.context_len + i
    table = list(request.block_ids) + [NULL_BLOCK] * (MAX_BLOCKS - len(request.block_ids))
    return [request.tokens[i], position, kv_slot(request.block_ids, position, BLOCK_SIZE), *table]


_PADDING = [0, 0, NULL_BLOCK * BLOCK_SIZE] + [NULL_BLOCK] * MAX_BLOCKS


class SyncGuardedRunner:
    # Which sync debug mode guards the replay path ("warn" or "error"; None: no guard).
    sync_debug: str | None = "warn"
    # Stage the next size's padding rows on the prep thread while this size captures (its
    # `uploaded.synchronize()` then runs during a "thread_local" capture of the main thread).
    stage_during_capture: bool = True

    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, wait_upload: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.wait_upload = wait_upload
        self.device = torch.device("cuda")
        shapes = {
            "embed": (VOCAB, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "head": (HIDDEN, VOCAB),
        }
        self.weights = {n: torch.empty(s, device=self.device) for n, s in shapes.items()}
        self.update_weights(seed)
        slots = NUM_BLOCKS * BLOCK_SIZE
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        rows = max(CAPTURE_SIZES)
        # One pinned staging tensor, reused every step, written through its numpy view.
        self.staging = torch.zeros(rows, COLS, dtype=torch.int64, pin_memory=True)
        self.staging_np = self.staging.numpy()
        self.static = torch.zeros(rows, COLS, dtype=torch.int64, device=self.device)
        self.copy_stream = torch.cuda.Stream()
        self.uploaded = torch.cuda.Event()  # recorded on the copy stream after each upload
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prep")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self._capture()

    # -- host preparation (runs on the prep thread) ---------------------------------------------

    def _stage_host(self, rows: Sequence[list[int]], size: int) -> None:
        """numpy rows plus padding rows up to `size` into the pinned staging buffer."""
        host = np.empty((size, COLS), dtype=np.int64)
        for i in range(size):
            host[i] = rows[i] if i < len(rows) else _PADDING
        if self.wait_upload:
            self.uploaded.synchronize()  # the last non_blocking upload has read the buffer
        self.staging_np[:size] = host

    def _upload(self, size: int, ready: torch.cuda.Event) -> torch.cuda.Event:
        """Upload the staged rows on the copy stream once the main stream's `ready` point is
        reached (earlier replays have read `static`); the event the main stream must wait on."""
        self.copy_stream.wait_event(ready)
        with torch.cuda.stream(self.copy_stream):
            self.static[:size].copy_(self.staging[:size], non_blocking=True)
            self.uploaded.record(self.copy_stream)
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        return done

    def _prepare(self, rows: Sequence[list[int]], size: int, ready: torch.cuda.Event):
        self._stage_host(rows, size)
        return self._upload(size, ready)

    def _submit(self, rows: Sequence[list[int]], size: int) -> None:
        """Hand `rows` to the prep thread; make the current stream wait for their upload."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        done = self.prep.submit(self._prepare, rows, size, ready).result()
        torch.cuda.current_stream().wait_event(done)

    # -- graphs ---------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        sizes = sorted(CAPTURE_SIZES, reverse=True)
        self._submit([], sizes[0])
        for n, size in enumerate(sizes):
            self._forward(self.static[:size])  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # While this size captures, the prep thread stages the next size's padding rows.
            nxt = sizes[n + 1] if n + 1 < len(sizes) else None
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                early = nxt is not None and self.stage_during_capture
                pending = self.prep.submit(self._stage_host, [], nxt) if early else None
                self.outputs[size] = self._forward(self.static[:size])
                if pending is not None:
                    pending.result()
            self.graphs[size] = graph
            if nxt is not None and not self.stage_during_capture:
                self.prep.submit(self._stage_host, [], nxt).result()
            if nxt is not None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream())
                done = self.prep.submit(self._upload, nxt, ready).result()
                torch.cuda.current_stream().wait_event(done)

    def capture_size(self, rows: int) -> int | None:
        return next((s for s in CAPTURE_SIZES if s >= rows), None)

    def _replay(self, rows: Sequence[list[int]], size: int) -> tuple[Tensor, Tensor]:
        self._submit(rows, size)
        previous = torch.cuda.get_sync_debug_mode() if self.sync_debug else None
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode(self.sync_debug)  # the replay path must not block
        try:
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            n = len(rows)
            return logits[:n].clone(), tokens[:n].clone()
        finally:
            if self.sync_debug:
                torch.cuda.set_sync_debug_mode(previous)

    # -- the model ------------------------------------------------------------------------------

    def _forward(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        w = self.weights
        tokens, positions, slots, tables = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:]
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = (x @ w[n] for n in "qkv")
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(BLOCK_SIZE, device=self.device)
        context = (tables[:, :, None] * BLOCK_SIZE + offsets).flatten(1)
        keys, values = self.k_cache[context], self.v_cache[context]
        visible = torch.arange(CONTEXT, device=self.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)
        logits = (x + attended @ w["o"]) @ w["head"]
        return logits, logits.argmax(-1)

    def _eager(self, batch: Batch) -> tuple[Tensor, Tensor]:
        rows, last = [], []
        for request in batch.requests:
            rows.extend(_row_values(request, i) for i in range(len(request.tokens)))
            last.append(len(rows) - 1)
        host = torch.from_numpy(np.asarray(rows, dtype=np.int64).reshape(len(rows), COLS))
        logits, tokens = self._forward(host.to(self.device))
        index = torch.tensor(last, dtype=torch.int64, device=self.device)
        return logits[index], tokens[index]

    # -- the contract ---------------------------------------------------------------------------

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode (query length > 1)"
        if self.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            size = self.capture_size(batch.num_reqs)
            rows = [_row_values(r, 0) for r in batch.requests]
            logits, tokens = self._replay(rows, size)
            return StepResult(logits, tokens, "full", ("decode", size))
        logits, tokens = self._eager(batch)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {"rows": self.static} if self.graphs else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    def close(self) -> None:
        self.prep.shutdown(wait=True)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SyncGuardedRunner:
    return SyncGuardedRunner(mode, seed=seed, wait_upload=True)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SyncGuardedRunner:
    # The prep thread rewrites the pinned staging buffer while the last upload may be in flight.
    return SyncGuardedRunner(mode, seed=seed, wait_upload=False)
