"""A token-padded graph runner whose host-side input preparation is numpy over pinned buffers.

Written against plain `torch.cuda` (the harness's drop-in makes it run on sim). The input
preparation follows the shape of vLLM's v1 `CpuGpuBuffer`: every per-step input is a persistent
pinned host tensor (`torch.zeros(..., pin_memory=True)`) with a numpy view of it (`.numpy()`)
and a persistent device tensor of the same shape, which the captured graphs read. The host
writes the numpy views with numpy operations (`np.cumsum` for query start locations,
`np.repeat` / `np.arange` for positions and per-token request indices, fancy indexing into the
block table's numpy view for the slot mapping), then `copy_to_gpu(n)` issues
`gpu[:n].copy_(cpu[:n], non_blocking=True)` on the current stream. The device buffers mix dtypes
as vLLM's do (int32 token ids, request indices, query start locations and block table; int64
positions and slot mapping). Results come back through pinned host buffers with
`non_blocking=True` and an event the host synchronizes on.

Graphs: one per padded token count (capture sizes 1, 2, 4, 8), captured at start-up into a shared
pool, largest first. Any batch (decode, spec decode, prefill, mixed) of at most 8 tokens replays
the graph of its padded token count: every token is a row, and the logits are gathered at each
request's last query token through `logits_indices` (a fixed `max_num_reqs` rows in the graph).
Padding tokens point at the null block (slot mapping and a padding block-table row). Larger
batches run eagerly; the eager twin runs the same preparation with no padding and no graph.

The bug (`make_buggy_target`): the padded size is decided, the valid prefix of every buffer is
written (request-row padding too) and `copy_to_gpu(padded)` is issued, and only then does a
separate `_pad_tokens` step write the padding tokens (T..P) into the same pinned numpy views. The
non_blocking H2D copy may already have read the tail (then it uploads the previous step's
contents of those bytes: a padding token stores its keys into a slot that a live request owned
last step) or not (then it gets the new ones): a host write racing a queued read of pinned
memory. Modelled on the async-H2D pinned-source races in vLLM-style `CpuGpuBuffer` runners:
vllm-project/vllm-ascend#12071 / #12079 (query_start_loc CPU buffer overwritten before the queued
non-blocking H2D consumed it), #12191 and #12630 (guarded with vLLM's `synchronize_input_prep`
event), vllm-project/vllm#29288 (eagle async-scheduling CPU buffer race), and
lightseekorg/tokenspeed#376 ("fill host is not fenced by cuda stream so it could happen before h2d
finished"); pytorch/pytorch#126946: with `non_blocking` the source must stay unmodified until the
transfer ran. No engine code was copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NULL_BLOCK = 0
CAPTURE_SIZES = (1, 2, 4, 8)

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=CAPTURE_SIZES,
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=NULL_BLOCK,
)


class CpuGpuBuffer:
    """A pinned host tensor, its numpy view, and a device tensor of the same shape and dtype."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        self.cpu = torch.zeros(*shape, dtype=dtype, pin_memory=True)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(*shape, dtype=dtype, device="cuda")

    def copy_to_gpu(self, n: int | None = None) -> Tensor:
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class NumpyPinnedRunner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, pad_late: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.pad_late = pad_late
        s = SPEC
        self.context = s.max_blocks_per_req * s.block_size
        shapes = {
            "embed": (s.vocab_size, HIDDEN),
            "pos": (self.context, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "head": (HIDDEN, s.vocab_size),
        }
        self.weights = {n: torch.empty(sh, device="cuda") for n, sh in shapes.items()}
        self.load_weights(seed)
        slots = s.num_blocks * s.block_size
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device="cuda")
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device="cuda")

        t, r = s.max_num_tokens, s.max_num_reqs
        self.pad_row = r  # the block-table row every padding token reads: all null blocks
        self.input_ids = CpuGpuBuffer(t, dtype=torch.int32)
        self.positions = CpuGpuBuffer(t, dtype=torch.int64)
        self.slot_mapping = CpuGpuBuffer(t, dtype=torch.int64)
        self.token_req = CpuGpuBuffer(t, dtype=torch.int32)
        self.query_start_loc = CpuGpuBuffer(r + 1, dtype=torch.int32)
        self.logits_indices = CpuGpuBuffer(r, dtype=torch.int64)
        self.block_table = CpuGpuBuffer(r + 1, s.max_blocks_per_req, dtype=torch.int32)
        self.token_req.np.fill(self.pad_row)  # host buffers start as padding
        self.arange_np = np.arange(max(t, r) + 1, dtype=np.int64)
        # outputs come back through pinned buffers
        self.logits_host = torch.zeros(r, s.vocab_size, pin_memory=True)
        self.tokens_host = torch.zeros(r, dtype=torch.int64, pin_memory=True)
        self.downloaded = torch.cuda.Event()

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self._capture()

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            w = self.weights[name]
            fresh = torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])
            w.copy_(fresh.to("cuda"))

    def update_weights(self, seed: int) -> None:
        self.load_weights(seed)

    # -- host-side input preparation (numpy over pinned views) -----------------------------

    def _buffers(self) -> tuple[CpuGpuBuffer, ...]:
        return (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.token_req,
            self.query_start_loc,
            self.logits_indices,
            self.block_table,
        )

    def _prepare(self, batch: Batch, padded: int, rows: int) -> None:
        """Write the batch's T tokens and n requests, pad tokens to `padded` and request rows to
        `rows`, and upload. Returns nothing: the device buffers hold the step's inputs."""
        s = self.spec
        n = batch.num_reqs
        query_lens = np.array([len(r.tokens) for r in batch.requests], dtype=np.int64)
        context_lens = np.array([r.context_len for r in batch.requests], dtype=np.int64)
        T = int(query_lens.sum()) if n else 0

        # block table rows 0..n-1 from the requests, null elsewhere
        bt = self.block_table.np
        for i, req in enumerate(batch.requests):
            bt[i, : len(req.block_ids)] = req.block_ids
            bt[i, len(req.block_ids) :] = NULL_BLOCK

        # query start locations by cumsum
        qsl = self.query_start_loc.np
        qsl[0] = 0
        cu = np.cumsum(query_lens)
        qsl[1 : n + 1] = cu
        # token -> request index and position, by repeat / arange
        req_idx = np.repeat(self.arange_np[:n], query_lens)
        offsets = self.arange_np[:T] - np.repeat(cu - query_lens, query_lens)
        np.add(context_lens[req_idx], offsets, out=self.positions.np[:T])
        self.token_req.np[:T] = req_idx
        ids = [t for r in batch.requests for t in r.tokens]
        self.input_ids.np[:T] = ids
        # slot mapping by fancy indexing into the block table's numpy view
        pos = self.positions.np[:T]
        block_numbers = bt[req_idx, pos // s.block_size].astype(np.int64)
        np.add(block_numbers * s.block_size, pos % s.block_size, out=self.slot_mapping.np[:T])
        # logits at each request's last query token
        np.subtract(cu, 1, out=self.logits_indices.np[:n])

        self._pad_requests(n, padded, rows)
        if not self.pad_late:
            self._pad_tokens(T, padded)
            self._upload(padded, rows)
        else:
            # BUG: the uploads are issued before the padding tokens are written into the same
            # pinned buffers; the queued non_blocking copies may read them before or after.
            self._upload(padded, rows)
            self._pad_tokens(T, padded)

    def _pad_requests(self, n: int, padded: int, rows: int) -> None:
        self.block_table.np[n:].fill(NULL_BLOCK)  # includes the padding row
        self.query_start_loc.np[n + 1 : rows + 1] = self.query_start_loc.np[n]
        # padding request rows gather the last (padding or valid) token: any in-range index
        self.logits_indices.np[n:rows] = max(padded - 1, 0)

    def _pad_tokens(self, T: int, padded: int) -> None:
        s = self.spec
        self.input_ids.np[T:padded] = 0
        self.positions.np[T:padded] = 0
        self.slot_mapping.np[T:padded] = NULL_BLOCK * s.block_size
        self.token_req.np[T:padded] = self.pad_row

    def _upload(self, padded: int, rows: int) -> None:
        self.input_ids.copy_to_gpu(padded)
        self.positions.copy_to_gpu(padded)
        self.slot_mapping.copy_to_gpu(padded)
        self.token_req.copy_to_gpu(padded)
        self.query_start_loc.copy_to_gpu(rows + 1)
        self.logits_indices.copy_to_gpu(rows)
        self.block_table.copy_to_gpu()

    # -- the model (reads the device buffers only) ------------------------------------------

    def _forward(self, padded: int, rows: int) -> tuple[Tensor, Tensor]:
        s = self.spec
        w = self.weights
        ids = self.input_ids.gpu[:padded].long()
        positions = self.positions.gpu[:padded]
        slots = self.slot_mapping.gpu[:padded]
        tables = self.block_table.gpu[self.token_req.gpu[:padded].long()].long()  # [P, B]
        x = w["embed"][ids] + w["pos"][positions]
        q, k, v = (x @ w[n] for n in "qkv")
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(s.block_size, device="cuda")
        ctx = (tables[:, :, None] * s.block_size + offs).flatten(1)  # [P, context]
        keys, values = self.k_cache[ctx], self.v_cache[ctx]
        visible = torch.arange(self.context, device="cuda")[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device="cuda"))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)
        hidden = x + attended @ w["o"]
        last = hidden[self.logits_indices.gpu[:rows]]
        logits = last @ w["head"]
        return logits, logits.argmax(-1)

    # -- graphs ------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        rows = self.spec.max_num_reqs
        with torch.inference_mode():
            for size in sorted(CAPTURE_SIZES, reverse=True):
                self._prepare(Batch(()), size, rows)
                self._forward(size, rows)  # warm-up
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[size] = self._forward(size, rows)
                self.graphs[size] = g
            torch.cuda.synchronize()

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.num_tokens > max(CAPTURE_SIZES):
            return "more tokens than the largest capture size"
        if batch.num_reqs > self.spec.max_num_reqs:
            return "too many requests"
        return None

    # -- the contract --------------------------------------------------------------------------

    def _download(self, logits: Tensor, tokens: Tensor, n: int) -> tuple[Tensor, Tensor]:
        self.logits_host[:n].copy_(logits[:n], non_blocking=True)
        self.tokens_host[:n].copy_(tokens[:n], non_blocking=True)
        self.downloaded.record()
        self.downloaded.synchronize()
        # the pinned output buffers are rewritten next step: hand out copies
        return self.logits_host[:n].clone(), self.tokens_host[:n].clone()

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        reason = self.fallback_reason(batch)
        with torch.inference_mode():
            if reason is None:
                padded = next(c for c in CAPTURE_SIZES if c >= batch.num_tokens)
                rows = self.spec.max_num_reqs
                self._prepare(batch, padded, rows)
                self.graphs[padded].replay()
                out_logits, out_tokens = self.outputs[padded]
                logits, tokens = self._download(out_logits, out_tokens, n)
                return StepResult(logits, tokens, "full", ("tokens", padded))
            T = batch.num_tokens
            self._prepare(batch, T, n)
            out_logits, out_tokens = self._forward(T, n)
            logits, tokens = self._download(out_logits, out_tokens, n)
            return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode != "graph":
            return {}
        return {
            "input_ids": self.input_ids.gpu,
            "positions": self.positions.gpu,
            "slot_mapping": self.slot_mapping.gpu,
            "token_req": self.token_req.gpu,
            "query_start_loc": self.query_start_loc.gpu,
            "logits_indices": self.logits_indices.gpu,
            "block_table": self.block_table.gpu,
        }

    def address_views(self) -> Sequence[AddressView]:
        return []

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> NumpyPinnedRunner:
    return NumpyPinnedRunner(mode, seed=seed, pad_late=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> NumpyPinnedRunner:
    return NumpyPinnedRunner(mode, seed=seed, pad_late=True)
