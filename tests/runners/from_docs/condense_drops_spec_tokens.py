"""A greedy graph-mode runner with a vLLM-style persistent batch; the buggy twin's condense drops
a moved request's draft tokens.

Design (after vLLM's V1 GPU model runner and its `InputBatch`). A one-layer decoder (token and
learned position embeddings, attention over a slot-major paged KV cache read through block
tables, a SiLU MLP, an LM head) serves greedy decoding: decode, chunked prefill and speculative
steps (a request's next token and its drafts). Requests live in rows of a persistent batch kept in
host arrays: a row of token ids per request (`token_ids`), `num_tokens_no_spec`, the draft tokens
of the step (`spec_token_ids`, one list per row, reused as vLLM does), `num_computed`, the tokens
scheduled this step, and a block-table row with its block count. `_update_states` follows
vLLM's: requests absent from the step leave the batch (their request state is kept, and they are
added back when they return), each continuing request's row is updated in place (new blocks
appended, this step's tokens written into its token row: the first as a computed token, the rest
as drafts after `num_tokens_no_spec`), new and returning requests fill the freed rows, smallest
first, and `condense()` then slides the last rows down into the rows left empty. The step's
inputs are gathered from the rows as vLLM's `_prepare_inputs` does: the input ids at each token's
position from the row's token ids, the slots from the row's block table. Graphs are captured at
start-up, one per capture size in tokens (all rows' tokens concatenated, padded to the size, each
token pointing at its row of the block table), in one shared pool; a step with more tokens than
the largest size runs eagerly. The eager twin runs the same persistent batch without graphs, as
vLLM's `enforce_eager` does. Logits come back in the batch's order.

The bug. vLLM PR #30218 ("[Cleanup] Remove unused ModelRunner V1 `InputBatch.num_tokens`
field", https://github.com/vllm-project/vllm/pull/30218) replaced the per-row `num_tokens` that
`InputBatch.condense()` used to copy a moved row's token ids by
`num_tokens_no_spec[last_req_index] + len(self.spec_token_ids[last_req_index])`, computed, in
the diff as posted, right after the row's spec-token list had been swapped into the empty row and
the source list cleared. Its review flagged this as critical: the length read is always 0, so
condense copies the computed tokens only and the moved request's draft tokens stay behind in its
old row. Its new row keeps at those positions whatever the row's previous occupant left there,
and the next input gather feeds those stale ids to the model as the request's drafts: wrong keys
and values stored for the drafts and wrong logits at the request's last query token. Later versions of the code
count the tokens before the swap, as `make_target` does; `make_buggy_target` counts them after.

What the contract could not express: a request's prompt length. A continuing prefill chunk and a
speculative step look alike (a continuing request with several query tokens), so the runner
treats a continuing request's tokens after the first as drafts only once that request has run a
one-token step since it (re)started, as vLLM only has drafts for requests past their prompt. A
speculative step straight after a prefill is staged as a prefill chunk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from pytest_graphmode.contract import (
    AddressView,
    Batch,
    Request,
    StepResult,
    TargetSpec,
    batch_problems,
)
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=64,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=96,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8, 16),
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 64
MAX_LEN = SPEC.max_blocks_per_req * SPEC.block_size
PAD_ROW = SPEC.max_num_reqs  # a block-table row of null blocks for padding tokens


WEIGHT_SHAPES = {
    "embed": (SPEC.vocab_size, HIDDEN),
    "pos": (MAX_LEN, HIDDEN),
    "wq": (HIDDEN, HEADS * HEAD_DIM),
    "wk": (HIDDEN, HEADS * HEAD_DIM),
    "wv": (HIDDEN, HEADS * HEAD_DIM),
    "wo": (HEADS * HEAD_DIM, HIDDEN),
    "w1": (HIDDEN, FFN),
    "w2": (FFN, HIDDEN),
    "lm": (HIDDEN, SPEC.vocab_size),
}


class Weights:
    """The model's weights, loaded in place so that captured graphs read every update."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.t = {name: torch.empty(shape, device=device) for name, shape in WEIGHT_SHAPES.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, shape in WEIGHT_SHAPES.items():
            scale = 1.0 if name in ("embed", "pos") else shape[0] ** -0.5
            self.t[name].copy_(torch.randn(shape, generator=gen) * scale)


