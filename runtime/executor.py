"""The graph executor: stage -> dispatch -> replay (or eager) -> sample -> copy out.

One executor owns one decoder's graphs. Every step is staged into the persistent inputs first
(a bad batch is rejected there, before anything is written). FULL steps replay the graph of their
key, capturing it on first use, with sampling inside the graph; PIECEWISE steps (when enabled)
replay graph pieces with eager attention between them; every other step runs the same decoder
eagerly on the same static inputs. Results are copies the caller owns.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from pytest_graphmode.contract import AddressView, Batch, StepResult
from pytest_graphmode.runtime.backends import Backend
from pytest_graphmode.runtime.buckets import schedule
from pytest_graphmode.runtime.buffers import InputLimits, StaticInputs
from pytest_graphmode.runtime.captured_steps import (
    CapturedStep,
    StepFn,
    capture_full,
    capture_pieces,
)
from pytest_graphmode.runtime.data_parallel import Coordinator, DataParallel
from pytest_graphmode.runtime.dispatch import CAPTURE_FAILED, Decision, Dispatcher
from pytest_graphmode.runtime.executor_stats import ExecutorStats, StatsRecorder
from pytest_graphmode.runtime.keys import GraphKey, uses_adapters
from pytest_graphmode.runtime.memory import GraphMemory, VmmUnsupportedError, make_graph_memory
from pytest_graphmode.runtime.model import (
    PAD_ADAPTER,
    PAD_POSITION,
    PAD_SLOT,
    PAD_TOKEN,
    Decoder,
    sample,
)
from pytest_graphmode.runtime.padding import PaddingPolicy


class GraphExecutor:
    """Runs a `Decoder` step by step through captured graphs, falling back to eager with a reason.

    `capture_sizes` are padded request counts of the FULL graphs (empty: always eager);
    `max_query_len` is the longest uniform query length they serve (1 + k for speculative
    decoding with k draft tokens). The static inputs hold `max_num_reqs` requests and
    `max_num_tokens` tokens; larger batches are rejected. With `piecewise`, batches no FULL graph
    serves run as PIECEWISE graphs keyed by their token count padded to a power of two (attention
    runs eagerly between the pieces); without it they run eagerly. `memory` is the graph-memory
    strategy ("separate" | "shared" | "vmm"), or "auto": vmm where it can run, else shared with a
    warning that says why (`memory_note` keeps the reason). With `data_parallel` (a group of
    more than one rank) every step is coordinated with the other ranks first (see
    `runtime.data_parallel`); an empty batch then runs the agreed shape as a dummy batch.
    """

    def __init__(
        self,
        decoder: Decoder,
        backend: Backend,
        *,
        capture_sizes: Sequence[int],
        max_query_len: int = 1,
        memory: str = "auto",
        piecewise: bool = False,
        max_num_reqs: int | None = None,
        max_num_tokens: int | None = None,
        data_parallel: DataParallel | None = None,
    ) -> None:
        if _normalised(decoder.device) != _normalised(backend.device):
            raise ValueError(
                f"decoder lives on {decoder.device} but backend {backend.name!r} runs on "
                f"{backend.device}: build the Decoder with device=backend.device"
            )
        self.decoder = decoder
        self.backend = backend
        largest = max(capture_sizes, default=1)
        config = decoder.config
        reqs = largest if max_num_reqs is None else max_num_reqs
        tokens = max(largest, reqs * max_query_len) if max_num_tokens is None else max_num_tokens
        if largest > reqs or largest > tokens:
            raise ValueError(
                f"largest capture size {largest} needs max_num_reqs and max_num_tokens >= {largest}; "
                f"got {reqs} and {tokens}"
            )
        self.dispatcher = Dispatcher(
            capture_sizes,
            max_query_len=max_query_len,
            piecewise_sizes=schedule("pow2", tokens, clamp=True) if piecewise else None,
            max_num_reqs=reqs,
        )
        limits = InputLimits(
            max_num_reqs=reqs,
            max_num_tokens=tokens,
            max_blocks_per_req=config.max_blocks_per_req,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            vocab_size=config.vocab_size,
            num_adapters=config.num_adapters,
        )
        policy = PaddingPolicy(
            null_block=config.null_block,
            seq_len_fill=Decoder.SEQ_LEN_FILL,
            token_id=PAD_TOKEN,
            position=PAD_POSITION,
            slot=PAD_SLOT,
            adapter=PAD_ADAPTER,
        )
        self.inputs = StaticInputs(limits, policy, backend)
        self.memory_note: str | None = None
        self._memory = self._graph_memory(memory)
        self._graphs: dict[GraphKey, CapturedStep] = {}
        self._failed: dict[GraphKey, str] = {}
        self._stats = StatsRecorder()
        self._closed = False
        self.coordinator: Coordinator | None = None
        if data_parallel is not None and data_parallel.world_size > 1:
            self.coordinator = Coordinator(data_parallel, self.dispatcher)

    @property
    def graphs(self) -> tuple[GraphKey, ...]:
        """Keys of the graphs captured and ready to replay."""
        return tuple(self._graphs)

    @property
    def failed(self) -> dict[GraphKey, str]:
        """Keys whose capture failed, with the error; their steps run eagerly."""
        return dict(self._failed)

    def step(self, batch: Batch) -> StepResult:
        """Run one step; raises ValueError (changing nothing) for a batch that cannot be staged.

        Interrupted anywhere (KeyboardInterrupt included), it leaves no new graph, pool view or
        step count behind: the step may be retried as if it never started. (A capture that failed
        with an error stays recorded: it would fail again.) The KV slots the step writes may hold
        partial values until then; they belong to no request's context yet.
        """
        self._check_open()
        if self.coordinator is None:
            self.inputs.check(batch)  # before routing: a bad batch has no meaningful route
            decision, captured, fresh = self._prepare(batch)
        else:
            if batch.requests:  # an idle rank steps with an empty batch
                self.inputs.check(batch)
            decision, captured, fresh = self._prepare_agreed(batch, self.coordinator)
        graph = captured if captured is not None else fresh
        n = batch.num_reqs
        try:
            if graph is not None:
                logits, next_tokens = graph.replay(n)
            elif decision.padded_reqs == 0:  # data parallel, and no rank has work: nothing runs
                logits, next_tokens = self._no_rows()
            else:
                run = self._step_fn(
                    decision.padded_reqs, decision.padded_tokens, uses_adapters(batch)
                )
                logits, next_tokens = run()
        except BaseException:
            if fresh is not None:
                # Its replay may be queued already, and must not outlive its graph and memory.
                try:
                    self.backend.current_stream().synchronize()
                finally:
                    self._release(fresh)
            raise
        # Bookkeeping only once the step is done, so an interrupted step counts nothing.
        if fresh is not None:
            self._keep(fresh)
        elif captured is not None:
            self._stats.hits += 1
        self.dispatcher.record(decision)
        self._stats.steps[decision.path] += 1
        if graph is None:
            if decision.cause is not None:
                self._stats.fallbacks[decision.cause] += 1
            return StepResult(logits[:n], next_tokens[:n], "eager", None, decision.reason)
        self._stats.replays[graph.key] += 1
        self._stats.graph_tokens += batch.num_tokens
        self._stats.padded_tokens += decision.padded_tokens
        return StepResult(logits, next_tokens, decision.path, graph.key, decision.reason)

    def _no_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = self.decoder.config.vocab_size
        logits = torch.empty(0, vocab, dtype=self.decoder.dtype, device=self.decoder.device)
        return logits, torch.empty(0, dtype=torch.int64, device=self.decoder.device)

    def _prepare(self, batch: Batch) -> tuple[Decision, CapturedStep | None, CapturedStep | None]:
        """Dispatch and stage `batch`: (decision, graph held already, graph captured now). A
        graph captured now is the caller's to keep once the step is done, or to release."""
        decision = self._route(batch)
        self.inputs.stage(batch, decision.padded_reqs, decision.padded_tokens)
        if decision.key is None:
            return decision, None, None
        captured = self._graphs.get(decision.key)
        if captured is not None:
            return decision, captured, None
        fresh = self._capture(decision.key, decision.padded_reqs)
        if fresh is None:
            decision = self._route(batch)
        return decision, None, fresh

    def _prepare_agreed(
        self, batch: Batch, coordinator: Coordinator
    ) -> tuple[Decision, CapturedStep | None, CapturedStep | None]:
        """`_prepare` for a data-parallel rank: the path and shape are agreed with every rank,
        and so is the outcome of a capture, so a key failed anywhere is failed everywhere."""
        failed = self._failed
        decision = coordinator.decide(batch, tuple(failed), len(self._graphs) + len(failed))
        while True:
            self.inputs.stage(batch, decision.padded_reqs, decision.padded_tokens)
            if decision.key is None:
                return decision, None, None
            captured = self._graphs.get(decision.key)
            if captured is not None:
                return decision, captured, None
            fresh = self._capture(decision.key, decision.padded_reqs)
            try:
                failed_on = coordinator.failed_ranks(fresh is not None)
            except BaseException:  # interrupted in the collective: the step never happened
                if fresh is not None:
                    self._release(fresh)
                raise
            if not failed_on:
                return decision, None, fresh
            if fresh is not None:
                self._release(fresh)
                failed[fresh.key] = f"capture of {fresh.key} failed on ranks {failed_on}"
            decision = coordinator.again(batch, tuple(failed))

    def capture_all(self, query_lens: Iterable[int] | None = None) -> None:
        """Capture every FULL decode graph ahead of time, largest first, so smaller graphs reuse
        the pool blocks of larger ones. `query_lens` defaults to 1 and `max_query_len`; graphs
        with adapters are captured too when the decoder has adapters. Failures are recorded
        (see `failed`) and those keys run eagerly."""
        self._check_open()
        lens = sorted({1, self.dispatcher.max_query_len} if query_lens is None else set(query_lens))
        adapters = (False, True) if self.decoder.config.num_adapters else (False,)
        for key in self.dispatcher.full_keys(query_lens=lens, adapters=adapters):
            if key in self._graphs or key in self._failed:
                continue
            assert key.num_reqs is not None  # full keys always carry a request count
            self.inputs.stage(Batch(()), key.num_reqs, key.num_tokens)
            captured = self._capture(key, key.num_reqs)
            if captured is not None:
                self._keep(captured)

    def _graph_memory(self, strategy: str) -> GraphMemory:
        if strategy != "auto":
            return make_graph_memory(strategy, self.backend)
        try:
            return make_graph_memory("vmm", self.backend)
        except VmmUnsupportedError as unsupported:
            self.memory_note = (
                f"vmm graph memory unavailable ({unsupported.reason}): using one shared pool, "
                "captured largest first"
            )
            warnings.warn(self.memory_note, RuntimeWarning, stacklevel=3)
            return make_graph_memory("shared", self.backend)

    def invalidate(self, reason: str) -> None:
        """Drop every graph (and forget failed captures): call it when weights or configuration
        change. The next steps capture again."""
        for captured in self._graphs.values():
            self._release(captured)
        self._graphs.clear()
        self._failed.clear()
        self._stats.invalidations.append(reason)

    def stats(self) -> ExecutorStats:
        return self._stats.snapshot(pool_bytes=self._memory.stats().physical_bytes)

    def address_views(self) -> list[AddressView]:
        return self._memory.views()

    def close(self) -> None:
        """Release every graph and the graph memory; the executor cannot step afterwards."""
        if self._closed:
            return
        self.invalidate("executor closed")
        self._memory.close()
        self._closed = True

    def _route(self, batch: Batch) -> Decision:
        decision = self.dispatcher.decide(batch)
        if decision.key is None or decision.key not in self._failed:
            return decision
        return replace(
            decision,
            path="eager",
            key=None,
            reason=self._failed[decision.key],
            cause=CAPTURE_FAILED,
        )

    def _capture(self, key: GraphKey, padded_reqs: int) -> CapturedStep | None:
        """Capture `key` on the inputs staged now; on failure record the reason, return None.
        The graph is the caller's to `_keep` or `_release`."""
        captured: CapturedStep
        warm = not self._stats.captures  # see `warm_up`: once per executor, not per shape
        try:
            if key.mode == "piecewise":
                inputs = self.inputs.views(padded_reqs, key.num_tokens)
                sampling = self.inputs.sampling_views(padded_reqs)
                captured = capture_pieces(
                    self.backend, key, self.decoder, inputs, sampling, self._memory, warm=warm
                )
            else:
                run = self._step_fn(padded_reqs, key.num_tokens, key.adapters)
                captured = capture_full(self.backend, key, run, self._memory, warm=warm)
        except Exception as error:
            self._stats.failed_captures += 1
            self._failed[key] = f"capture of {key} failed: {type(error).__name__}: {error}"
            return None
        return captured

    def _keep(self, captured: CapturedStep) -> None:
        self._stats.captures += 1
        self._stats.capture_seconds += captured.seconds
        self._graphs[captured.key] = captured

    def _release(self, captured: CapturedStep) -> None:
        captured.reset()
        self._memory.discard(captured.key)

    def _step_fn(self, padded_reqs: int, padded_tokens: int, adapters: bool) -> StepFn:
        inputs = self.inputs.views(padded_reqs, padded_tokens)
        sampling = self.inputs.sampling_views(padded_reqs)
        decoder = self.decoder

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            logits = decoder.forward(inputs, use_adapters=adapters)
            next_tokens = sample(logits, sampling.seeds, sampling.temperatures, sampling.positions)
            return logits, next_tokens

        return run

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this GraphExecutor is closed; make a new one to run more steps")


def _normalised(device: torch.device | str) -> torch.device:
    """`device` with the index a bare "cuda" stands for (the current device), so "cuda" and
    "cuda:0" compare equal there; CPU devices compare equal whatever their index."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None and device.type == "cuda":
        # Without a GPU, "cuda" is the sim device, which is device 0.
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    return device
