"""A graph runner in the style of vLLM V1's GPU model runner with `FULL_AND_PIECEWISE` CUDA graphs
and asynchronous scheduling, written against plain `torch.cuda` only.

- The scheduler tells the runner which requests are new, which finished, and which blocks the
  running ones gained (`SchedulerOutput`). A persistent batch (`PersistentBatch`) keeps a row per
  live request in pinned host memory: its block table, its block count and its sampling
  parameters. Finished requests leave holes that the batch condenses by moving the last rows in.
- Every step stages its tokens, positions, slot mapping and sampling rows in pinned buffers
  (`InputStager`) and copies them, with the persistent batch, into persistent device buffers by
  `non_blocking` copies on the current stream. Nothing waits for the device but the host's wait on
  the last step's copies (`prep_done`) before it rewrites pinned memory, so the next step can be
  prepared while this one still runs: results are left on the device, ordered on the current
  stream, and downloaded only when the caller reads them.
- Uniform batches (every request with the same query length, 1 or 2) replay a FULL graph of the
  whole forward with a decode attention that knows the token-to-request map from the shape and
  computes slots from the block table; requests are padded to fill the graph. Other batches whose
  padded token count is a capture size replay PIECEWISE graphs: the token-wise pieces are captured
  per size and the attention between them runs eagerly on the pieces' static outputs into a static
  buffer the next piece reads. The rest runs eagerly. Padding tokens write only the null block.
  The LM head and the sampler run eagerly after the forward, on the requests' last tokens.

`BUGS` names the bugs the runner can be built with, each modelled on one a public engine shipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from tests.runners.piecewise_async_model import (
    DecodeMetadata,
    ModelConfig,
    TinyDecoder,
    TokenMetadata,
)

BUGS = frozenset(
    {
        # a batch is judged uniform from its token total alone (num_tokens == num_reqs * q), so
        # a mixed batch such as query lengths (1, 3) replays the q = 2 FULL decode graph, whose
        # attention maps tokens to requests by shape (vllm-project/vllm#51865,
        # local-inference-lab/vllm#298: uniform decode classified from token shape alone)
        "uniform_decode_by_token_total",
        # the slot mapping's padding tail is filled only where requests are padded (FULL), so
        # PIECEWISE padding tokens write the keys of slots an earlier step staged (vllm-project/
        # vllm#28579 and #36626: attention metadata built for another token count than the
        # padded one the pieces run)
        "piecewise_pad_slots_stale",
        # the persistent batch (pinned block table and sampling rows) is updated before the wait
        # on the last step's uploads, so it is rewritten while those copies may still read it
        # (vllm-project/vllm#25279: the synchronized section of #24527 did not cover the reused
        # CPU tensors `_update_states` writes)
        "batch_updated_before_prep_wait",
        # condensing moves a request's block-table row but not its block count, so blocks it
        # gains later are appended at the departed request's count (vllm-project/vllm-ascend#13864
        # and vllm-project/vllm#51599: per-row state of a condensed row left behind)
        "block_count_not_moved_on_condense",
        # only the live requests' block-table rows are uploaded; the FULL graph pads requests and
        # its padding requests compute their slots from device rows a departed request left
        # (vllm-project/vllm#25251: pad num_reqs for FULL graphs before building metadata)
        "decode_table_uploaded_unpadded",
    }
)

Mode = Literal["full", "piecewise", "eager"]
GraphKey = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    max_num_reqs: int = 8
    max_num_tokens: int = 32
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)  # in tokens
    decode_query_lens: tuple[int, ...] = (1, 2)  # uniform batches with these replay FULL graphs
    null_block: int = 0
    enforce_eager: bool = False


@dataclass(frozen=True, slots=True)
class NewRequest:
    req_id: int
    block_ids: tuple[int, ...]
    seed: int | None
    temperature: float


@dataclass(frozen=True, slots=True)
class ScheduledTokens:
    req_id: int
    tokens: tuple[int, ...]
    context_len: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    finished: tuple[int, ...]
    new: tuple[NewRequest, ...]
    new_blocks: dict[int, tuple[int, ...]]  # running requests' blocks added since last step
    scheduled: tuple[ScheduledTokens, ...]  # every request of the step, in the output order


@dataclass(slots=True)
class StepOutput:
    logits: Tensor  # [num_reqs, vocab], in the scheduled order, on the device
    tokens: Tensor  # [num_reqs] int64, on the device
    mode: Mode
    graph_key: GraphKey | None
    reason: str | None


@dataclass(frozen=True, slots=True)
class Plan:
    mode: Mode
    size: int  # padded tokens (the eager path: the step's own)
    query_len: int = 0  # FULL only
    reason: str | None = None

    @property
    def key(self) -> GraphKey | None:
        if self.mode == "full":
            return ("full", self.query_len, self.size)
        return ("piecewise", self.size) if self.mode == "piecewise" else None


def pinned(shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0) -> Tensor:
    return torch.full(shape, fill, dtype=dtype, pin_memory=True)


class PersistentBatch:
    """Row `r` holds request `req_ids[r]`, dense from row 0. The arrays are pinned and copied to
    the device every step; `pad_row` (the last block-table row) stays null for padding tokens."""

    def __init__(self, cfg: RunnerConfig, bug: str | None) -> None:
        self.bug = bug
        self.null = cfg.null_block
        n = cfg.max_num_reqs
        self.pad_row = n
        self.req_ids: list[int | None] = [None] * n
        self.row_of: dict[int, int] = {}
        self.block_table = pinned(
            (n + 1, cfg.model.max_blocks_per_req), torch.int64, cfg.null_block
        )
        self.num_blocks = np.zeros(n, np.int64)
        self.seeds = pinned((n,), torch.int64, -1)  # -1: greedy
        self.temperatures = pinned((n,), torch.float32, 1.0)
        self._table = self.block_table.numpy()
        self._seeds = self.seeds.numpy()
        self._temps = self.temperatures.numpy()

    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    def update(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished:
            self._clear(self.row_of.pop(req_id))
        for new in sched.new:  # into the lowest hole, as the next condense would put it
            self._add(new, self.req_ids.index(None))
        for req_id, blocks in sched.new_blocks.items():
            row, count = self.row_of[req_id], int(self.num_blocks[self.row_of[req_id]])
            self._table[row, count : count + len(blocks)] = blocks
            self.num_blocks[row] = count + len(blocks)
        self._condense()

    def _add(self, new: NewRequest, row: int) -> None:
        self.req_ids[row] = new.req_id
        self.row_of[new.req_id] = row
        self._table[row] = self.null
        self._table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        self._seeds[row] = -1 if new.seed is None else new.seed & 0x7FFFFFFF
        self._temps[row] = 1.0 if new.seed is None else new.temperature

    def _condense(self) -> None:
        for hole in range(self.num_reqs):
            if self.req_ids[hole] is None:
                last = max(r for r, req in enumerate(self.req_ids) if req is not None)
                self._move(last, hole)

    def _move(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        self.req_ids[dst] = req_id
        self.row_of[req_id] = dst
        self._table[dst] = self._table[src]
        if self.bug != "block_count_not_moved_on_condense":
            self.num_blocks[dst] = self.num_blocks[src]
        self._seeds[dst], self._temps[dst] = self._seeds[src], self._temps[src]
        self._clear(src)

    def _clear(self, row: int) -> None:
        self.req_ids[row] = None
        self._table[row] = self.null
        if self.bug != "block_count_not_moved_on_condense":
            self.num_blocks[row] = 0  # the buggy runner leaves it for the row's next occupant

    def slots(self, row: int, positions: np.ndarray, block_size: int) -> np.ndarray:
        return self._table[row, positions // block_size] * block_size + positions % block_size


class InputStager:
    """Pinned staging and the persistent device buffers it is copied into (the graphs' inputs)."""

    def __init__(self, cfg: RunnerConfig, batch: PersistentBatch) -> None:
        t, r = cfg.max_num_tokens, cfg.max_num_reqs
        self.cfg = cfg
        self.batch = batch
        self.host = {
            "input_ids": pinned((t,), torch.int64),
            "positions": pinned((t,), torch.int64),
            "token_row": pinned((t,), torch.int64, batch.pad_row),
            "slot_mapping": pinned((t,), torch.int64),
            "seq_lens": pinned((r,), torch.int64),
            "logits_indices": pinned((r,), torch.int64),
            "sample_rows": pinned((r,), torch.int64),
        }
        self.np = {name: buf.numpy() for name, buf in self.host.items()}
        self.host["block_table"] = batch.block_table
        self.host["seeds"] = batch.seeds
        self.host["temperatures"] = batch.temperatures
        self.device = {
            name: torch.zeros_like(buf, device="cuda") for name, buf in self.host.items()
        }
        self.device["token_row"].fill_(batch.pad_row)

    def stage(self, sched: SchedulerOutput, plan: Plan) -> None:
        """Tokens in row order, so a uniform batch lays out request by request; the outputs in
        the scheduled order."""
        bs = self.cfg.model.block_size
        b, a = self.batch, self.np
        by_id = {s.req_id: s for s in sched.scheduled}
        start, first_token = 0, {}
        for row in range(b.num_reqs):
            s = by_id[b.req_ids[row]]  # type: ignore[index]
            end = start + len(s.tokens)
            positions = np.arange(s.context_len, s.context_len + len(s.tokens))
            a["input_ids"][start:end] = s.tokens
            a["positions"][start:end] = positions
            a["token_row"][start:end] = row
            a["slot_mapping"][start:end] = b.slots(row, positions, bs)
            a["seq_lens"][row] = end - start + s.context_len
            first_token[s.req_id] = start
            start = end
        self._pad(start, plan)
        for i, s in enumerate(sched.scheduled):
            a["logits_indices"][i] = first_token[s.req_id] + len(s.tokens) - 1
            a["sample_rows"][i] = b.row_of[s.req_id]

    def _pad(self, num_tokens: int, plan: Plan) -> None:
        a = self.np
        a["input_ids"][num_tokens : plan.size] = 0
        a["positions"][num_tokens : plan.size] = 0
        a["token_row"][num_tokens : plan.size] = self.batch.pad_row
        if plan.mode == "full" or self.batch.bug != "piecewise_pad_slots_stale":
            a["slot_mapping"][num_tokens : plan.size] = (
                self.cfg.null_block * self.cfg.model.block_size
            )
        if plan.mode == "full":  # padding requests: a null table, positions 0 .. q - 1
            a["seq_lens"][self.batch.num_reqs : plan.size // plan.query_len] = plan.query_len

    def upload(self) -> None:
        for name, src in self.host.items():
            dst = self.device[name]
            if name == "block_table" and self.batch.bug == "decode_table_uploaded_unpadded":
                src, dst = src[: self.batch.num_reqs], dst[: self.batch.num_reqs]
            dst.copy_(src, non_blocking=True)

    def token_metadata(self, size: int) -> TokenMetadata:
        d = self.device
        return TokenMetadata(
            d["block_table"], d["token_row"][:size], d["positions"][:size], d["slot_mapping"][:size]
        )

    def decode_metadata(self, size: int, query_len: int) -> DecodeMetadata:
        d = self.device
        reqs = size // query_len
        return DecodeMetadata(d["block_table"][:reqs], d["seq_lens"][:reqs], query_len)


class GraphRunner:
    def __init__(self, cfg: RunnerConfig, *, seed: int, bug: str | None = None) -> None:
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}")
        self.cfg = cfg
        self.bug = bug
        self.model = TinyDecoder(cfg.model, seed=seed)
        self.batch = PersistentBatch(cfg, bug)
        self.stager = InputStager(cfg, self.batch)
        self.prep_done = torch.cuda.Event()
        self.attn_out = torch.zeros(
            cfg.max_num_tokens, cfg.model.num_heads, cfg.model.head_dim, device="cuda"
        )
        self.full: dict[GraphKey, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pieces: dict[int, list[tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]]] = {}
        self.pool = None if cfg.enforce_eager else torch.cuda.graph_pool_handle()
        if not cfg.enforce_eager:
            self.capture()

    # dispatch ----------------------------------------------------------------------------------

    def plan(self, sched: SchedulerOutput) -> Plan:
        query_lens = [len(s.tokens) for s in sched.scheduled]
        num_tokens, num_reqs = sum(query_lens), len(query_lens)
        if self.cfg.enforce_eager:
            return Plan("eager", num_tokens, reason="enforce_eager")
        if self.bug == "uniform_decode_by_token_total":
            uniform = num_tokens // num_reqs if num_tokens % num_reqs == 0 else None
        else:
            uniform = query_lens[0] if len(set(query_lens)) == 1 else None
        if uniform in self.cfg.decode_query_lens:
            assert uniform is not None
            size = self._full_size(num_tokens, uniform)
            if size is not None:
                return Plan("full", size, uniform)
        size = next((s for s in self.cfg.capture_sizes if s >= num_tokens), None)
        if size is not None:
            return Plan("piecewise", size)
        return Plan("eager", num_tokens, reason=f"{num_tokens} tokens exceed the capture sizes")

    def _full_size(self, num_tokens: int, query_len: int) -> int | None:
        return next(
            (s for s in self._full_sizes(query_len) if s >= num_tokens),
            None,
        )

    def _full_sizes(self, query_len: int) -> list[int]:
        return [
            s
            for s in self.cfg.capture_sizes
            if s % query_len == 0 and s // query_len <= self.cfg.max_num_reqs
        ]

    # one step ----------------------------------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> StepOutput:
        if self.bug == "batch_updated_before_prep_wait":
            self.batch.update(sched)
            self.prep_done.synchronize()
        else:
            self.prep_done.synchronize()  # the last step's copies have read the pinned buffers
            self.batch.update(sched)
        plan = self.plan(sched)
        self.stager.stage(sched, plan)
        self.stager.upload()
        self.prep_done.record()
        hidden = self.forward(plan)
        n = len(sched.scheduled)
        d = self.stager.device
        rows, last = d["sample_rows"][:n], d["logits_indices"][:n]
        logits = self.model.logits(hidden[last])
        tokens = self.model.sample(
            logits,
            d["seeds"][rows],
            d["temperatures"][rows],
            d["positions"][last],
            d["input_ids"][last],
        )
        return StepOutput(logits, tokens, plan.mode, plan.key, plan.reason)

    def forward(self, plan: Plan) -> Tensor:
        if plan.mode == "full":
            graph, hidden = self.full[plan.key]  # type: ignore[index]
            graph.replay()
            return hidden
        if plan.mode == "piecewise":
            return self._replay_pieces(plan.size)
        ids = self.stager.device["input_ids"][: plan.size]
        return self.model.forward_mixed(ids, self.stager.token_metadata(plan.size))

    def _replay_pieces(self, size: int) -> Tensor:
        meta = self.stager.token_metadata(size)
        pieces = self.pieces[size]
        for layer, (graph, outputs) in enumerate(pieces):
            graph.replay()
            if layer < self.cfg.model.num_layers:
                _, q, k, v = outputs
                self.attn_out[:size].copy_(self.model.attention(layer, q, k, v, meta))
        return pieces[-1][1][0]

    # capture -----------------------------------------------------------------------------------

    def capture(self) -> None:
        """At start-up, largest first, every graph in one pool; the static buffers hold padding
        (null tables, null slots), so warm-up and capture write only the null block."""
        for size in sorted(self.cfg.capture_sizes, reverse=True):
            self._capture_pieces(size)
            for q in self.cfg.decode_query_lens:
                if size in self._full_sizes(q):
                    self._capture_full(size, q)
        torch.cuda.synchronize()

    def _capture_full(self, size: int, query_len: int) -> None:
        d = self.stager.device
        d["seq_lens"].fill_(query_len)
        meta = self.stager.decode_metadata(size, query_len)
        args = (d["input_ids"][:size], d["positions"][:size], meta)
        self.model.forward_decode(*args)  # warm-up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model.forward_decode(*args)
        self.full[("full", query_len, size)] = (graph, hidden)

    def _capture_pieces(self, size: int) -> None:
        """Piece `i` reads the residual piece `i - 1` left in its captured output and the static
        attention buffer, so each is captured after the one before it."""
        pieces: list[tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]] = []
        for index in range(self.cfg.model.num_layers + 1):
            residual = pieces[-1][1][0] if pieces else None
            self._run_piece(index, size, residual)  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self._run_piece(index, size, residual)
            pieces.append((graph, outputs))
        self.pieces[size] = pieces

    def _run_piece(self, index: int, size: int, residual: Tensor | None) -> tuple[Tensor, ...]:
        m, d, attn = self.model, self.stager.device, self.attn_out[:size]
        if residual is None:
            return m.first_piece(d["input_ids"][:size], d["positions"][:size])
        if index < m.cfg.num_layers:
            return m.middle_piece(index, residual, attn)
        return (m.last_piece(residual, attn),)

    # the rest ----------------------------------------------------------------------------------

    def static_buffers(self) -> dict[str, Tensor]:
        return {} if self.cfg.enforce_eager else dict(self.stager.device)

    def shutdown(self) -> None:
        torch.cuda.synchronize()
        for graph, _ in self.full.values():
            graph.reset()
        for pieces in self.pieces.values():
            for graph, _ in pieces:
                graph.reset()
        self.full.clear()
        self.pieces.clear()
