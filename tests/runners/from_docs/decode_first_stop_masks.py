"""A decode-first persistent batch whose rows carry min-length stop masks into a decode graph.

Design (after vLLM's V1 `InputBatch` with a decode/prefill-split attention backend, and V2's
`LogitBiasState` for the min-tokens state kept on the device):

- **Persistent batch.** Each request of a step holds a row. Rows of requests the step does not
  schedule are removed (their host state is kept, as vLLM keeps `CachedRequestState`), a request
  new to the batch takes the lowest free row, the rows are condensed (the last row moves into the
  lowest hole) and then reordered decode-first: a prefill row (query longer than one token) in
  front of the decode prefix swaps places with a decode row behind it, as vLLM's
  `reorder_batch_to_split_decodes_and_prefills` does for FlashInfer, MLA and GDN.
- **Per-row generation state on the device**, written when a request takes its row, moved with
  it by condense and swap, never restaged per step: `min_length` (int64, per row) and `stop_mask`
  (bool, per row and vocabulary entry: the request's stop token ids). Until a request's sequence
  reaches its minimum length its stop tokens are suppressed (HF's `MinLengthLogitsProcessor`,
  vLLM's min_tokens in `LogitBiasState`). The contract's `Request` has no such parameters, so the
  engine's request params are derived from `req_id` (`generation_params`): a pure function, the
  same on every twin, carrying nothing from one example to the next.
- **The logits processor runs inside the captured step**: forward, stop-token suppression
  (`seq_len < min_length[row]` and `stop_mask[row]`, read from the persistent rows), then
  counter-based sampling (the runtime's `sample`: Gumbel noise hashed from seed and position).
- **Graphs.** One FULL graph per capture size (1, 2, 4, 8 rows, one token each), captured at
  start-up largest first in one pool. After the reorder, a step's decode rows are a prefix of the
  persistent batch: that prefix replays the graph of its padded row count, and the prefill rows
  behind it run eagerly after the replay (their keys go to other slots). The eager twin runs the
  same persistent batch and the same processor, all eagerly. Results are gathered back into the
  batch's order (fresh tensors, owned by the caller).

The bug (`make_buggy_target`): the reorder's swap exchanges the two rows' stop masks with a tuple
assignment of row views, `m[i], m[j] = m[j], m[i]`. Integer indexing returns views, so the first
assignment copies row j into row i and the second copies row i (now row j's contents) back into
row j: both rows end with the decode request's mask, and the prefill request swapped behind the
decode prefix suppresses the decode request's stop tokens instead of its own for as long as it
keeps that row. Only the mask is swapped that way (the per-row lengths, like vLLM's numpy
columns, swap correctly). Source: vLLM PR #48419, "[Bugfix] V1: fix allowed_token_ids_mask
aliasing in InputBatch.swap_states" (https://github.com/vllm-project/vllm/pull/48419):
`swap_states` swapped `allowed_token_ids_mask_cpu_tensor` rows with exactly this tuple of views,
so on the decode/prefill reorder "both rows collapse to the original i2 contents, and the request
that ends up at index i2 silently loses its allowed_token_ids restriction (or inherits the wrong
one)". The same reorder swap shared one row's thinking-budget state between two requests in
https://github.com/vllm-project/vllm/pull/51890.

What the contract could not express: per-request sampling constraints (min_tokens, stop or
allowed token ids) have no field in `Request`; they are derived from `req_id` here. The bug does
not depend on graphs: the graph and eager twins share the persistent batch and corrupt the same
row alike, so only a twin whose batches have other company (the harness's company twin, which
runs the sampled requests alone) can tell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.model import Decoder, DecoderConfig, DecoderInputs, make_inputs
from pytest_graphmode.runtime.model import sample as sample_tokens

CONFIG = DecoderConfig(
    vocab_size=128,
    hidden=32,
    layers=1,
    heads=2,
    kv_heads=1,
    head_dim=16,
    mlp=64,
    block_size=4,
    num_blocks=48,
    max_blocks_per_req=8,
)
MAX_NUM_REQS = 8
MAX_NUM_TOKENS = 32
CAPTURE_SIZES = (1, 2, 4, 8)
EOS = CONFIG.vocab_size - 1
MIN_LENGTHS = (0, 12, 20, 28)  # 0: no minimum; the longest sequence holds 32 tokens


def generation_params(req_id: int) -> tuple[int, tuple[int, ...]]:
    """(min_length, stop token ids) of a request: what an API request would carry."""
    group = req_id % 5
    stops = (EOS, 96 + 4 * group, 97 + 4 * group, 98 + 4 * group)
    return MIN_LENGTHS[req_id % len(MIN_LENGTHS)], stops


class PersistentBatch:
    """Rows of the requests a step runs, decode rows first, with their min-length state."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.req_ids: list[int | None] = [None] * MAX_NUM_REQS
        self.query_lens = [0] * MAX_NUM_REQS
        self.next_context: dict[int, int] = {}  # req_id -> context_len its next step continues at
        self.min_length = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.stop_mask = torch.zeros(
            (MAX_NUM_REQS, CONFIG.vocab_size), dtype=torch.bool, device=device
        )

    def row_of(self, req_id: int) -> int:
        return self.req_ids.index(req_id)

    def update(self, batch: Batch) -> int:
        """Make rows 0..n-1 hold the batch's requests, decode rows first; return the number of
        decode rows (the prefix a decode graph can run)."""
        scheduled = {r.req_id: r for r in batch.requests}
        for row, req_id in enumerate(self.req_ids):
            if req_id is not None and req_id not in scheduled:
                self.req_ids[row] = None  # not scheduled: leaves the batch, its params stay known
        written: list[tuple[int, Request]] = []
        for request in batch.requests:
            if request.req_id in self.req_ids:
                row = self.row_of(request.req_id)
                if request.context_len != self.next_context.get(request.req_id):
                    written.append((row, request))  # restarted or not what the row continues
            else:
                row = self.req_ids.index(None)  # the lowest free row
                self.req_ids[row] = request.req_id
                written.append((row, request))
            self.query_lens[row] = len(request.tokens)
            self.next_context[request.req_id] = request.seq_len
        self._write_rows(written)
        self._condense(batch.num_reqs)
        return self._reorder_decodes_first(batch.num_reqs)

    def _write_rows(self, written: list[tuple[int, Request]]) -> None:
        """Staged writes of the rows of requests new to the batch: one scatter per tensor."""
        if not written:
            return
        rows = torch.tensor([row for row, _ in written], dtype=torch.int64)
        lengths = torch.zeros(len(written), dtype=torch.int64)
        masks = torch.zeros((len(written), CONFIG.vocab_size), dtype=torch.bool)
        for i, (_, request) in enumerate(written):
            min_length, stops = generation_params(request.req_id)
            lengths[i] = min_length
            masks[i, list(stops)] = True
        rows = rows.to(self.device)
        self.min_length.index_copy_(0, rows, lengths.to(self.device))
        self.stop_mask.index_copy_(0, rows, masks.to(self.device))

    def _condense(self, num_reqs: int) -> None:
        """Move the last occupied rows into the holes below `num_reqs`."""
        for hole in range(num_reqs):
            if self.req_ids[hole] is not None:
                continue
            last = max(row for row, req_id in enumerate(self.req_ids) if req_id is not None)
            self.req_ids[hole], self.req_ids[last] = self.req_ids[last], None
            self.query_lens[hole] = self.query_lens[last]
            self.min_length[hole].copy_(self.min_length[last])
            self.stop_mask[hole].copy_(self.stop_mask[last])

    def _reorder_decodes_first(self, num_reqs: int) -> int:
        decode = [self.query_lens[row] == 1 for row in range(num_reqs)]
        num_decodes = sum(decode)
        prefills_in_front = [row for row in range(num_decodes) if not decode[row]]
        decodes_behind = [row for row in range(num_reqs - 1, num_decodes - 1, -1) if decode[row]]
        for front, behind in zip(prefills_in_front, decodes_behind, strict=True):
            self.swap(front, behind)
        return num_decodes

    def swap(self, i: int, j: int) -> None:
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        self.query_lens[i], self.query_lens[j] = self.query_lens[j], self.query_lens[i]
        pair = torch.tensor([i, j], dtype=torch.int64, device=self.device)
        swapped = torch.tensor([j, i], dtype=torch.int64, device=self.device)
        self.min_length.index_copy_(0, pair, self.min_length.index_select(0, swapped))
        self.swap_stop_masks(i, j, pair, swapped)

    def swap_stop_masks(self, i: int, j: int, pair: Tensor, swapped: Tensor) -> None:
        self.stop_mask.index_copy_(0, pair, self.stop_mask.index_select(0, swapped))


