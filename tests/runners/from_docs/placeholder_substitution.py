"""Async scheduling with on-device placeholder substitution, as vLLM's TPU runner does it.

The runner
----------
Every step pads its tokens to a capture size and replays one FULL graph of that many token rows
(prefill, mixed and decode batches alike, the way `tpu-inference` pads every step to a token
bucket), or runs eagerly past the largest size. Requests live in a persistent batch in the style
of vLLM V1's `InputBatch`: a request that leaves frees its row, a newcomer takes the lowest free
row, and `condense` moves the last rows down into the holes that remain, so a request's row can
change from one step to the next and the flattened token order is the runner's own, not the
batch's (results are gathered back to the batch's order in the graph).

Asynchronous scheduling: a request that continues its sequence where its own last step left it,
with one query token, takes as its input the token that step sampled for it, which never leaves
the device. Sampled tokens stay in `last_sampled`, one entry per request (vLLM's model runner V2
keeps `last_sampled_tokens` per request state; SGLang indexes its future map by request slot),
and each step's graph gathers them through an index map from the persistent batch's rows
(`idx_mapping`). Before the forward the graph substitutes them into the flattened token ids
(tpu-inference's `_substitute_placeholder_token`, vLLM's `_prepare_input_ids`): `dst_idx` lists
the positions to overwrite, `src_idx` the request each takes its token from, and `n_sub` how many
entries are real. The index arrays have the graph's length, so the entries past `n_sub` are
padding: the correct runner pads `dst_idx` with the positions it does not substitute (a
permutation of the rows, as the fix does), so each padding entry writes a position's own value
back. After sampling, the graph stores each row's token at its request's entry; padding rows store
theirs in a scratch entry no request owns. The host never reads a sampled token to prepare the
next step; `next_tokens` are device tensors, and staging is one pinned buffer uploaded on the
current stream behind an event.

The bug
-------
`make_buggy_target` pads `dst_idx` with -1, as tpu-inference did before
https://github.com/vllm-project/tpu-inference/pull/991 ("async scheduler fix
_substitute_placeholder_token_fn bug"). Index -1 is the last token row of the graph, so every
padding entry writes that row's original (placeholder) value back over it. When a step fills its
graph exactly and its last token is a substituted one, and some other token is not substituted (a
prompt, a request new to the batch), the scatter writes the substituted token and then the
placeholder over it; the request runs its step on the placeholder. The eager path sizes the index
arrays to the substitutions and never pads. On CUDA, as under XLA, which of the duplicate writes
lands is unspecified; on the CPU (the sim) the later entries win, so the padding's write lands.

What the contract could not express
-----------------------------------
The harness's batches carry every query token, and a continuing request's token is not the one
the runner sampled for it the step before: the harness draws it. A runner that feeds its own
sampled tokens back (vLLM with async scheduling ignores the scheduler's placeholder there) computes
a continuing request's step from its own sample, not from the token in the batch. Both twins do so,
from the same samples, so the harness's comparison of twins still holds, but the logits are not the
batch's, and nothing in the contract can check that a runner substitutes the right token. Where
the sampled tokens live matters too: kept by the rows of the step before, as vLLM V1's
`prev_sampled_token_ids` and `prev_req_id_to_index` keep them, a request that sat out a step reads
the batch's token, so its result depends on whether it ran in the step before. The company twin,
which runs only a step's sampled requests, skips a step with none, and judges such a correct
runner wrong (`sampling_independent`). One entry per request makes the token depend on the
request's own steps alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.backends import GraphHandle
from pytest_graphmode.runtime.model import Decoder, DecoderConfig, DecoderInputs, sample

CONFIG = DecoderConfig(
    vocab_size=256,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    mlp=128,
    block_size=4,
    num_blocks=64,
    max_blocks_per_req=8,
)
CAPTURE_SIZES = (1, 2, 4, 8, 16)  # token buckets
MAX_NUM_REQS = 8
MAX_NUM_TOKENS = 32
PAD_SLOT = -1  # the decoder sends it to the null block
PAD_SEQ_LEN = 1  # a padding row sees one key (in the null block)
MAX_REQ_IDS = 1024  # `last_sampled` entries; a request with a larger id always reads the batch
SCRATCH = MAX_REQ_IDS  # the entry padding rows store their samples in

# The packed integer staging: every graph input but the temperatures, at its largest shape.
_FIELDS: tuple[tuple[str, int], ...] = (
    ("token_ids", MAX_NUM_TOKENS),
    ("positions", MAX_NUM_TOKENS),
    ("slot_mapping", MAX_NUM_TOKENS),
    ("dst_idx", MAX_NUM_TOKENS),
    ("src_idx", MAX_NUM_TOKENS),
    ("n_sub", 1),
    ("query_start", MAX_NUM_REQS + 1),
    ("seq_lens", MAX_NUM_REQS),
    ("block_tables", MAX_NUM_REQS * CONFIG.max_blocks_per_req),
    ("seeds", MAX_NUM_REQS),
    ("idx_mapping", MAX_NUM_REQS),
    ("result_rows", MAX_NUM_REQS),
)


@dataclass
class _Plan:
    """One step's host-side layout: which rows, which tokens, what to substitute."""

    num_tokens: int
    num_reqs: int  # rows 0 .. num_reqs - 1 of the persistent batch, after condensing
    order: list[Request]  # the requests by row
    dst: list[int]  # flattened positions whose token comes from the device
    src: list[int]  # the `last_sampled` entry each one takes
    result_rows: list[int]  # the row of each request of the batch, in the batch's order