def forward(
    w: Mapping[str, torch.Tensor],
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    consts: Mapping[str, torch.Tensor],
    ids: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    tok_row: torch.Tensor,
    tables: torch.Tensor,
    logits_idx: torch.Tensor,
) -> torch.Tensor:
    """Logits at `logits_idx` of a flat token batch. Reads nothing on the host: capturable."""
    t = ids.shape[0]
    x = w["embed"][ids] + w["pos"][pos]
    q = (x @ w["wq"]).view(t, HEADS, HEAD_DIM)
    k = (x @ w["wk"]).view(t, HEADS, HEAD_DIM)
    v = (x @ w["wv"]).view(t, HEADS, HEAD_DIM)
    # Store this step's keys and values first: every token reads its own slot back.
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, v)
    table = tables[tok_row]  # [t, blocks]
    key_slots = (table[:, :, None] * SPEC.block_size + consts["offsets"]).reshape(t, -1)
    mask = consts["key_pos"][None, :] <= pos[:, None]  # [t, keys]
    keys = k_flat[key_slots]  # [t, keys, heads, dim]
    values = torch.where(mask[:, :, None, None], v_flat[key_slots], 0.0)
    scores = torch.einsum("thd,tshd->ths", q, keys) * HEAD_DIM**-0.5
    scores = torch.where(mask[:, None, :], scores, float("-inf"))
    out = torch.einsum("ths,tshd->thd", torch.softmax(scores, dim=-1), values)
    x = x + out.reshape(t, HEADS * HEAD_DIM) @ w["wo"]
    x = x + torch.nn.functional.silu(x @ w["w1"]) @ w["w2"]
    return x[logits_idx] @ w["lm"]


@dataclass
class RequestState:
    """What the runner keeps of a request between its steps (vLLM's CachedRequestState)."""

    tokens: list[int]  # every position known so far, drafts of the last step included
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    decoding: bool = False  # has run a one-token step since it (re)started


