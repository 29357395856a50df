"""A graph runner in the style of static-cache decoding loops (gpt-fast, Hugging Face's
StaticCache with `cache_position`) and of lmdeploy's / LightLLM's decode graph runners, written
against plain `torch.cuda` only (on a CPU-only host it runs on the sim through the drop-in).

- Every request sees its cache as one contiguous run of positions: a slot map (position -> KV
  slot) built from its paged blocks, columns past its blocks pointing at the null block.
- Decode graphs are captured eagerly at start-up, one per batch size in `capture_sizes`, largest
  first, into one shared pool. Their inputs live in static buffers at `max_num_reqs` rows (token
  ids, slot maps, seeds, temperatures), filled with `copy_` before each replay; a batch is padded
  up to the next captured size with rows that read and write the null block only. The graph
  writes its logits and tokens into static outputs, which the runner copies out.
- Positions live on the device, as the static-cache loops keep `cache_position`: every replay
  advances them in place (`+= 1`). A host mirror remembers which request and position each row
  holds, so a row whose request continues where the last replay left it needs no upload.
- Prefill, mixed, speculative and oversized steps run eagerly through the same model.
- Weights are (re)loaded in place, staged through one pinned buffer and copied without blocking.

`BUGS` names the bugs the runner can be built with, each a small departure modelled on one a
public engine shipped; `StaticCacheRunner(..., bug=name)` builds the runner with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tests.runners.static_cache_style_model import GREEDY, ModelConfig, TinyDecoder, sample

BUGS = frozenset(
    {
        # The fast path that skips the position upload trusts a row whose request id matches the
        # last replay's, without checking the position it reached: a request that decoded a step
        # eagerly in between (a mixed batch), was preempted, or is a new request reusing an id
        # replays from a stale device-side position. After mstar-project/mstar#56 (sequence
        # lengths advanced on the eager path and not under CUDA graphs) and
        # huggingface/candle#3728 (decode position going stale under graph replay).
        "positions_trusted_by_request_id",
        # Attention zeroes masked slots by probability alone: a zero weight times a NaN in a
        # slot past the request's length (the null block, an unwritten tail) is NaN. After
        # Dao-AILab/flash-attention#1745 and #2374 (NaN in unused KV cache entries reaching the
        # output through the PV product).
        "masked_values_multiplied",
        # The int8 activation scale is one amax over the whole padded batch instead of one per
        # token, so padding rows (and batch company) move every valid row's quantization. After
        # flashinfer-ai/flashinfer#3057 (padded CUDA-graph rows corrupting the quantization
        # scales of real rows).
        "activation_scale_over_padded_batch",
        # A batch above the largest captured size replays the largest graph instead of running
        # eagerly: rows past it are neither computed nor written to the cache, and their results
        # are read from stale static outputs. After NVIDIA/TensorRT-LLM#7675 and #10687 (batch
        # sizes beyond the captured ones reaching the CUDA graph path).
        "oversized_batch_clamped_to_largest_graph",
        # Weight loading refills the one pinned staging buffer without waiting for the previous
        # non-blocking copy out of it, so a weight may receive the next weight's values. After
        # LeelaChessZero/lc0#731 (async host-to-device weight copies whose source is reused or
        # freed before the copy ran) and PrimeIntellect-ai/prime-rl#3315 (review: a staging
        # buffer reused under a pending non-blocking copy).
        "weights_staged_through_one_pinned_buffer",
    }
)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_num_reqs: int = 10  # above the largest captured size: such batches run eagerly
    max_num_tokens: int = 32
    null_block: int = 31  # reserved for padding: never a request's
    enforce_eager: bool = False

    @property
    def null_slot(self) -> int:
        return self.null_block * self.model.block_size


@dataclass(frozen=True, slots=True)
class SeqInput:
    req_id: int
    tokens: tuple[int, ...]
    context_len: int
    block_ids: tuple[int, ...]
    seed: int | None
    temperature: float


@dataclass(slots=True)
class RunnerOutput:
    logits: Tensor  # [num_reqs, vocab]
    tokens: Tensor  # [num_reqs] int64, on the device
    graph_key: tuple[str, int] | None
    fallback_reason: str | None


class PinnedWeightLoader:
    """Fills weights in place (captured graphs keep reading the same tensors) from host values
    staged through one pinned buffer and copied without blocking."""

    def __init__(self, weights: dict[str, Tensor], *, wait_for_copy: bool) -> None:
        self.weights = weights
        self.wait_for_copy = wait_for_copy
        largest = max(w.numel() for w in weights.values())
        self.staging = torch.empty(largest, pin_memory=True)
        self.copied = torch.cuda.Event()

    def load(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            scale = 1.0 if "embed" in name else 2.0 * weight.shape[1] ** -0.5
            values = torch.randn(weight.shape, generator=generator) * scale
            if self.wait_for_copy:
                self.copied.synchronize()  # the last copy has read the staging buffer
            staged = self.staging[: weight.numel()].view(weight.shape)
            staged.copy_(values)
            weight.copy_(staged, non_blocking=True)
            self.copied.record()


class StaticCacheRunner:
    def __init__(self, config: RunnerConfig, *, seed: int, bug: str | None = None) -> None:
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}")
        self.config = config
        self.bug = bug
        m = config.model
        self.model = TinyDecoder(
            m,
            per_token_scale=bug != "activation_scale_over_padded_batch",
            mask_values=bug != "masked_values_multiplied",
        )
        self.loader = PinnedWeightLoader(
            self.model.weights, wait_for_copy=bug != "weights_staged_through_one_pinned_buffer"
        )
        self.loader.load(seed)
        rows = config.max_num_reqs
        self.inputs = {
            "input_ids": torch.zeros(rows, dtype=torch.int64, device="cuda"),
            "slot_maps": torch.full(
                (rows, m.max_context), config.null_slot, dtype=torch.int64, device="cuda"
            ),
            "seeds": torch.full((rows,), GREEDY, dtype=torch.int64, device="cuda"),
            "temperatures": torch.ones(rows, device="cuda"),
        }
        # Carried from replay to replay on the device; `held` mirrors it on the host:
        # (request id, position) per row, None where unknown.
        self.positions = torch.zeros(rows, dtype=torch.int64, device="cuda")
        self.held: list[tuple[int, int] | None] = [None] * rows
        self.out_logits = torch.zeros(rows, m.vocab_size, device="cuda")
        self.out_tokens = torch.zeros(rows, dtype=torch.int64, device="cuda")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if not config.enforce_eager:
            self._capture_all()

    # -- capture ----------------------------------------------------------------------------------

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.config.capture_sizes, reverse=True):
            self._fill([], size)  # every row is padding in warm-up and capture
            self._decode(size)  # warm-up outside the graph
            torch.cuda.synchronize()
            self._fill([], size)  # the warm-up advanced the padding positions
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._decode(size)
            self.graphs[size] = graph
        self.held = [None] * self.config.max_num_reqs

    def _decode(self, size: int) -> None:
        """What a decode graph holds: forward and sampler over `size` rows, the results written
        into the static outputs, then every row's position advanced in place."""
        inputs, positions = self.inputs, self.positions[:size]
        logits = self.model.forward(
            inputs["input_ids"][:size], positions, inputs["slot_maps"][:size], None
        )
        tokens = sample(logits, inputs["seeds"][:size], inputs["temperatures"][:size], positions)
        self.out_logits[:size].copy_(logits)
        self.out_tokens[:size].copy_(tokens)
        positions.add_(1)

    # -- steps ------------------------------------------------------------------------------------

    def execute(self, seqs: Sequence[SeqInput]) -> RunnerOutput:
        reason = self._fallback_reason(seqs)
        if reason is not None:
            logits, tokens = self._eager(seqs)
            return RunnerOutput(logits, tokens, None, reason)
        size = self._graph_size(len(seqs))
        assert size is not None
        self._fill(seqs, size)
        self.graphs[size].replay()
        n = len(seqs)
        for row, s in enumerate(seqs):
            self.held[row] = (s.req_id, s.context_len + 1)
        return RunnerOutput(
            self.out_logits[:n].clone(), self.out_tokens[:n].clone(), ("decode", size), None
        )

    def _graph_size(self, n: int) -> int | None:
        sizes = self.config.capture_sizes
        largest = sizes[-1] if self.bug == "oversized_batch_clamped_to_largest_graph" else None
        return next((s for s in sizes if s >= n), largest)

    def _fallback_reason(self, seqs: Sequence[SeqInput]) -> str | None:
        if not self.graphs:
            return "graphs disabled"
        if not seqs:
            return "empty batch"
        if any(len(s.tokens) != 1 for s in seqs):
            return "prefill, mixed or speculative step"
        if self._graph_size(len(seqs)) is None:
            return f"{len(seqs)} requests above the largest captured size"
        return None

    def _fill(self, seqs: Sequence[SeqInput], size: int) -> None:
        """Write the batch into the static inputs' prefix and reset rows n..size to padding."""
        n = len(seqs)
        inputs = self.inputs
        if n:
            inputs["input_ids"][:n].copy_(_host([s.tokens[0] for s in seqs]))
            inputs["slot_maps"][:n].copy_(_host([self._slot_map(s) for s in seqs]))
            inputs["seeds"][:n].copy_(_host([_fold_seed(s.seed) for s in seqs]))
            inputs["temperatures"][:n].copy_(
                torch.tensor([s.temperature for s in seqs], dtype=torch.float32)
            )
            if not self._positions_current(seqs):
                self.positions[:n].copy_(_host([s.context_len for s in seqs]))
        inputs["input_ids"][n:size].zero_()
        inputs["slot_maps"][n:size].fill_(self.config.null_slot)
        inputs["seeds"][n:size].fill_(GREEDY)
        inputs["temperatures"][n:size].fill_(1.0)
        self.positions[n:size].zero_()
        self.held[n:size] = [None] * max(0, size - n)

    def _positions_current(self, seqs: Sequence[SeqInput]) -> bool:
        """Whether the device already holds every row's position (the last replay left it so)."""
        if self.bug == "positions_trusted_by_request_id":
            return all(
                (held := self.held[i]) is not None and held[0] == s.req_id
                for i, s in enumerate(seqs)
            )
        return all(self.held[i] == (s.req_id, s.context_len) for i, s in enumerate(seqs))

    def _slot_map(self, seq: SeqInput) -> list[int]:
        """The request's positions laid end to end over its blocks; the rest on the null block."""
        m = self.config.model
        blocks = list(seq.block_ids) + [self.config.null_block] * (
            m.max_blocks_per_req - len(seq.block_ids)
        )
        return [b * m.block_size + o for b in blocks for o in range(m.block_size)]

    def _eager(self, seqs: Sequence[SeqInput]) -> tuple[Tensor, Tensor]:
        vocab = self.config.model.vocab_size
        if not seqs:
            return torch.zeros(0, vocab, device="cuda"), torch.zeros(
                0, dtype=torch.int64, device="cuda"
            )
        ids, positions, maps, last = [], [], [], []
        for s in seqs:
            slot_map = self._slot_map(s)
            for j, token in enumerate(s.tokens):
                ids.append(token)
                positions.append(s.context_len + j)
                maps.append(slot_map)
            last.append(len(ids) - 1)
        position_t = _host(positions).to("cuda")
        logits = self.model.forward(
            _host(ids).to("cuda"), position_t, _host(maps).to("cuda"), _host(last).to("cuda")
        )
        last_positions = _host([s.context_len + len(s.tokens) - 1 for s in seqs]).to("cuda")
        seeds = _host([_fold_seed(s.seed) for s in seqs]).to("cuda")
        temps = torch.tensor([s.temperature for s in seqs], dtype=torch.float32).to("cuda")
        return logits, sample(logits, seeds, temps, last_positions)

    def static_buffers(self) -> dict[str, Tensor]:
        return dict(self.inputs) if self.graphs else {}

    def shutdown(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()


def _host(values: list[int] | list[list[int]]) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _fold_seed(seed: int | None) -> int:
    """A request's seed as a non-negative 62-bit value; GREEDY for a greedy request."""
    return GREEDY if seed is None else seed & ((1 << 62) - 1)