class AliasedSwapBatch(PersistentBatch):
    """The bug: the masks' rows swapped through a tuple of views (vLLM PR #48419)."""

    def swap_stop_masks(self, i: int, j: int, pair: Tensor, swapped: Tensor) -> None:
        self.stop_mask[i], self.stop_mask[j] = self.stop_mask[j], self.stop_mask[i]


def suppress_and_sample(
    logits: Tensor,
    seq_lens: Tensor,
    seeds: Tensor,
    temperatures: Tensor,
    min_length: Tensor,
    stop_mask: Tensor,
) -> tuple[Tensor, Tensor]:
    """The in-graph logits processor and sampler over rows that line up with the batch rows."""
    below = (seq_lens < min_length).unsqueeze(1)
    logits = logits.masked_fill(below & stop_mask, float("-inf"))
    return logits, sample_tokens(logits, seeds, temperatures, seq_lens)


class DecodeFirstRunner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        batch_cls: type[PersistentBatch] = PersistentBatch,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode={mode!r} must be 'graph' or 'eager'")
        self.mode = mode
        self.spec = TargetSpec(
            num_blocks=CONFIG.num_blocks,
            block_size=CONFIG.block_size,
            max_blocks_per_req=CONFIG.max_blocks_per_req,
            vocab_size=CONFIG.vocab_size,
            max_num_reqs=MAX_NUM_REQS,
            max_num_tokens=MAX_NUM_TOKENS,
            capture_sizes=CAPTURE_SIZES,
            features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
            null_block=CONFIG.null_block,
        )
        self.be = backends.get(backend)
        self.be.activate()
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.static: dict[str, Tensor] = {}
        try:
            with torch.inference_mode():
                self.device = torch.device(self.be.device)
                self.decoder = Decoder(CONFIG, seed=seed, device=self.device)
                self.rows = batch_cls(self.device)
                if mode == "graph":
                    self._allocate_static()
                    self._capture()
        except BaseException:
            self.be.deactivate()
            raise

    # -- graph mode -----------------------------------------------------------------------------

    def _allocate_static(self) -> None:
        n, d = MAX_NUM_REQS, self.device
        self.no_adapters = torch.zeros(n, dtype=torch.int64, device=d)  # read by no op
        self.static = {
            "token_ids": torch.zeros(n, dtype=torch.int64, device=d),
            "positions": torch.zeros(n, dtype=torch.int64, device=d),
            "slot_mapping": torch.zeros(n, dtype=torch.int64, device=d),
            "query_start": torch.zeros(n + 1, dtype=torch.int64, device=d),
            "seq_lens": torch.zeros(n, dtype=torch.int64, device=d),
            "block_tables": torch.zeros(
                (n, CONFIG.max_blocks_per_req), dtype=torch.int64, device=d
            ),
            "seeds": torch.zeros(n, dtype=torch.int64, device=d),
            "temperatures": torch.zeros(n, dtype=torch.float32, device=d),
        }

    def _static_step(self, size: int) -> tuple[Tensor, Tensor]:
        s = self.static
        inputs = DecoderInputs(
            token_ids=s["token_ids"][:size],
            positions=s["positions"][:size],
            slot_mapping=s["slot_mapping"][:size],
            query_start=s["query_start"][: size + 1],
            seq_lens=s["seq_lens"][:size],
            block_tables=s["block_tables"][:size],
            adapter_ids=self.no_adapters[:size],
        )
        logits = self.decoder.forward(inputs)
        return suppress_and_sample(
            logits,
            inputs.seq_lens,
            s["seeds"][:size],
            s["temperatures"][:size],
            self.rows.min_length[:size],
            self.rows.stop_mask[:size],
        )

    def _capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(CAPTURE_SIZES, reverse=True):
            self._stage([], size)  # every row is padding in the warm-up and the capture
            self._static_step(size)
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self._static_step(size)
            self.graphs[size] = graph

    def _stage(self, decodes: Sequence[Request], size: int) -> None:
        """Write the decode rows into the static buffers' prefix, padding rows after them."""
        bs, null = CONFIG.block_size, CONFIG.null_block
        n = len(decodes)
        tokens = [r.tokens[0] for r in decodes] + [0] * (size - n)
        positions = [r.context_len for r in decodes] + [0] * (size - n)
        slots = [kv_slot(r.block_ids, r.context_len, bs) for r in decodes] + [-1] * (size - n)
        query_start = list(range(n + 1)) + [n] * (size - n)
        seq_lens = [r.seq_len for r in decodes] + [1] * (size - n)
        tables = [
            list(r.block_ids) + [null] * (CONFIG.max_blocks_per_req - len(r.block_ids))
            for r in decodes
        ] + [[null] * CONFIG.max_blocks_per_req] * (size - n)
        seeds = [-1 if r.seed is None else r.seed for r in decodes] + [-1] * (size - n)
        temps = [r.temperature for r in decodes] + [1.0] * (size - n)
        s = self.static
        for name, values in (
            ("token_ids", tokens),
            ("positions", positions),
            ("slot_mapping", slots),
            ("seq_lens", seq_lens),
            ("seeds", seeds),
        ):
            s[name][:size].copy_(torch.tensor(values, dtype=torch.int64))
        s["query_start"][: size + 1].copy_(torch.tensor(query_start, dtype=torch.int64))
        s["block_tables"][:size].copy_(torch.tensor(tables, dtype=torch.int64))
        s["temperatures"][:size].copy_(torch.tensor(temps, dtype=torch.float32))

    # -- both modes -------------------------------------------------------------------------------

    def _eager_rows(self, requests: Sequence[Request], first_row: int) -> tuple[Tensor, Tensor]:
        inputs = make_inputs(CONFIG, requests, device=self.device)
        seeds = torch.tensor(
            [-1 if r.seed is None else r.seed for r in requests], dtype=torch.int64
        ).to(self.device)
        temps = torch.tensor([r.temperature for r in requests], dtype=torch.float32)
        rows = slice(first_row, first_row + len(requests))
        logits = self.decoder.forward(inputs)
        return suppress_and_sample(
            logits,
            inputs.seq_lens,
            seeds,
            temps.to(self.device),
            self.rows.min_length[rows],
            self.rows.stop_mask[rows],
        )

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            num_decodes = self.rows.update(batch)
            by_id = {r.req_id: r for r in batch.requests}
            ordered = [by_id[self.rows.req_ids[row]] for row in range(batch.num_reqs)]
            logits_parts, token_parts = [], []
            first_eager, key, reason = 0, None, "eager twin"
            if self.mode == "graph" and num_decodes:
                size = min(s for s in CAPTURE_SIZES if s >= num_decodes)
                self._stage(ordered[:num_decodes], size)
                self.graphs[size].replay()
                logits, tokens = self.outputs[size]
                logits_parts.append(logits[:num_decodes])
                token_parts.append(tokens[:num_decodes])
                first_eager, key = num_decodes, ("decode", size)
                reason = f"{num_decodes} decode rows replayed, {batch.num_reqs - num_decodes} eager"
            elif self.mode == "graph":
                reason = "no decode rows"
            if first_eager < batch.num_reqs:
                logits, tokens = self._eager_rows(ordered[first_eager:], first_eager)
                logits_parts.append(logits)
                token_parts.append(tokens)
            order = torch.tensor(
                [self.rows.row_of(r.req_id) for r in batch.requests], dtype=torch.int64
            ).to(self.device)
            logits = torch.cat(logits_parts).index_select(0, order)
            tokens = torch.cat(token_parts).index_select(0, order)
        return StepResult(
            logits=logits,
            next_tokens=tokens,
            path="full" if key is not None else "eager",
            graph_key=key,
            reason=reason,
        )

    def state(self) -> Mapping[str, Tensor]:
        return {"kv_cache": self.decoder.kv_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.static

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.decoder.load_weights(seed)

    def close(self) -> None:
        if self.be is None:
            return
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.be.deactivate()
        self.be = None


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str = "sim"
) -> DecodeFirstRunner:
    return DecodeFirstRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str = "sim"
) -> DecodeFirstRunner:
    return DecodeFirstRunner(mode, seed=seed, backend=backend, batch_cls=AliasedSwapBatch)
