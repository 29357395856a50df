"""transformers' continuous-batching runner behind the target contract.

`make_target("graph", ...)` asks transformers for its CUDA graphs, `make_target("eager", ...)` turns
them off; made with the same seed, the twins hold the same random-weight Llama and a zeroed cache.
The harness is the scheduler: its requests and block ids go to transformers as they are, and
everything else (padding, graph keys, capture, replay, greedy sampling) is transformers' own.

Load it with `--graphmode-target=pytest_graphmode.hf.target:make_target`
(`make_ordered_target`: the same with transformers' stream race fixed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec
from pytest_graphmode.hf.continuous_api import ContinuousApiEngine
from pytest_graphmode.hf.engine import Engine, EngineConfig, EngineRequest
from pytest_graphmode.hf.paged_tensors import PagedTensorsEngine
from pytest_graphmode.hf.sector_cache import SectorCacheEngine
from pytest_graphmode.hf.versions import Layout, installed_layout
from pytest_graphmode.runtime import backends

# transformers samples from the global generator and has no adapters: requests stay greedy and
# on the base model. A query of several tokens after a context is one more varlen batch to it.
FEATURES = frozenset({"decode", "prefill", "spec_decode", "weight_update"})

# The engine for each cache layout (`pytest_graphmode.hf.versions` says which release has which).
ENGINES: dict[Layout, type[Engine]] = {
    "continuous_api": ContinuousApiEngine,
    "paged_tensors": PagedTensorsEngine,
    "sector_cache": SectorCacheEngine,
}


class HFTarget:
    """`GraphTarget` over one `Engine`: transformers' batch processor and model runner."""

    def __init__(
        self, mode: Literal["graph", "eager"], config: EngineConfig, *, seed: int, backend: str
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode={mode!r} must be 'graph' or 'eager'")
        self.mode = mode
        device = backends.get(backend).device
        # transformers decides on graphs from torch.cuda alone and calls torch.cuda itself: on sim
        # the target lives in the drop-in, so it sees the simulated GPU and captures and replays
        # its graphs there, on a host with a GPU or without one. close() leaves it.
        self._scope = backends.target_scope(backend)
        self._scope.__enter__()
        try:
            engine = ENGINES[installed_layout()]
            self.engine = engine(config, seed=seed, graphs=mode == "graph", device=device)
        except BaseException:
            self._scope.__exit__(None, None, None)
            raise
        # transformers' two trash blocks are blocks of its cache like the others (after its own
        # up to 5.17, before them from 5.18): the write trash is the null block. The read trash
        # may be handed to a request: padding reads it under a mask, which needs it finite, as
        # written KV is.
        self.spec = TargetSpec(
            num_blocks=config.num_blocks + 2,
            block_size=config.block_size,
            max_blocks_per_req=_blocks_per_request(config),
            vocab_size=config.vocab_size,
            max_num_reqs=config.max_requests,
            max_num_tokens=config.max_batch_tokens,
            capture_sizes=tuple(
                range(config.q_padding, config.max_batch_tokens + 1, config.q_padding)
            ),
            features=FEATURES,
            null_block=self.engine.write_trash_block,
        )
        self._closed = False

    def step(self, batch: Batch) -> StepResult:
        out = self.engine.run(
            [EngineRequest(r.req_id, r.tokens, r.context_len, r.block_ids) for r in batch.requests]
        )
        if out.graph_key is not None and not out.captured:
            return StepResult(out.logits, out.tokens, path="full", graph_key=out.graph_key)
        if out.graph_key is not None:
            reason: str | None = (
                f"captured the graph keyed {out.graph_key}: transformers returns the results of "
                "the eager run it makes before a capture"
            )
        else:
            reason = self._eager_reason()
        return StepResult(out.logits, out.tokens, path="eager", graph_key=None, reason=reason)

    def _eager_reason(self) -> str | None:
        if self.mode == "eager":
            return None
        if not self.engine.graphs:
            return "transformers switched its CUDA graphs off: torch.cuda.is_available() is False"
        return "transformers ran this batch without a graph"

    def state(self) -> Mapping[str, Tensor]:
        tensors = self.engine.kv_tensors()
        return {
            f"{kind}{layer}": tensor
            for layer in range(len(tensors) // 2)
            for kind, tensor in (("k", tensors[2 * layer]), ("v", tensors[2 * layer + 1]))
        }

    def static_buffers(self) -> Mapping[str, Tensor]:
        # transformers resets only the extent the previous batch used before it stages the next
        # one: its staging tensors are not rewritten whole every step, which is what the harness's
        # poisoning assumes of the buffers named here (docs/targets-hf.md).
        return {}

    def address_views(self) -> Sequence[AddressView]:
        return []  # transformers' graph pool does not expose its addresses

    def update_weights(self, seed: int) -> None:
        if self._closed:
            raise RuntimeError("this target is closed; make a new one to load other weights")
        self.engine.load_weights(seed)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.engine.close()
            finally:
                self._scope.__exit__(None, None, None)


def _blocks_per_request(config: EngineConfig) -> int:
    # transformers pads a batch's KV read up to its num_blocks pages and no further (its own
    # scheduler keeps within that budget): a full batch of the longest requests must fit in it.
    return config.num_blocks // config.max_requests


def make_target(
    mode: Literal["graph", "eager"],
    *,
    seed: int,
    backend: str = "auto",
    config: EngineConfig | None = None,
) -> HFTarget:
    """transformers' continuous batching on a tiny random-weight Llama (`EngineConfig()`)."""
    return HFTarget(mode, EngineConfig() if config is None else config, seed=seed, backend=backend)


def make_ordered_target(
    mode: Literal["graph", "eager"],
    *,
    seed: int,
    backend: str = "auto",
    config: EngineConfig | None = None,
) -> HFTarget:
    """`make_target` with transformers' compute stream waiting for the stream its inputs are
    staged on (`EngineConfig.order_streams`): the release as it would be with its stream race
    fixed, to check that the race is all the harness finds from 5.13 on."""
    ordered = dataclasses.replace(EngineConfig() if config is None else config, order_streams=True)
    return HFTarget(mode, ordered, seed=seed, backend=backend)
