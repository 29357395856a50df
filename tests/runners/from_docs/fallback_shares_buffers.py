"""A graph runner whose eager fallback shares the decode graphs' static input buffers.

Plain torch.cuda only (CUDAGraph, graph, Stream, Event, pin_memory=True, device="cuda").
One set of static device inputs at max shape (tokens, positions, slots, block tables, sequence
lengths, last-token indices) serves the captured decode graphs AND the eager path (prefill, mixed
and oversize batches), to save memory. Each step stages its inputs on the host in a pinned buffer,
uploads it with a non_blocking copy on a copy stream into the static buffers, runs the compute
(graph replay or eager forward) on a compute stream that waits for the upload's event, and makes
the caller's current stream wait for the compute stream.

`make_buggy_target`: the copy stream does not wait for the previous step's compute work before it
overwrites the static buffers that work may still be reading.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
ROWS = SPEC.max_num_tokens  # static buffers hold this many token rows
MAXB = SPEC.max_blocks_per_req

# The packed int64 layout: (name, shape) in order.
FIELDS = (
    ("tokens", (ROWS,)),
    ("positions", (ROWS,)),
    ("slots", (ROWS,)),
    ("seq_lens", (ROWS,)),
    ("tables", (ROWS, MAXB)),
    ("last", (SPEC.max_num_reqs,)),
)
PADDING = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "seq_lens": 1,
    "tables": SPEC.null_block,
    "last": 0,
}


def _views(packed: Tensor) -> dict[str, Tensor]:
    out, offset = {}, 0
    for name, shape in FIELDS:
        width = math.prod(shape)
        out[name] = packed[offset : offset + width].view(shape)
        offset += width
    return out


class Runner:
    def __init__(self, mode: str, *, seed: int, wait_for_compute: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.wait_for_compute = wait_for_compute
        self.device = torch.device("cuda")
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {n: torch.empty(s, device=self.device) for n, s in shapes.items()}
        self.update_weights(seed)
        slots = SPEC.num_slots
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        words = sum(math.prod(s) for _, s in FIELDS)
        self.staging_packed = torch.zeros(words, dtype=torch.int64, pin_memory=True)
        self.staging = {n: t.numpy() for n, t in _views(self.staging_packed).items()}
        self.static_packed = torch.zeros(words, dtype=torch.int64, device=self.device)
        self.static = _views(self.static_packed)
        self.copy_stream = torch.cuda.Stream()
        self.compute_stream = torch.cuda.Stream()
        self.uploaded = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        torch.cuda.synchronize()  # allocations and weights are in place before any side stream
        if mode == "graph":
            self._capture()

    # -- weights / model ------------------------------------------------------------------------

    def update_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            w = self.weights[name]
            w.copy_(
                (torch.randn(w.shape, generator=generator) / math.sqrt(w.shape[0])).to(w.device)
            )

    def _forward(self, t: int) -> Tensor:
        """One attention layer over the paged cache for the first `t` static rows; logits [t, V]."""
        s, w = self.static, self.weights
        tokens, positions, slots = s["tokens"][:t], s["positions"][:t], s["slots"][:t]
        seq_lens, tables = s["seq_lens"][:t], s["tables"][:t]
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        context = (tables[:, :, None] * bs + torch.arange(bs, device=x.device)).flatten(1)
        keys, values = self.k_cache[context], self.v_cache[context]
        idx = torch.arange(CONTEXT, device=x.device)[None, :]
        visible = (idx <= positions[:, None]) & (idx < seq_lens[:, None])
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(
            HEAD_DIM
        )
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), float("-inf"), device=x.device)
        )
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)
        return (x + attended @ w["o"]) @ w["head"]

    # -- inputs ---------------------------------------------------------------------------------

    def _stage(self, batch: Batch) -> None:
        """Write the batch into the pinned staging buffer; every other row is padding."""
        self.uploaded.synchronize()  # the previous upload has finished reading the staging buffer
        st = self.staging
        for name, value in PADDING.items():
            st[name][...] = value
        row = 0
        for i, r in enumerate(batch.requests):
            for j, token in enumerate(r.tokens):
                pos = r.context_len + j
                st["tokens"][row] = token
                st["positions"][row] = pos
                st["slots"][row] = kv_slot(r.block_ids, pos, SPEC.block_size)
                st["seq_lens"][row] = r.seq_len
                st["tables"][row, : len(r.block_ids)] = r.block_ids
                row += 1
            st["last"][i] = row - 1

    def _upload(self) -> None:
        """Non_blocking copy of the staging buffer into the static buffers on the copy stream."""
        if self.wait_for_compute:
            # the previous step's replay / eager forward may still be reading the static buffers
            self.copy_stream.wait_stream(self.compute_stream)
        with torch.cuda.stream(self.copy_stream):
            self.static_packed.copy_(self.staging_packed, non_blocking=True)
            self.uploaded.record()
        self.compute_stream.wait_event(self.uploaded)

    # -- graphs ---------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        self._stage(Batch(()))
        self._upload()
        torch.cuda.synchronize()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._forward(size)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "query length > 1"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    # -- contract -------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        current = torch.cuda.current_stream()
        reason = self.fallback_reason(batch)
        # the caller's earlier work (KV writes, anything it did to our buffers) comes first
        self.compute_stream.wait_stream(current)
        self._stage(batch)
        self._upload()
        with torch.cuda.stream(self.compute_stream):
            if reason is None:
                size = next(s for s in SPEC.capture_sizes if s >= n)
                self.graphs[size].replay()
                logits = self.outputs[size][:n].clone()
                key = ("decode", size)
            else:
                all_logits = self._forward(batch.num_tokens)
                logits = all_logits[self.static["last"][:n]]
                key = None
            tokens = logits.argmax(-1)
        current.wait_stream(self.compute_stream)
        logits.record_stream(current)
        tokens.record_stream(current)
        if reason is None:
            return StepResult(logits, tokens, "full", key)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return dict(self.static) if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def close(self) -> None:
        torch.cuda.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, wait_for_compute=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, wait_for_compute=False)
