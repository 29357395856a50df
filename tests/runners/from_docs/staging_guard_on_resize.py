"""A decode-graph runner written against plain torch.cuda, with one pinned staging buffer.

Graph mode captures one torch.cuda.CUDAGraph per capture size (decode: one token per request) in a
shared pool. Before each replay the host writes the step's integer inputs (token, position, KV slot,
block table) into ONE pinned host buffer, uploads it with a non_blocking copy on the current stream
into the graphs' static device buffer, records an event, and replays. Before the host rewrites the
staging buffer it waits for that event (the previous upload has read it).

`make_buggy_target` carries a "steady-state optimisation": it waits for the event only when the
capture size differs from the last replayed one, assuming that in steady state (same size step
after step) the previous upload finished long ago.

Prefill, mixed, speculative-decode batches and batches above the largest capture size run eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 64

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=128,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode"}),
    null_block=0,
)
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
WIDTH = 3 + SPEC.max_blocks_per_req  # token, position, slot, block table
PAD_ROW = [0, 0, SPEC.null_block * SPEC.block_size] + [SPEC.null_block] * SPEC.max_blocks_per_req


def rows_of(request: Request) -> list[list[int]]:
    table = list(request.block_ids) + [SPEC.null_block] * (
        SPEC.max_blocks_per_req - len(request.block_ids)
    )
    rows = []
    for i, token in enumerate(request.tokens):
        position = request.context_len + i
        rows.append(
            [token, position, kv_slot(request.block_ids, position, SPEC.block_size), *table]
        )
    return rows


class StagedRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, guard_on_resize: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.guard_on_resize = guard_on_resize  # the bug: wait for the upload only on a resize
        self.device = torch.device("cuda")
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, FFN),
            "down": (FFN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        generator = torch.Generator().manual_seed(seed)
        self.weights = {
            name: (torch.randn(shape, generator=generator) / math.sqrt(shape[0])).to(self.device)
            for name, shape in shapes.items()
        }
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.static: Tensor | None = None
        self.last_size: int | None = None
        if mode == "graph":
            rows = max(SPEC.capture_sizes)
            self.staging = torch.zeros(rows, WIDTH, dtype=torch.int64, pin_memory=True)
            self.staging_np = self.staging.numpy()  # host writes go through a numpy view
            self.static = torch.zeros(rows, WIDTH, dtype=torch.int64, device=self.device)
            self.uploaded = torch.cuda.Event()
            self._capture()

    # -- graphs ---------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._upload([], size)  # all padding during warm-up and capture
            self._forward(self.static[:size])  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(self.static[:size])
            self.graphs[size] = graph

    def _upload(self, rows: Sequence[list[int]], size: int) -> None:
        """Stage rows + padding up to `size` in the pinned buffer, copy it non_blocking on the
        current stream into the static buffer, record `uploaded`."""
        if not self.guard_on_resize or size != self.last_size:
            self.uploaded.synchronize()  # the previous upload has read the staging buffer
        self.last_size = size
        n = len(rows)
        if n:
            self.staging_np[:n] = np.asarray(rows, dtype=np.int64)
        self.staging_np[n:size] = PAD_ROW
        self.static[:size].copy_(self.staging[:size], non_blocking=True)
        self.uploaded.record()

    def _capture_size(self, n: int) -> int | None:
        return next((s for s in SPEC.capture_sizes if s >= n), None)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode (query length > 1)"
        if self._capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            size = self._capture_size(batch.num_reqs)
            self._upload([rows_of(r)[0] for r in batch.requests], size)
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            n = batch.num_reqs
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
        rows, last = [], []
        for request in batch.requests:
            rows.extend(rows_of(request))
            last.append(len(rows) - 1)
        host = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), WIDTH)
        logits, tokens = self._forward(host.to(self.device))
        index = torch.tensor(last, dtype=torch.int64).to(self.device)
        return StepResult(logits[index], tokens[index], "eager", None, reason=reason)

    # -- the model ------------------------------------------------------------------------------

    def _forward(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        w = self.weights
        tokens, positions, slots, tables = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:]
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = (x @ w[n] for n in "qkv")
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
        h = x + attended @ w["o"]
        h = h + torch.nn.functional.silu(h @ w["up"]) @ w["down"]
        logits = h @ w["head"]
        return logits, logits.argmax(-1)

    # -- contract -------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {"rows": self.static} if self.graphs else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        raise NotImplementedError("no weight_update feature")

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> StagedRunner:
    return StagedRunner(mode, seed=seed, guard_on_resize=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> StagedRunner:
    return StagedRunner(mode, seed=seed, guard_on_resize=True)