class PersistentBatch:
    """Request rows kept from step to step, vLLM V1 style: holes refilled, then condensed."""

    def __init__(self, max_rows: int) -> None:
        self.rows: list[int | None] = [None] * max_rows
        self.seq_len: list[int] = [0] * max_rows  # tokens cached after the row's last step

    def update(self, batch: Batch) -> list[Request]:
        wanted = {r.req_id: r for r in batch.requests}
        for row, rid in enumerate(self.rows):
            # Gone, or not where the row left it (preempted and back from 0): drop the row.
            if rid is not None and (
                rid not in wanted or wanted[rid].context_len != self.seq_len[row]
            ):
                self.rows[row] = None
        kept = {rid for rid in self.rows if rid is not None}
        for request in batch.requests:
            if request.req_id not in kept:
                self.rows[self.rows.index(None)] = request.req_id  # the lowest free row
        self._condense()
        order = [wanted[rid] for rid in self.rows if rid is not None]
        for row, request in enumerate(order):
            self.seq_len[row] = request.seq_len
        return order

    def _condense(self) -> None:
        rows = self.rows
        while True:
            holes = [i for i, rid in enumerate(rows) if rid is None]
            last = max((i for i, rid in enumerate(rows) if rid is not None), default=-1)
            if not holes or holes[0] > last:
                return
            rows[holes[0]], rows[last] = rows[last], None
            self.seq_len[holes[0]] = self.seq_len[last]


class PlaceholderSubstitutionRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, pad_with_last: bool
    ) -> None:
        self.mode = mode
        self.pad_with_last = pad_with_last
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
        self.backend = backends.get(backend)
        self.backend.activate()
        self._closed = False
        try:
            self._build(seed)
        except BaseException:
            self.backend.deactivate()
            raise

    def _build(self, seed: int) -> None:
        device = self.backend.device
        self.decoder = Decoder(CONFIG, seed=seed, device=device)
        self.batch_rows = PersistentBatch(MAX_NUM_REQS)
        # Each request's last sampled token (device) and its sequence length after that step
        # (host): a shortcut checked against the batch (`context_len`) before it is trusted.
        self.last_sampled = torch.zeros(MAX_REQ_IDS + 1, dtype=torch.int64, device=device)
        self.last_seq_len: dict[int, int] = {}

        size = sum(n for _, n in _FIELDS)
        self.pinned = self.backend.empty_pinned(size, dtype=torch.int64)
        self.pinned_temps = self.backend.empty_pinned(MAX_NUM_REQS, dtype=torch.float32)
        self.packed = torch.zeros(size, dtype=torch.int64, device=device)
        self.temps = torch.ones(MAX_NUM_REQS, dtype=torch.float32, device=device)
        self.staged = self.backend.Event()  # the upload out of `pinned` has been issued
        self.staged_once = False
        self.views: dict[str, Tensor] = {}
        self.host: dict[str, np.ndarray] = {}
        start = 0
        pinned_np = self.pinned.numpy()
        for name, n in _FIELDS:
            self.views[name] = self.packed[start : start + n]
            self.host[name] = pinned_np[start : start + n]
            start += n
        self.arange = torch.arange(MAX_NUM_TOKENS, dtype=torch.int64, device=device)

        self.graphs: dict[int, tuple[GraphHandle, tuple[Tensor, Tensor]]] = {}
        if self.mode == "graph":
            self._capture()

    # ---- graphs -------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(CAPTURE_SIZES, reverse=True):
            self._stage(_Plan(0, 0, [], [], [], []), size)
            self._forward(size, self._rows_for(size), padded=True)  # warm-up
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                outputs = self._forward(size, self._rows_for(size), padded=True)
            self.graphs[size] = (graph, outputs)
        self.backend.synchronize()

    @staticmethod
    def _rows_for(num_tokens: int) -> int:
        return min(num_tokens, MAX_NUM_REQS)  # every request has at least one token

    def _forward(
        self, num_tokens: int, num_reqs: int, *, padded: bool, num_sub: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Substitute, run the decoder, sample: no host reads, so it captures as a whole."""
        v = self.views
        tokens = v["token_ids"][:num_tokens]
        if padded:
            # tpu-inference's `_substitute_placeholder_token`: index arrays as long as the graph.
            dst = v["dst_idx"][:num_tokens]
            live = self.arange[:num_tokens] < v["n_sub"]
            new = self.last_sampled.index_select(0, v["src_idx"][:num_tokens])
            tokens[dst] = torch.where(live, new, tokens[dst])
        elif num_sub:  # eager: index arrays exactly as long as the substitutions
            dst = v["dst_idx"][:num_sub]
            tokens[dst] = self.last_sampled.index_select(0, v["src_idx"][:num_sub])
        inputs = DecoderInputs(
            token_ids=tokens,
            positions=v["positions"][:num_tokens],
            slot_mapping=v["slot_mapping"][:num_tokens],
            query_start=v["query_start"][: num_reqs + 1],
            seq_lens=v["seq_lens"][:num_reqs],
            block_tables=v["block_tables"][: num_reqs * CONFIG.max_blocks_per_req].view(
                num_reqs, CONFIG.max_blocks_per_req
            ),
            adapter_ids=torch.zeros(num_reqs, dtype=torch.int64, device=tokens.device),
        )
        logits = self.decoder.forward(inputs)
        sampled = sample(logits, v["seeds"][:num_reqs], self.temps[:num_reqs], inputs.seq_lens)
        self.last_sampled[v["idx_mapping"][:num_reqs]] = sampled  # the next steps' inputs
        rows = v["result_rows"][:num_reqs]
        return logits.index_select(0, rows), sampled.index_select(0, rows)

    # ---- host side ----------------------------------------------------------------------

    def _plan(self, batch: Batch) -> _Plan:
        order = self.batch_rows.update(batch)
        dst: list[int] = []
        src: list[int] = []
        position = 0
        for request in order:
            rid = request.req_id
            continues = (
                rid < MAX_REQ_IDS
                and self.last_seq_len.get(rid) == request.context_len
                and len(request.tokens) == 1
            )
            if continues:  # its input is the token its last step sampled
                dst.append(position)
                src.append(rid)
            position += len(request.tokens)
        for request in order:
            self.last_seq_len[request.req_id] = request.seq_len
        row_of = {r.req_id: row for row, r in enumerate(order)}
        result_rows = [row_of[r.req_id] for r in batch.requests]
        return _Plan(batch.num_tokens, len(order), order, dst, src, result_rows)

    def _stage(self, plan: _Plan, num_tokens: int) -> None:
        if self.staged_once:
            self.staged.synchronize()  # the last upload has read the pinned buffer
        h = self.host
        h["token_ids"][:] = 0
        h["positions"][:] = 0
        h["slot_mapping"][:] = PAD_SLOT
        h["seq_lens"][:] = PAD_SEQ_LEN
        h["block_tables"][:] = CONFIG.null_block
        h["seeds"][:] = -1
        h["idx_mapping"][:] = SCRATCH
        h["result_rows"][:] = 0
        temps = self.pinned_temps.numpy()
        temps[:] = 1.0
        tables = h["block_tables"].reshape(MAX_NUM_REQS, CONFIG.max_blocks_per_req)
        position = 0
        starts = [0]
        for row, request in enumerate(plan.order):
            for offset, token in enumerate(request.tokens):
                pos = request.context_len + offset
                h["token_ids"][position] = token
                h["positions"][position] = pos
                h["slot_mapping"][position] = kv_slot(request.block_ids, pos, CONFIG.block_size)
                position += 1
            starts.append(position)
            h["seq_lens"][row] = request.seq_len
            tables[row, : len(request.block_ids)] = request.block_ids
            h["seeds"][row] = -1 if request.seed is None else request.seed
            h["idx_mapping"][row] = min(request.req_id, SCRATCH)
            temps[row] = request.temperature
        h["query_start"][:] = position
        h["query_start"][: len(starts)] = starts
        # Substitutions first; the padding entries write a position's own value back.
        n_sub = len(plan.dst)
        if self.pad_with_last:
            pad = [-1] * (num_tokens - n_sub)
        else:
            taken = set(plan.dst)
            pad = [i for i in range(num_tokens) if i not in taken]
        h["dst_idx"][:] = 0
        h["dst_idx"][:num_tokens] = plan.dst + pad
        h["src_idx"][:] = 0
        h["src_idx"][:n_sub] = plan.src
        h["n_sub"][0] = n_sub
        h["result_rows"][: plan.num_reqs] = plan.result_rows
        self.packed.copy_(self.pinned, non_blocking=True)
        self.temps.copy_(self.pinned_temps, non_blocking=True)
        self.staged.record()
        self.staged_once = True

    # ---- the contract -------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        plan = self._plan(batch)
        n = batch.num_reqs
        size = next((s for s in CAPTURE_SIZES if s >= plan.num_tokens), None)
        if self.mode == "graph" and size is not None:
            self._stage(plan, size)
            graph, (logits, tokens) = self.graphs[size]
            graph.replay()
            path, key, reason = "full", ("tokens", size), None
        else:
            self._stage(plan, plan.num_tokens)
            logits, tokens = self._forward(plan.num_tokens, n, padded=False, num_sub=len(plan.dst))
            path, key = "eager", None
            reason = None if self.mode == "eager" else f"{plan.num_tokens} tokens past the graphs"
        return StepResult(logits[:n].clone(), tokens[:n].clone(), path, key, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"kv_cache": self.decoder.kv_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode != "graph":
            return {}
        return {**self.views, "temperatures": self.temps}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.decoder.load_weights(seed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.backend.synchronize()
            for graph, _ in self.graphs.values():
                graph.reset()
            self.graphs.clear()
        finally:
            self.backend.deactivate()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PlaceholderSubstitutionRunner:
    return PlaceholderSubstitutionRunner(mode, seed=seed, backend=backend, pad_with_last=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PlaceholderSubstitutionRunner:
    return PlaceholderSubstitutionRunner(mode, seed=seed, backend=backend, pad_with_last=True)
