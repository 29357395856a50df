"""A graph runner in the style of TensorRT-LLM's PyTorch-backend CUDA graph runner and vLLM V1's
GPU model runner, written against plain `torch.cuda` only (it runs on the sim through the drop-in).

- A persistent batch (`RequestRows`) gives every live request a row, dense from row 0, and holds
  its sampling parameters, written when the request is admitted and moved with it when departed
  requests leave holes that the batch condenses.
- A metadata builder (`MetadataBuilder`) stages a step's attention metadata (query start
  locations, sequence lengths, block table, slot mapping) and sampling parameters in pinned memory
  and uploads them on a side stream into persistent buffers at max shape, padded rows included.
- Decode and speculative-decode steps of one query length replay a graph holding the forward and
  the sampler, captured lazily on the first step that needs it and kept in a dict keyed by
  `(padded requests, query length, block-table columns read)`, all in one pool; inside a capture
  the cache append runs on an auxiliary stream beside the query path. Prefill, mixed and
  oversized steps run eagerly through the same buffers.

`BUGS` names the bugs the runner can be built with, each modelled on one a public engine shipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from tests.runners.trtllm_style_model import AttentionMetadata, ModelConfig, TinyDecoder, fold_seed

BUGS = frozenset(
    {
        # padded rows' query start locations left in the pinned staging as an earlier step wrote
        # them, so a padded request claims valid token rows and overwrites their attention output
        # (vllm-project/vllm-ascend#6357, InternLM/lmdeploy#4569: padded cu_seqlens)
        "query_start_loc_tail_stale",
        # condensing the persistent batch moves a request's row but not its seed
        # (tenstorrent/tt-metal#46350; vllm-project/vllm#49613: per-row state left behind)
        "seeds_not_moved_on_condense",
        # the metadata upload does not wait for the last step's replay that reads the same
        # buffers (sgl-project/sglang#26380 and #18746: write-after-read across overlapped steps)
        "upload_over_running_replay",
        # the cache append is issued on the auxiliary stream before that stream joins the capture,
        # so it runs once at capture and never on replay (NVIDIA/TensorRT-LLM#12954: aux-stream
        # work under a decode graph capture corrupting outputs; spiriMirror/libuipc#472: work on
        # a stream outside the capture runs once and replays read its frozen result)
        "kv_append_on_unforked_stream",
        # the number of tokens to append is the capturing batch's host count, not the padded
        # count, so replays with more tokens append only the first ones (sgl-project/sglang#22404:
        # capture-time non-padded token count out of line with replay)
        "kv_append_count_baked",
        # graphs attend over a bucket of block-table columns, but the dict key leaves the bucket
        # out, so a graph captured for short sequences serves longer ones (vllm-project/vllm#9285:
        # longer sequences than a graph was captured for still replayed it;
        # huggingface/transformers#45323: graph key missing the KV length baked in the capture)
        "graph_key_without_kv_blocks",
    }
)

GraphKey = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    max_num_reqs: int = 8
    max_num_tokens: int = 32
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_graph_query_len: int = 4
    kv_block_buckets: tuple[int, ...] = (2, 4, 6)  # the largest is model.max_blocks_per_seq
    null_block: int = 0
    enforce_eager: bool = False


@dataclass(frozen=True, slots=True)
class SeqInput:
    req_id: int
    tokens: tuple[int, ...]
    context_len: int
    block_ids: tuple[int, ...]
    seed: int | None
    temperature: float


@dataclass(slots=True)
class StepOutput:
    logits: Tensor  # [num_seqs, vocab], in the caller's order
    tokens: Tensor  # [num_seqs] int64
    graph_key: GraphKey | None
    fallback_reason: str | None


class RequestRows:
    """The persistent batch: row `r` holds request `req_ids[r]` and its sampling parameters."""

    def __init__(self, max_reqs: int, *, move_seeds: bool = True) -> None:
        self.req_ids: list[int | None] = [None] * max_reqs
        self.row_of: dict[int, int] = {}
        self.temperature = np.ones(max_reqs, np.float32)
        self.seed = np.zeros(max_reqs, np.int64)
        self.greedy = np.ones(max_reqs, np.bool_)
        self.move_seeds = move_seeds

    def update(self, seqs: list[SeqInput]) -> None:
        """Drop requests that left (or start again from an empty cache, as a new request reusing
        an id does), admit new ones into the lowest free rows, then condense."""
        present = {s.req_id for s in seqs}
        restarted = {s.req_id for s in seqs if s.context_len == 0}
        for req_id in [r for r in self.row_of if r not in present or r in restarted]:
            self.req_ids[self.row_of.pop(req_id)] = None
        for s in seqs:
            if s.req_id not in self.row_of:
                self._admit(s, self.req_ids.index(None))
        self._condense()

    def _admit(self, s: SeqInput, row: int) -> None:
        self.req_ids[row] = s.req_id
        self.row_of[s.req_id] = row
        self.greedy[row] = s.seed is None
        self.temperature[row] = 1.0 if s.seed is None else s.temperature
        self.seed[row] = 0 if s.seed is None else fold_seed(s.seed)

    def _condense(self) -> None:
        live = len(self.row_of)
        for hole in range(live):
            if self.req_ids[hole] is None:
                last = max(r for r, req in enumerate(self.req_ids) if req is not None)
                self._move(last, hole)

    def _move(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.row_of[req_id] = dst
        self.temperature[dst] = self.temperature[src]
        self.greedy[dst] = self.greedy[src]
        if self.move_seeds:
            self.seed[dst] = self.seed[src]


class MetadataBuilder:
    """Stages a step's metadata in pinned buffers and uploads it on its own stream into persistent
    device buffers at max shape; the current stream waits for the upload."""

    def __init__(self, cfg: RunnerConfig, bug: str | None) -> None:
        self.cfg, self.bug = cfg, bug
        r, t, m = cfg.max_num_reqs, cfg.max_num_tokens, cfg.model
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "input_ids": ((t,), torch.int64),
            "positions": ((t,), torch.int64),
            "slot_mapping": ((t,), torch.int64),
            "query_start_loc": ((r + 1,), torch.int64),
            "seq_lens": ((r,), torch.int64),
            "block_table": ((r, m.max_blocks_per_seq), torch.int64),
            "temperature": ((r,), torch.float32),
            "seeds": ((r,), torch.int64),
            "greedy": ((r,), torch.bool),
            "out_rows": ((r,), torch.int64),  # the row of each request, in the caller's order
        }
        self.device = {n: torch.zeros(s, dtype=d, device="cuda") for n, (s, d) in shapes.items()}
        self.staging = {n: torch.zeros(s, dtype=d, pin_memory=True) for n, (s, d) in shapes.items()}
        self.host = {n: buf.numpy() for n, buf in self.staging.items()}
        self.stream = torch.cuda.Stream()
        self.uploaded = torch.cuda.Event()

    def build(
        self, seqs: list[SeqInput], rows: RequestRows, padded_reqs: int, padded_tokens: int,
        max_query_len: int, num_kv_tokens: int, num_kv_blocks: int, out_rows: list[int],
    ) -> AttentionMetadata:  # fmt: skip
        """`seqs` in row order; rows `len(seqs)..padded_reqs` are padding, each owning
        `max_query_len` padding tokens that write the null block only."""
        self.uploaded.synchronize()  # the last upload has read the staging buffers
        self._stage(seqs, rows, padded_reqs, padded_tokens, max_query_len)
        self.host["out_rows"][: len(out_rows)] = out_rows
        self._upload(padded_reqs, padded_tokens)
        d = self.device
        return AttentionMetadata(
            input_ids=d["input_ids"][:padded_tokens],
            positions=d["positions"][:padded_tokens],
            slot_mapping=d["slot_mapping"][:padded_tokens],
            query_start_loc=d["query_start_loc"][: padded_reqs + 1],
            seq_lens=d["seq_lens"][:padded_reqs],
            block_table=d["block_table"][:padded_reqs],
            temperature=d["temperature"][:padded_reqs],
            seeds=d["seeds"][:padded_reqs],
            greedy=d["greedy"][:padded_reqs],
            max_query_len=max_query_len,
            num_kv_tokens=num_kv_tokens,
            num_kv_blocks=num_kv_blocks,
        )

    def _stage(
        self, seqs: list[SeqInput], rows: RequestRows, padded_reqs: int, padded_tokens: int,
        max_query_len: int,
    ) -> None:  # fmt: skip
        h, bs, null = self.host, self.cfg.model.block_size, self.cfg.null_block
        n, tok = len(seqs), 0
        h["query_start_loc"][0] = 0
        for i, s in enumerate(seqs):
            q, blocks = len(s.tokens), np.asarray(s.block_ids, np.int64)
            pos = np.arange(s.context_len, s.context_len + q)
            h["input_ids"][tok : tok + q] = s.tokens
            h["positions"][tok : tok + q] = pos
            h["slot_mapping"][tok : tok + q] = blocks[pos // bs] * bs + pos % bs
            tok += q
            h["query_start_loc"][i + 1] = tok
            h["seq_lens"][i] = s.context_len + q
            h["block_table"][i, : len(blocks)] = blocks
            h["block_table"][i, len(blocks) :] = null
        h["temperature"][:n] = rows.temperature[:n]
        h["seeds"][:n] = rows.seed[:n]
        h["greedy"][:n] = rows.greedy[:n]
        # padding: tokens write the null block, rows read nothing
        h["input_ids"][tok:padded_tokens] = 0
        h["positions"][tok:padded_tokens] = 0
        h["slot_mapping"][tok:padded_tokens] = null * bs
        # the upload copies the whole padded prefix from here, so the tail must be rewritten
        if self.bug != "query_start_loc_tail_stale":
            h["query_start_loc"][n + 1 : padded_reqs + 1] = tok + max_query_len * np.arange(
                1, padded_reqs - n + 1
            )
        h["seq_lens"][n:padded_reqs] = 0
        h["block_table"][n:padded_reqs] = null
        h["temperature"][n:padded_reqs] = 1.0
        h["seeds"][n:padded_reqs] = 0
        h["greedy"][n:padded_reqs] = True

    def _upload(self, padded_reqs: int, padded_tokens: int) -> None:
        main = torch.cuda.current_stream()
        if self.bug != "upload_over_running_replay":
            self.stream.wait_stream(main)  # the last step's replay still reads these buffers
        lengths = {"input_ids": padded_tokens, "positions": padded_tokens}
        lengths |= {"slot_mapping": padded_tokens, "query_start_loc": padded_reqs + 1}
        with torch.cuda.stream(self.stream):
            for name, dev in self.device.items():
                k = lengths.get(name, padded_reqs)
                dev[:k].copy_(self.staging[name][:k], non_blocking=True)
            self.uploaded.record()
        main.wait_event(self.uploaded)


class GraphRunner:
    def __init__(self, cfg: RunnerConfig, *, seed: int, bug: str | None = None) -> None:
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}; known: {sorted(BUGS)}")
        self.cfg, self.bug = cfg, bug
        self.model = TinyDecoder(cfg.model, seed)
        self.rows = RequestRows(cfg.max_num_reqs, move_seeds=bug != "seeds_not_moved_on_condense")
        self.builder = MetadataBuilder(cfg, bug)
        self.aux = torch.cuda.Stream()
        self.pool = None if cfg.enforce_eager else torch.cuda.graph_pool_handle()
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, tuple[Tensor, Tensor]] = {}

    def execute(self, seqs: list[SeqInput]) -> StepOutput:
        self.rows.update(seqs)
        out_rows = [self.rows.row_of[s.req_id] for s in seqs]
        ordered = sorted(seqs, key=lambda s: self.rows.row_of[s.req_id])
        reason = self.fallback_reason(ordered)
        key = None
        if reason is not None:
            logits, tokens = self._eager(ordered, out_rows)
        else:
            key, (logits, tokens) = self._replay(self.graph_key(ordered), ordered, out_rows)
        # nothing of this step is read on the host: the next one may be prepared while it runs
        index = self.builder.device["out_rows"][: len(seqs)]
        return StepOutput(logits.index_select(0, index), tokens.index_select(0, index), key, reason)

    def fallback_reason(self, seqs: list[SeqInput]) -> str | None:
        """None when the step replays a graph; else why it runs eagerly."""
        if self.cfg.enforce_eager:
            return "enforce_eager"
        if any(s.context_len == 0 for s in seqs):
            return "prefill: graphs hold decode steps only"
        q = len(seqs[0].tokens)
        if any(len(s.tokens) != q for s in seqs):
            return "mixed query lengths"
        if q > self.cfg.max_graph_query_len:
            return f"query length {q} above {self.cfg.max_graph_query_len}"
        if self._padded_reqs(len(seqs), q) is None:
            return f"{len(seqs)} requests of {q} tokens above the largest capture size"
        return None

    def graph_key(self, seqs: list[SeqInput]) -> GraphKey:
        q = len(seqs[0].tokens)
        padded = self._padded_reqs(len(seqs), q)
        assert padded is not None
        bs = self.cfg.model.block_size
        need = max(-(-(s.context_len + q) // bs) for s in seqs)
        return (padded, q, min(b for b in self.cfg.kv_block_buckets if b >= need))

    def _padded_reqs(self, n: int, q: int) -> int | None:
        fits = [s for s in self.cfg.capture_sizes if s >= n and s * q <= self.cfg.max_num_tokens]
        return min(fits, default=None)

    def _eager(self, seqs: list[SeqInput], out_rows: list[int]) -> tuple[Tensor, Tensor]:
        n, t = len(seqs), sum(len(s.tokens) for s in seqs)
        q, width = max(len(s.tokens) for s in seqs), self.cfg.model.max_blocks_per_seq
        return self.model.forward(self.builder.build(seqs, self.rows, n, t, q, t, width, out_rows))

    def _replay(
        self, key: GraphKey, seqs: list[SeqInput], out_rows: list[int]
    ) -> tuple[GraphKey, tuple[Tensor, Tensor]]:
        padded, q, width = key
        appended = padded * q  # padding tokens append to the null block
        if self.bug == "kv_append_count_baked":
            appended = sum(len(s.tokens) for s in seqs)
        meta = self.builder.build(seqs, self.rows, padded, padded * q, q, appended, width, out_rows)
        if self.bug == "graph_key_without_kv_blocks":
            key = key[:2]
        if key not in self.graphs:
            self._capture(key, meta)
        self.graphs[key].replay()
        return key, self.outputs[key]

    def _capture(self, key: GraphKey, meta: AttentionMetadata) -> None:
        self.model.forward(meta)  # warm-up on the live batch: it writes what the replay rewrites
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        late_fork = self.bug == "kv_append_on_unforked_stream"
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[key] = self.model.forward(meta, aux=self.aux, late_fork=late_fork)
        self.graphs[key] = graph

    def static_buffers(self) -> dict[str, Tensor]:
        return {} if self.cfg.enforce_eager else dict(self.builder.device)

    def shutdown(self) -> None:
        torch.cuda.synchronize()
        self.graphs.clear()
        self.outputs.clear()
