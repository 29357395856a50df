"""A plain-torch.cuda paged-attention decode runner with lazily captured CUDA graphs.

The attention gathers only the first `n` blocks of each request's block table, where `n` is the
batch's longest sequence in blocks, computed on the host every step (FlashAttention's
`max_seqlen_k`, vLLM's `max_seq_len` in the attention metadata) so short contexts do less work.
Decode batches that fit a capture size replay a graph of that size, captured the first time a
batch of that size arrives; everything else (prefill, mixed, speculative decode, oversize
batches) runs eagerly.

`make_target` captures each graph with `n = max_blocks_per_req`, so one graph serves any context.
`make_buggy_target` captures with the `n` of the batch that triggered the capture: the value is
baked into the graph, and later replays with longer contexts attend to a truncated context.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 64
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
COLUMNS = 3  # token, position, slot; then the block table


@dataclass(frozen=True)
class Row:
    token: int
    position: int
    slot: int
    table: tuple[int, ...]


def blocks_needed(rows: Sequence[Row]) -> int:
    """The batch's longest sequence, in blocks (host-side, like max_seqlen_k)."""
    longest = max(r.position + 1 for r in rows)
    return -(-longest // SPEC.block_size)


class Runner:
    def __init__(self, *, graphs: bool, seed: int, bake_batch_blocks: bool) -> None:
        self.device = torch.device("cuda")
        self.use_graphs = graphs
        self.bake_batch_blocks = bake_batch_blocks
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "qkv": (HIDDEN, 3 * HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, FFN),
            "down": (FFN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {k: torch.empty(s, device=self.device) for k, s in shapes.items()}
        self.load_weights(seed)
        slots = SPEC.num_blocks * SPEC.block_size
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        rows = max(SPEC.capture_sizes)
        width = COLUMNS + SPEC.max_blocks_per_req
        self.staging = torch.zeros(rows, width, dtype=torch.int64, pin_memory=True)
        self.static = torch.zeros(rows, width, dtype=torch.int64, device=self.device)
        self.copy_stream = torch.cuda.Stream()
        self.uploaded = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}

    def load_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            w = self.weights[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(self.device))

    # -- staging --------------------------------------------------------------------------------

    @staticmethod
    def values(row: Row) -> list[int]:
        table = list(row.table) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(row.table))
        return [row.token, row.position, row.slot, *table]

    @staticmethod
    def padding() -> list[int]:
        return [0, 0, SPEC.null_block * SPEC.block_size] + [
            SPEC.null_block
        ] * SPEC.max_blocks_per_req

    def upload(self, rows: Sequence[Row], size: int) -> None:
        self.uploaded.synchronize()  # the last upload has read the staging buffer
        host = [self.values(rows[i]) if i < len(rows) else self.padding() for i in range(size)]
        self.staging[:size].copy_(torch.tensor(host, dtype=torch.int64))
        self.copy_stream.wait_stream(torch.cuda.current_stream())  # last replay read `static`
        with torch.cuda.stream(self.copy_stream):
            self.static[:size].copy_(self.staging[:size], non_blocking=True)
            self.uploaded.record()
        torch.cuda.current_stream().wait_event(self.uploaded)

    # -- graphs ---------------------------------------------------------------------------------

    def capture_size(self, n: int) -> int | None:
        return next((s for s in SPEC.capture_sizes if s >= n), None)

    def capture(self, size: int, rows: Sequence[Row]) -> None:
        # A graph must serve any context length; the bug bakes this batch's into the graph.
        n_blocks = blocks_needed(rows) if self.bake_batch_blocks else SPEC.max_blocks_per_req
        self.upload([], size)  # warm-up and capture on padding rows (null block only)
        self.forward(self.static[:size], n_blocks)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs[size] = self.forward(self.static[:size], n_blocks)
        self.graphs[size] = graph

    def decode(self, rows: Sequence[Row]) -> tuple[Tensor, Tensor, int]:
        size = self.capture_size(len(rows))
        assert size is not None
        if size not in self.graphs:
            self.capture(size, rows)  # lazily, at the first batch of this size
        self.upload(rows, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        return logits[: len(rows)].clone(), tokens[: len(rows)].clone(), size

    # -- eager ----------------------------------------------------------------------------------

    def eager(self, rows: Sequence[Row], last: Sequence[int]) -> tuple[Tensor, Tensor]:
        host = torch.tensor([self.values(r) for r in rows], dtype=torch.int64)
        logits, tokens = self.forward(host.to(self.device), blocks_needed(rows))
        index = torch.tensor(list(last), dtype=torch.int64, device=self.device)
        return logits[index], tokens[index]

    # -- model ----------------------------------------------------------------------------------

    def forward(self, rows: Tensor, n_blocks: int) -> tuple[Tensor, Tensor]:
        """rows: [T, 3 + max_blocks] on the device; attends over the first n_blocks blocks."""
        w = self.weights
        tokens, positions, slots = rows[:, 0], rows[:, 1], rows[:, 2]
        tables = rows[:, COLUMNS : COLUMNS + n_blocks]
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = (x @ w["qkv"]).split(HIDDEN, dim=-1)
        self.k_cache.index_copy_(0, slots, k.reshape(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.reshape(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        context = (tables[:, :, None] * bs + torch.arange(bs, device=self.device)).flatten(1)
        keys, values = self.k_cache[context], self.v_cache[context]  # [T, C, H, D]
        visible = torch.arange(n_blocks * bs, device=self.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.reshape(-1, HEADS, HEAD_DIM), keys)
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=self.device))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)
        h = x + attended @ w["o"]
        h = h + torch.nn.functional.silu(h @ w["up"]) @ w["down"]
        logits = h @ w["head"]
        return logits, logits.argmax(-1)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def rows_of(request: Request) -> list[Row]:
    return [
        Row(
            t,
            request.context_len + i,
            kv_slot(request.block_ids, request.context_len + i, SPEC.block_size),
            request.block_ids,
        )
        for i, t in enumerate(request.tokens)
    ]


class Target:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, bake: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.runner = Runner(graphs=mode == "graph", seed=seed, bake_batch_blocks=bake)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if self.runner.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            logits, tokens, size = self.runner.decode([rows_of(r)[0] for r in batch.requests])
            return StepResult(logits, tokens, "full", ("decode", size))
        rows: list[Row] = []
        last: list[int] = []
        for r in batch.requests:
            rows.extend(rows_of(r))
            last.append(len(rows) - 1)
        logits, tokens = self.runner.eager(rows, last)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.runner.k_cache, "v": self.runner.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {"rows": self.runner.static} if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.load_weights(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Target:
    return Target(mode, seed=seed, bake=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Target:
    return Target(mode, seed=seed, bake=True)