class PersistentBatch:
    """vLLM's InputBatch, reduced to what a greedy runner keeps per row, in host arrays."""

    def __init__(self, spec_count_after_move: bool) -> None:
        rows = SPEC.max_num_reqs
        self.spec_count_after_move = spec_count_after_move
        self.req_ids: list[int | None] = [None] * rows
        self.index: dict[int, int] = {}
        self.token_ids = np.zeros((rows, MAX_LEN), dtype=np.int64)
        self.num_tokens_no_spec = np.zeros(rows, dtype=np.int64)
        self.spec_token_ids: list[list[int]] = [[] for _ in range(rows)]
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.num_scheduled = np.zeros(rows, dtype=np.int64)
        self.decoding = np.zeros(rows, dtype=bool)
        self.block_table = np.full((rows, SPEC.max_blocks_per_req), SPEC.null_block, np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.removed: list[int] = []  # rows left empty since the last condense

    @property
    def num_reqs(self) -> int:
        return len(self.index)

    def add(self, req_id: int, state: RequestState) -> int:
        """A new or returning request takes the smallest empty row, else the next one."""
        if self.removed:
            row = min(self.removed)
            self.removed.remove(row)
        else:
            row = self.num_reqs
        self.req_ids[row] = req_id
        self.index[req_id] = row
        known = len(state.tokens)
        self.token_ids[row, :known] = state.tokens
        self.num_tokens_no_spec[row] = known
        self.spec_token_ids[row].clear()
        self.num_computed[row] = state.num_computed
        self.decoding[row] = state.decoding
        self.num_blocks[row] = 0
        self.append_blocks(row, state.block_ids)
        return row

    def remove(self, req_id: int) -> None:
        row = self.index.pop(req_id)
        self.req_ids[row] = None
        self.removed.append(row)

    def append_blocks(self, row: int, block_ids: Sequence[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def stage(self, row: int, request: Request, drafts_allowed: bool) -> None:
        """Write a step's query tokens into the row: the first as computed, the rest as drafts
        once the request decodes (vLLM writes scheduled spec tokens after num_tokens_no_spec)."""
        c, tokens = request.context_len, request.tokens
        first = 1 if drafts_allowed and self.decoding[row] else len(tokens)
        self.token_ids[row, c : c + len(tokens)] = tokens
        self.num_tokens_no_spec[row] = c + first
        self.spec_token_ids[row][:] = tokens[first:]
        self.num_computed[row] = c
        self.num_scheduled[row] = len(tokens)

    def condense(self) -> None:
        """Slide the last rows down into the empty ones (vLLM's InputBatch.condense)."""
        empty = sorted(self.removed, reverse=True)  # smallest last
        self.removed = []
        if not empty or self.num_reqs == 0:
            return
        last = self.num_reqs + len(empty) - 1
        while empty:
            while last in empty:
                last -= 1
            if empty[-1] >= last:
                break
            self.move(last, empty.pop())
            last -= 1

    def move(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.index[req_id] = dst
        if not self.spec_count_after_move:
            num_tokens = self.num_tokens_no_spec[src] + len(self.spec_token_ids[src])
        # The draft list moves with the request; the source row's list is left empty.
        self.spec_token_ids[src], self.spec_token_ids[dst] = (
            self.spec_token_ids[dst],
            self.spec_token_ids[src],
        )
        self.spec_token_ids[src].clear()
        if self.spec_count_after_move:  # the bug: the source row's list was just emptied
            num_tokens = self.num_tokens_no_spec[src] + len(self.spec_token_ids[src])
        self.token_ids[dst, :num_tokens] = self.token_ids[src, :num_tokens]
        self.num_tokens_no_spec[dst] = self.num_tokens_no_spec[src]
        self.num_computed[dst] = self.num_computed[src]
        self.num_scheduled[dst] = self.num_scheduled[src]
        self.decoding[dst] = self.decoding[src]
        blocks = int(self.num_blocks[src])
        self.block_table[dst, :blocks] = self.block_table[src, :blocks]
        self.num_blocks[dst] = blocks


class PersistentBatchRunner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        spec_count_after_move: bool,
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.be = get_backend(backend)
        self.be.activate()
        self._closed = False
        try:
            self._build(seed, spec_count_after_move)
        except BaseException:
            self.be.deactivate()
            raise

    def _build(self, seed: int, spec_count_after_move: bool) -> None:
        dev = self.be.device
        self.weights = Weights(dev, seed)
        shape = (SPEC.num_blocks, SPEC.block_size, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self._state = {
            "k_cache": self.k_cache.view(SPEC.num_slots, HEADS, HEAD_DIM),
            "v_cache": self.v_cache.view(SPEC.num_slots, HEADS, HEAD_DIM),
        }
        keys = SPEC.max_blocks_per_req * SPEC.block_size
        self.consts = {
            "offsets": torch.arange(SPEC.block_size, device=dev),
            "key_pos": torch.arange(keys, device=dev),
        }
        self.batch = PersistentBatch(spec_count_after_move)
        self.requests: dict[int, RequestState] = {}
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        if self.mode == "graph":
            self._capture_all()

    # -- graphs ---------------------------------------------------------------------------

    def _capture_all(self) -> None:
        dev, most = self.be.device, SPEC.capture_sizes[-1]
        self.buffers = {
            name: torch.zeros(size, dtype=torch.int64, device=dev)
            for name, size in (
                ("input_ids", most),
                ("positions", most),
                ("slot_mapping", most),
                ("token_rows", most),
                ("logits_indices", SPEC.max_num_reqs),
            )
        }
        self.buffers["block_tables"] = torch.zeros(
            PAD_ROW + 1, SPEC.max_blocks_per_req, dtype=torch.int64, device=dev
        )
        pool = self.be.graph_pool_handle()
        empty = self._inputs([], 0)
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._upload(empty, size)  # every token and row is padding while capturing
            self._static_forward(size)  # warm-up outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                out = self._static_forward(size)
            self.graphs[size] = (graph, out)

    def _static_forward(self, size: int) -> torch.Tensor:
        b, rows = self.buffers, min(size, SPEC.max_num_reqs)
        return forward(
            self.weights.t,
            self._state["k_cache"],
            self._state["v_cache"],
            self.consts,
            b["input_ids"][:size],
            b["positions"][:size],
            b["slot_mapping"][:size],
            b["token_rows"][:size],
            b["block_tables"],
            b["logits_indices"][:rows],
        )

    def _upload(self, inputs: dict[str, np.ndarray], size: int) -> None:
        """Write every element a graph of `size` reads: the batch's prefix, padding after it."""
        n_tok, n_req = len(inputs["input_ids"]), len(inputs["logits_indices"])
        pad_slot = SPEC.null_block * SPEC.block_size
        for name, fill in (
            ("input_ids", 0),
            ("positions", 0),
            ("slot_mapping", pad_slot),
            ("token_rows", PAD_ROW),
        ):
            staged = np.full(size, fill, dtype=np.int64)
            staged[:n_tok] = inputs[name]
            self.buffers[name][:size].copy_(torch.from_numpy(staged))
        rows = min(size, SPEC.max_num_reqs)
        staged = np.zeros(rows, dtype=np.int64)
        staged[:n_req] = inputs["logits_indices"]
        self.buffers["logits_indices"][:rows].copy_(torch.from_numpy(staged))
        tables = np.full((PAD_ROW + 1, SPEC.max_blocks_per_req), SPEC.null_block, np.int64)
        tables[:n_req] = inputs["block_tables"]
        self.buffers["block_tables"].copy_(torch.from_numpy(tables))

    # -- the persistent batch -------------------------------------------------------------

    def _update_states(self, batch: Batch) -> None:
        pb, present = self.batch, {r.req_id for r in batch.requests}
        for req_id in [rid for rid in pb.index if rid not in present]:
            pb.remove(req_id)  # not scheduled this step: its state is kept for its return
        drafts_allowed = "spec_decode" in SPEC.features
        returning: list[tuple[Request, RequestState]] = []
        for request in batch.requests:
            state = self.requests.get(request.req_id)
            if not _continues(state, request):
                if request.req_id in pb.index:
                    pb.remove(request.req_id)
                state = RequestState(tokens=[0] * request.context_len)
                self.requests[request.req_id] = state
            assert state is not None
            new_blocks = list(request.block_ids[len(state.block_ids) :])
            state.block_ids.extend(new_blocks)
            state.num_computed = request.context_len
            state.tokens[request.context_len :] = request.tokens
            row = pb.index.get(request.req_id)
            if row is None:
                returning.append((request, state))
                continue
            pb.append_blocks(row, new_blocks)
            pb.stage(row, request, drafts_allowed)
            state.decoding = state.decoding or request.query_len == 1
            pb.decoding[row] = state.decoding
        for request, state in returning:
            row = pb.add(request.req_id, state)
            pb.stage(row, request, drafts_allowed)
            state.decoding = state.decoding or request.query_len == 1
            pb.decoding[row] = state.decoding
        pb.condense()

    def _prepare_inputs(self) -> dict[str, np.ndarray]:
        """Gather the step's flat inputs from rows 0..num_reqs-1, as vLLM's _prepare_inputs."""
        pb = self.batch
        n = pb.num_reqs
        counts = pb.num_scheduled[:n]
        rows = np.repeat(np.arange(n), counts)
        starts = np.cumsum(counts) - counts
        positions = pb.num_computed[rows] + np.arange(len(rows)) - starts[rows]
        return self._inputs(list(zip(rows.tolist(), positions.tolist(), strict=True)), n)

    def _inputs(self, tokens: list[tuple[int, int]], n: int) -> dict[str, np.ndarray]:
        pb, bs = self.batch, SPEC.block_size
        rows = np.array([r for r, _ in tokens], dtype=np.int64)
        positions = np.array([p for _, p in tokens], dtype=np.int64)
        blocks = pb.block_table[rows, positions // bs] if tokens else rows
        tables = np.full((n, SPEC.max_blocks_per_req), SPEC.null_block, np.int64)
        for row in range(n):
            tables[row, : pb.num_blocks[row]] = pb.block_table[row, : pb.num_blocks[row]]
        return {
            "input_ids": pb.token_ids[rows, positions] if tokens else rows,
            "positions": positions,
            "slot_mapping": blocks * bs + positions % bs,
            "token_rows": rows,
            "logits_indices": np.cumsum(pb.num_scheduled[:n]) - 1,
            "block_tables": tables,
        }

    # -- the contract ---------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        problems = batch_problems(batch, SPEC)
        if problems:
            raise ValueError("illegal batch: " + "; ".join(problems))
        with torch.no_grad():
            self._update_states(batch)
            inputs = self._prepare_inputs()
            n = batch.num_reqs
            size = next((s for s in SPEC.capture_sizes if s >= batch.num_tokens), None)
            if self.mode == "graph" and size is not None:
                self._upload(inputs, size)
                graph, out = self.graphs[size]
                graph.replay()  # type: ignore[attr-defined]
                rows_logits, path, key, reason = out[:n], "full", size, None
            else:
                rows_logits = self._eager(inputs)
                path, key = "eager", None
                reason = "eager twin" if self.mode == "eager" else "tokens past the largest graph"
            order = [self.batch.index[r.req_id] for r in batch.requests]
            logits = rows_logits[torch.tensor(order, device=self.be.device)]
            return StepResult(logits, logits.argmax(dim=-1), path, key, reason)  # type: ignore[arg-type]

    def _eager(self, inputs: dict[str, np.ndarray]) -> torch.Tensor:
        dev = self.be.device
        t = {name: torch.tensor(value, device=dev) for name, value in inputs.items()}
        pad = torch.full((1, SPEC.max_blocks_per_req), SPEC.null_block, device=dev)
        tables = torch.cat([t["block_tables"], pad])
        return forward(
            self.weights.t,
            self._state["k_cache"],
            self._state["v_cache"],
            self.consts,
            t["input_ids"],
            t["positions"],
            t["slot_mapping"],
            t["token_rows"],
            tables,
            t["logits_indices"],
        )

    def state(self) -> Mapping[str, torch.Tensor]:
        return self._state

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return self.buffers if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.no_grad():
            self.weights.load(seed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.be.synchronize()
            for graph, _ in self.graphs.values():
                graph.reset()  # type: ignore[attr-defined]
            self.graphs.clear()
        finally:
            self.be.deactivate()


def _continues(state: RequestState | None, request: Request) -> bool:
    """Whether `request` continues the state kept under its id (else it starts again)."""
    if state is None or request.context_len == 0:
        return False
    known = len(state.block_ids)
    return (
        state.num_computed <= request.context_len <= len(state.tokens)
        and list(request.block_ids[:known]) == state.block_ids
    )


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PersistentBatchRunner:
    return PersistentBatchRunner(mode, seed=seed, backend=backend, spec_count_after_move=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PersistentBatchRunner:
    return PersistentBatchRunner(mode, seed=seed, backend=backend, spec_count_after_move=True)
