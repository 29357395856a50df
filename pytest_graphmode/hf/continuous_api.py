"""transformers 5.0 to 5.3: the batch processor is built inside the generation loop.

These releases have no `ContinuousBatchingConfig` and no `_create_batch_processor`: the options are
`GenerationConfig` attributes and arguments of `init_continuous_batching`, and the manager builds
its paged cache, scheduler and batch processor only as its background generation loop starts. The
engine runs that loop on the calling thread with its stop already signalled, so it builds them,
finds nothing to do and ends. A step is then the batch processor's own: `prepare_next_batch` takes
a batch from its scheduler and stages it in static tensors, and `_generation_step` pads its sizes,
then captures the graph of those sizes, replays it or runs eagerly. The engine hands it the
caller's batch through `_OneBatch`, a scheduler standing in for transformers' own, so padding and
staging are transformers' code.

The cache is laid out as in the `paged_tensors` releases (`pytest_graphmode.hf.paged_tensors`):
one key and one value tensor per layer, slot-major, with two blocks after the allocatable ones.
Padding tokens read and write one slot, index -2 (the last but one of the second block), as up to
5.12.

Inside the range (`pytest_graphmode.hf.versions.SINCE`):

- 5.0 has no IO object: the batch processor holds the static tensors, and the next token of every
  query token (a request's is at its logits index). From 5.1 (`"io_object"`) an IO object holds
  them, and one token per request.
- 5.0 to 5.2 keep the graphs in a dict on the batch processor (`_LastLookup` remembers which one a
  step used; no dict means graphs off), pad by interval counts (`max // intervals` per interval),
  capture on a fresh stream that waits for the current one and replay on the current one; their
  scheduler hands out request states, and their padding `logits_indices` are -1. From 5.3
  (`"graph_store"`) the IO object keeps the graphs in an LRU store (`CudaGraphBuffer`) and runs
  the forward on a compute stream of its own, the padding options are interval sizes, and the
  scheduler hands out `FutureRequestState`s (without a query length).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from pytest_graphmode.hf.engine import EngineConfig, EngineRequest
from pytest_graphmode.hf.paged_tensors import PagedTensorsEngine
from pytest_graphmode.hf.versions import Layout, has


class _OneBatch:
    """Stands in for transformers' scheduler in one `prepare_next_batch`: it hands out the caller's
    batch (`requests`: `FutureRequestState`s from 5.3, the request `states` before) once it has
    checked the batch fits the budgets transformers asks it to keep."""

    def __init__(self, requests: list[Any], states: list[Any]) -> None:
        self.requests = requests
        self.states = states
        self.active_requests: dict[str, Any] = {}
        self.waiting_requests: dict[str, Any] = {}

    def clear_cancelled_requests(self) -> list[Any]:
        return []

    def has_pending_requests(self) -> bool:
        return True

    def schedule_batch(self, token_budget: int, cache_budget: int) -> list[Any]:
        num_q = sum(len(state.tokens_to_process) for state in self.states)
        kv_read = sum(state.position_offset for state in self.states)
        if num_q > token_budget or kv_read > cache_budget:
            raise ValueError(
                f"a batch of {num_q} query tokens reading {kv_read} cached ones is over "
                f"transformers' budgets ({token_budget} tokens, {cache_budget} cached)"
            )
        return self.requests  # the processor measures the batch and pads it itself


class _LastLookup(dict[Hashable, Any]):
    """The graph dict of transformers before 5.3, remembering the key it was last asked for or
    given (a dict does not say which graph a step replayed)."""

    last: Hashable = None

    def get(self, key: Hashable, default: Any = None) -> Any:
        self.last = key
        return super().get(key, default)

    def __setitem__(self, key: Hashable, graph: Any) -> None:
        self.last = key
        super().__setitem__(key, graph)


def _intervals(size: int, interval: int) -> int:
    """How many intervals of `interval` make `size`: transformers before 5.3 pads to multiples of
    `size // intervals`."""
    if size % interval:
        raise ValueError(
            f"transformers before 5.3 pads to a whole number of intervals: {interval} must divide "
            f"{size} (EngineConfig's q_padding must divide max_batch_tokens, and kv_padding the "
            "cache's tokens)"
        )
    return size // interval


class ContinuousApiEngine(PagedTensorsEngine):
    """`Engine` over transformers 5.0 to 5.3, whose batch processor is built by the generation
    loop and pads, captures and replays itself."""

    layout: Layout = "continuous_api"

    def _build(
        self, config: EngineConfig, *, seed: int, graphs: bool, device: torch.device
    ) -> None:
        from transformers import GenerationConfig

        attention, _ = self._attention(set())  # no ContinuousBatchingConfig to take options
        self._build_model(config, seed=seed, device=device, attention=attention)
        # Greedy, no EOS, no prefix sharing, as `Engine._build` (and synchronous from 5.3, the
        # first release that batches asynchronously).
        generation = GenerationConfig(
            do_sample=False,
            eos_token_id=-1,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_batch_tokens=config.max_batch_tokens,
            use_cuda_graph=graphs,
        )
        padding: dict[str, Any]
        if has(self.version, "graph_store"):
            padding = {
                "q_padding_interval_size": config.q_padding,
                "kv_padding_interval_size": config.kv_padding,
                "use_async_batching": False,
            }
        else:
            padding = {
                "num_q_padding_intervals": _intervals(config.max_batch_tokens, config.q_padding),
                "num_kv_padding_intervals": _intervals(config.max_position, config.kv_padding),
            }
        self._manager = self.model.init_continuous_batching(
            generation_config=generation, allow_block_sharing=False, **padding
        )
        # Run on this thread (the sim's drop-in is this thread's) with its stop already signalled,
        # the loop builds the cache and the batch processor, finds nothing to do and ends.
        self._manager.stop_event.set()
        self._manager._run_generation_loop()
        if self._manager.batch_processor is None:
            raise RuntimeError(
                f"transformers {self.version}'s generation loop built no batch processor (its "
                "error log above says why)"
            )
        self._processor = self._manager.batch_processor
        self._cache = self._processor.cache
        self._io = (
            self._processor.inputs_and_outputs
            if has(self.version, "io_object")
            else self._processor
        )
        self._order_streams()  # no warm-up ran: the first forward is the first step's
        if has(self.version, "graph_store"):
            self.graphs = bool(self._processor.use_cuda_graph)
        else:
            if self._processor._graphs is not None:
                self._processor._graphs = _LastLookup(self._processor._graphs)
            self.graphs = self._processor._graphs is not None  # no dict: graphs off
        self._check_layout()

    def _future(self, state: Any) -> Any:
        if not has(self.version, "graph_store"):
            return state  # its scheduler hands out the request states themselves
        from transformers.generation.continuous_batching.requests import FutureRequestState

        return FutureRequestState(state, True, 0)  # the query length is its tokens_to_process

    def _step(self, futures: list[Any], requests: Sequence[EngineRequest]) -> None:
        scheduler = self._processor.scheduler
        states = [f.state for f in futures] if has(self.version, "graph_store") else futures
        self._processor.scheduler = _OneBatch(futures, states)
        try:
            staged = self._processor.prepare_next_batch()
        finally:
            self._processor.scheduler = scheduler
        if not staged:
            raise RuntimeError(
                f"transformers {self.version} staged no batch for {len(requests)} requests"
            )
        self._manager._generation_step()

    def _tokens(self, num_requests: int) -> Tensor:
        if has(self.version, "io_object"):
            return self._io.output_ids[:num_requests].to(torch.int64)  # one row, no log probs
        # 5.0 keeps every query token's next token: a request's is at its logits index.
        return self._io.output_ids[self._io.logits_indices[:num_requests]].to(torch.int64)

    def _graph_store(self) -> Mapping[Hashable, Any]:
        if has(self.version, "graph_store"):
            return super()._graph_store()
        graphs: Mapping[Hashable, Any] | None = self._processor._graphs
        return {} if graphs is None else graphs  # None: graphs off

    def _graph_key(self) -> Hashable:
        if not has(self.version, "graph_store"):
            return self._processor._graphs.last
        # The graph transformers used last: its LRU store appends a graph it captures and moves
        # one it replays to the end.
        return next(reversed(self._io.graphs._storage))
