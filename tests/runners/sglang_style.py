"""A graph runner in the style of SGLang's CudaGraphRunner, on plain `torch.cuda` only.

Decode batches replay graphs captured for `capture_bs` (largest first, one shared pool), padded up
to the next captured size; extend (prefill, mixed) batches and larger ones run eagerly, on a
forward stream of their own. Graph inputs live in persistent buffers: `input_ids`,
`req_pool_indices` (rows of `req_to_token`, the token-to-KV-slot table), `seq_lens` (positions are
`seq_lens - 1` inside the graph, the write slot `req_to_token[row, position]`), `seeds` and
`temperatures`. Row 0 of `req_to_token` belongs to padding and points at the null block. Inputs
are staged on the current stream and scattered into the buffers on a copy stream.

The model (`sglang_style_model.py`) is a two-layer decoder with a slot-major paged KV cache and
counter-based Gumbel sampling keyed by `(seed, position, token)`. Nothing here knows of any test
harness.

`BUGS` are one-line departures from the correct runner, each after a bug class public engines
shipped; `ModelRunner(..., bug=name)` builds the runner with one of them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tests.runners.sglang_style_model import ModelConfig, TinyDecoder, sample

BUGS = frozenset(
    {
        # Pool row 0 is not reserved for padding: batch row i uses pool row i, so padding rows
        # (pool row 0, seq_len 1) write the first request's position-0 KV slot. After
        # TensorRT-LLM#13278 (padding dummies aliasing a live request's cache slot) and
        # vllm#43810 (padding rows overwriting a real KV slot).
        "pad_row_aliases_first_request",
        # Sampling buffers are refreshed only when some request samples; an all-greedy batch
        # replays with the last batch's seeds, so a greedy request in a row that held a sampled
        # one is sampled. After vLLM V1's "copy temperature only when not all greedy" path
        # (vllm#13311, #13587) meeting a captured per-row sampler; cf. tt-metal#55408 (greedy
        # requests nondeterministic after an earlier sampled request).
        "sampling_info_skipped_when_greedy",
        # Decode graphs read a packed (transposed, contiguous) copy of the LM head made before
        # capture; an in-place weight update does not refresh it. After sglang#4961 (w_kc/w_vc
        # derived from the loaded weights, stale under CUDA graphs after an update) and the
        # review of sglang#30247 (a derived-weight cache keyed by data_ptr misses in-place copy_).
        "packed_head_not_refreshed",
        # Staging tensors allocated on the current stream are read on the copy stream and freed
        # without record_stream: the allocator hands the block to the next staging copy while
        # the scatter may still be queued. After pytorch#23729 and NVIDIA/nvalchemi-toolkit#171.
        "staging_freed_without_record_stream",
        # The sampling counter is the token's KV slot instead of its position: the draw depends
        # on where the block manager put the request. After TensorRT-LLM#17172/#18437 (Philox
        # offsets tied to a sequence slot rather than to the request's own stream).
        "noise_keyed_by_cache_slot",
        # Extend batches run on the forward stream without waiting for the current stream, so
        # their KV reads and writes are unordered with work the caller (or the last replay)
        # queued there. After sglang#36738 and #38463 (KV transfers on a side stream not fenced
        # behind the forward stream).
        "extend_stream_not_fenced",
    }
)


@dataclass(frozen=True)
class RunnerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    capture_bs: tuple[int, ...] = (1, 2, 4, 8)
    max_running_requests: int = 8
    max_prefill_tokens: int = 32
    disable_cuda_graph: bool = False


@dataclass(frozen=True)
class Req:
    """One request's share of a step (what SGLang's ScheduleBatch holds per request)."""

    tokens: tuple[int, ...]
    context_len: int
    block_ids: tuple[int, ...]
    seed: int | None = None  # None: greedy
    temperature: float = 1.0


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_reqs, vocab] at each request's last token
    next_token_ids: torch.Tensor  # [num_reqs] int64
    graph_bs: int | None  # the captured size replayed; None when run eagerly
    fallback_reason: str | None = None


def _ints(values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device="cuda")


def _table_row(cfg: ModelConfig, block_ids: Sequence[int]) -> list[int]:
    """The KV slot of every position `0 .. max_context - 1`; the null slot past the blocks."""
    bs = cfg.block_size
    return [
        block_ids[j // bs] * bs + j % bs if j // bs < len(block_ids) else cfg.null_slot
        for j in range(cfg.max_context)
    ]


class CudaGraphRunner:
    """Decode graphs for every size of `capture_bs`, in one memory pool."""

    def __init__(self, runner: ModelRunner) -> None:
        self.model = runner.model
        self.bug = runner.bug
        self.capture_bs = runner.cfg.capture_bs
        m = runner.cfg.model
        max_bs = self.capture_bs[-1]
        self.buffers = {
            "input_ids": _ints([0] * max_bs),
            "req_pool_indices": _ints([0] * max_bs),
            "seq_lens": _ints([1] * max_bs),
            "seeds": _ints([-1] * max_bs),
            "temperatures": torch.ones(max_bs, device="cuda"),
            "req_to_token": _ints([[m.null_slot] * m.max_context] * (max_bs + 1)),
        }
        self.head = self.model.weights["lm_head"].t().contiguous()  # [E, V], read by the graphs
        self.copy_stream = torch.cuda.Stream()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.capture()

    def can_run(self, reqs: Sequence[Req]) -> str | None:
        """None when a decode graph serves `reqs`; else why they run eagerly."""
        if any(len(r.tokens) != 1 or r.context_len == 0 for r in reqs):
            return "extend batch"
        if len(reqs) > self.capture_bs[-1]:
            return f"{len(reqs)} requests above the largest captured size {self.capture_bs[-1]}"
        return None

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.capture_bs):
            self.replay_prepare([], bs)  # every row padding
            for _ in range(2):
                self.decode_forward(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.decode_forward(bs)
            self.graphs[bs] = graph

    def decode_forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.buffers
        positions = b["seq_lens"][:bs] - 1
        rows = b["req_pool_indices"][:bs]
        logits = self.model.forward(
            b["input_ids"][:bs], positions, rows, b["req_to_token"], None, self.head
        )
        counters = positions
        if self.bug == "noise_keyed_by_cache_slot":
            counters = b["req_to_token"][rows, positions]
        tokens = sample(
            logits, b["seeds"][:bs], b["temperatures"][:bs], counters, self.model.vocab_ids
        )
        return logits, tokens

    def replay(self, reqs: Sequence[Req]) -> ForwardOutput:
        raw_bs = len(reqs)
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        self.replay_prepare(reqs, bs)
        self.graphs[bs].replay()
        logits, tokens = self.outputs[bs]
        return ForwardOutput(logits[:raw_bs].clone(), tokens[:raw_bs].clone(), bs)

    def replay_prepare(self, reqs: Sequence[Req], bs: int) -> None:
        """Write the batch into the buffers' prefix and padding into rows `len(reqs) .. bs`."""
        m = self.model.cfg
        pad = bs - len(reqs)
        first_row = 0 if self.bug == "pad_row_aliases_first_request" else 1
        table = [[m.null_slot] * m.max_context for _ in range(len(reqs) + 1)]
        for i, r in enumerate(reqs):
            table[first_row + i] = _table_row(m, r.block_ids)
        ints = [
            [r.tokens[0] for r in reqs] + [0] * pad,
            [first_row + i for i in range(len(reqs))] + [0] * pad,
            [r.context_len + 1 for r in reqs] + [1] * pad,
        ]
        b = self.buffers
        packs = []
        if self.bug != "sampling_info_skipped_when_greedy" or any(r.seed is not None for r in reqs):
            temps = [float(r.temperature) for r in reqs] + [1.0] * pad
            seeds = [-1 if r.seed is None else r.seed for r in reqs] + [-1] * pad
            packs.append((torch.tensor(temps), [b["temperatures"][:bs]]))
            packs.append((torch.tensor(seeds), [b["seeds"][:bs]]))
        packs.append((torch.tensor(table), [b["req_to_token"][: len(table)]]))
        names = ("input_ids", "req_pool_indices", "seq_lens")
        packs.append((torch.tensor(ints), [b[n][:bs] for n in names]))
        for host, targets in packs:
            self._upload(host.pin_memory(), targets)
        torch.cuda.current_stream().wait_stream(self.copy_stream)

    def _upload(self, host: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """Stage on the current stream, scatter on the copy stream (after the last replay and
        whatever else the current stream queued)."""
        staged = host.to("cuda", non_blocking=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            if len(targets) == 1:
                targets[0].copy_(staged)
            else:
                for target, row in zip(targets, staged, strict=True):
                    target.copy_(row)
        if self.bug != "staging_freed_without_record_stream":
            staged.record_stream(self.copy_stream)  # freed here, read there

    def close(self) -> None:
        self.graphs.clear()
        self.outputs.clear()


class ModelRunner:
    def __init__(self, cfg: RunnerConfig, *, seed: int, bug: str | None = None) -> None:
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}; known: {sorted(BUGS)}")
        self.cfg = cfg
        self.bug = bug
        self.model = TinyDecoder(cfg.model, seed)
        self.graph_runner: CudaGraphRunner | None = None
        self.forward_stream: torch.cuda.Stream | None = None
        if not cfg.disable_cuda_graph:
            self.forward_stream = torch.cuda.Stream()
            self.graph_runner = CudaGraphRunner(self)

    def forward(self, reqs: Sequence[Req]) -> ForwardOutput:
        if self.graph_runner is None:
            return self.forward_extend(reqs, "graphs disabled")
        reason = self.graph_runner.can_run(reqs)
        if reason is None:
            return self.graph_runner.replay(reqs)
        assert self.forward_stream is not None
        current = torch.cuda.current_stream()
        if self.bug != "extend_stream_not_fenced":
            self.forward_stream.wait_stream(current)
        with torch.cuda.stream(self.forward_stream):
            out = self.forward_extend(reqs, reason)
        current.wait_stream(self.forward_stream)
        out.logits.record_stream(current)
        out.next_token_ids.record_stream(current)
        return out

    def forward_extend(self, reqs: Sequence[Req], reason: str) -> ForwardOutput:
        """Any batch, eagerly: every query token of every request."""
        m = self.cfg.model
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        last: list[int] = []
        for i, r in enumerate(reqs):
            ids += r.tokens
            positions += range(r.context_len, r.context_len + len(r.tokens))
            rows += [i] * len(r.tokens)
            last.append(len(ids) - 1)
        table = [_table_row(m, r.block_ids) for r in reqs]
        pos, row_t, last_t, table_t = _ints(positions), _ints(rows), _ints(last), _ints(table)
        head = self.model.weights["lm_head"].t()
        logits = self.model.forward(_ints(ids), pos, row_t, table_t, last_t, head)
        counters = pos[last_t]
        if self.bug == "noise_keyed_by_cache_slot":
            counters = table_t[row_t[last_t], counters]
        seeds = _ints([-1 if r.seed is None else r.seed for r in reqs])
        temps = torch.tensor([float(r.temperature) for r in reqs], device="cuda")
        tokens = sample(logits, seeds, temps, counters, self.model.vocab_ids)
        return ForwardOutput(logits, tokens, None, reason)

    def update_weights(self, seed: int) -> None:
        self.model.load_weights(seed)
        if self.graph_runner is not None and self.bug != "packed_head_not_refreshed":
            self.graph_runner.head.copy_(self.model.weights["lm_head"].t())

    def shutdown(self) -> None:
        if self.graph_runner is not None:
            self.graph_runner.close()
        self.graph_runner = None
