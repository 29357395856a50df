"""A small paged-KV decoder with CUDA-graph decode, written against plain torch.cuda.

Graph mode stages its integer inputs (tokens, positions, slot mapping, block tables, sequence
lengths) in pinned host buffers, uploads them with non_blocking copies on a dedicated copy stream
into the graphs' static device buffers and records an event on the copy stream; the stream that
replays waits for that event, and the host synchronizes it before rewriting the staging buffers.

`make_buggy_target` records the event BEFORE the copies are enqueued (a misplaced event): the
replay's wait and the host's synchronize then cover none of the copies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=48,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=128,
    max_num_reqs=10,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
FIELDS = ("tokens", "positions", "slots", "tables", "seq_lens")


class Model:
    """One attention layer + SiLU MLP over a slot-major paged KV cache. No host reads."""

    def __init__(self, seed: int) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {n: torch.empty(s, device="cuda") for n, s in shapes.items()}
        self.load(seed)
        slots = SPEC.num_blocks * SPEC.block_size
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device="cuda")
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device="cuda")

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to("cuda"))

    def forward(
        self, tokens: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, seq_lens: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One row per token; `seq_lens[t]` = how many positions token t may attend to."""
        w = self.w
        t = tokens.shape[0]
        x = w["embed"][tokens] + w["pos"][positions]
        q = (x @ w["wq"]).view(t, HEADS, HEAD_DIM)
        k = (x @ w["wk"]).view(t, HEADS, HEAD_DIM)
        v = (x @ w["wv"]).view(t, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        offs = torch.arange(SPEC.block_size, device="cuda")
        ctx = (tables[:, :, None] * SPEC.block_size + offs).flatten(1)  # [T, CONTEXT]
        keys, values = self.k_cache[ctx], self.v_cache[ctx]
        visible = torch.arange(CONTEXT, device="cuda")[None, :] < seq_lens[:, None]
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device="cuda"))
        att = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).reshape(t, HIDDEN)
        x = x + att @ w["wo"]
        x = x + torch.nn.functional.silu(x @ w["up"]) @ w["down"]
        logits = x @ w["head"]
        return logits, logits.argmax(-1)


def token_rows(request: Request) -> list[tuple[int, int, int, list[int], int]]:
    table = list(request.block_ids) + [SPEC.null_block] * (
        SPEC.max_blocks_per_req - len(request.block_ids)
    )
    rows = []
    for i, tok in enumerate(request.tokens):
        pos = request.context_len + i
        rows.append((tok, pos, kv_slot(request.block_ids, pos, SPEC.block_size), table, pos + 1))
    return rows


PAD_ROW = (0, 0, NULL_SLOT, [SPEC.null_block] * SPEC.max_blocks_per_req, 1)


class Runner:
    def __init__(self, mode: str, *, seed: int, event_first: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.event_first = event_first
        self.model = Model(seed)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.static: dict[str, Tensor] = {}
        if mode == "graph":
            rows = max(SPEC.capture_sizes)
            mb = SPEC.max_blocks_per_req
            shapes = {
                "tokens": (rows,),
                "positions": (rows,),
                "slots": (rows,),
                "tables": (rows, mb),
                "seq_lens": (rows,),
            }
            self.pinned = {
                n: torch.zeros(s, dtype=torch.int64, pin_memory=True) for n, s in shapes.items()
            }
            self.static = {
                n: torch.zeros(s, dtype=torch.int64, device="cuda") for n, s in shapes.items()
            }
            self.copy_stream = torch.cuda.Stream()
            self.uploaded = torch.cuda.Event()
            self.capture()

    # -- graph path ---------------------------------------------------------------------------

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.upload([], size)
            # Start-up waits for everything: the misplaced event is left to the steps.
            torch.cuda.synchronize()
            inputs = [self.static[n][:size] for n in FIELDS]
            self.model.forward(*inputs)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model.forward(*inputs)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def stage(self, rows: Sequence[tuple], size: int) -> None:
        """Host: write rows + padding rows into the pinned staging buffers."""
        self.uploaded.synchronize()  # the previous upload has finished reading the staging buffers
        full = list(rows) + [PAD_ROW] * (size - len(rows))
        for i, name in enumerate(FIELDS):
            col = [r[i] for r in full]
            self.pinned[name][:size].copy_(torch.tensor(col, dtype=torch.int64))

    def upload(self, rows: Sequence[tuple], size: int) -> None:
        self.stage(rows, size)
        current = torch.cuda.current_stream()
        self.copy_stream.wait_stream(current)  # the previous replay has read the static buffers
        with torch.cuda.stream(self.copy_stream):
            if self.event_first:  # BUG: event recorded before the copies
                self.uploaded.record()
            for name in FIELDS:
                self.static[name][:size].copy_(self.pinned[name][:size], non_blocking=True)
            if not self.event_first:
                self.uploaded.record()
        current.wait_event(self.uploaded)  # the replay waits for the upload

    def capture_size(self, n: int) -> int | None:
        return next((s for s in SPEC.capture_sizes if s >= n), None)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if self.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self.eager(batch, reason)
        n = batch.num_reqs
        size = self.capture_size(n)
        self.upload([token_rows(r)[0] for r in batch.requests], size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager path ---------------------------------------------------------------------------

    def eager(self, batch: Batch, reason: str) -> StepResult:
        rows, last = [], []
        for r in batch.requests:
            rows.extend(token_rows(r))
            last.append(len(rows) - 1)
        cols = [
            torch.tensor([row[i] for row in rows], dtype=torch.int64).to("cuda")
            for i in range(len(FIELDS))
        ]
        logits, tokens = self.model.forward(*cols)
        idx = torch.tensor(last, dtype=torch.int64).to("cuda")
        return StepResult(logits[idx], tokens[idx], "eager", None, reason=reason)

    # -- contract -----------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.model.k_cache, "v": self.model.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return dict(self.static)

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        torch.cuda.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, event_first=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, event_first=True)
