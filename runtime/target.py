"""The default target: the reference decoder run by the graph executor, behind the contract.

`make_target("graph", ...)` and `make_target("eager", ...)` made with the same seed are twins: same
weights, same KV cache, same staging of inputs; the graph twin replays FULL graphs where the
dispatcher allows, the eager twin never captures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec
from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.backends import Backend
from pytest_graphmode.runtime.buckets import schedule
from pytest_graphmode.runtime.data_parallel import DataParallel, current
from pytest_graphmode.runtime.executor import GraphExecutor
from pytest_graphmode.runtime.model import Decoder, DecoderConfig


class RuntimeTarget:
    """`GraphTarget` over a `Decoder` and a `GraphExecutor`."""

    def __init__(
        self,
        mode: Literal["graph", "eager"],
        config: DecoderConfig,
        *,
        seed: int,
        backend: Backend,
        capture_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_tokens: int,
        max_query_len: int,
        memory: str,
        piecewise: bool,
        data_parallel: DataParallel | None = None,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode={mode!r} must be 'graph' or 'eager'")
        if max_num_reqs > config.num_blocks - 1:
            raise ValueError(
                f"max_num_reqs={max_num_reqs} exceeds the {config.num_blocks - 1} blocks besides the "
                "null block: every request needs a block of its own"
            )
        features = {"decode", "prefill", "sampling", "weight_update"}
        if max_query_len > 1:
            features.add("spec_decode")
        if config.num_adapters:
            features.add("adapters")
        self.mode = mode
        self.spec = TargetSpec(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_blocks_per_req=config.max_blocks_per_req,
            vocab_size=config.vocab_size,
            max_num_reqs=max_num_reqs,
            max_num_tokens=max_num_tokens,
            capture_sizes=tuple(capture_sizes),
            features=frozenset(features),
            null_block=config.null_block,
            num_adapters=config.num_adapters,
        )
        # The backend is active (on sim: torch is routed through it) from here until close().
        self.backend = backend
        self._closed = False
        backend.activate()
        try:
            self.decoder = Decoder(config, seed=seed, device=backend.device)
            self.executor = GraphExecutor(
                self.decoder,
                backend,
                capture_sizes=capture_sizes if mode == "graph" else (),
                max_query_len=max_query_len,
                memory=memory,
                piecewise=piecewise and mode == "graph",
                max_num_reqs=max_num_reqs,
                max_num_tokens=max_num_tokens,
                data_parallel=data_parallel,
            )
        except BaseException:
            backend.deactivate()
            raise

    def step(self, batch: Batch) -> StepResult:
        return self.executor.step(batch)

    def state(self) -> Mapping[str, Tensor]:
        return {"kv_cache": self.decoder.kv_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        # The eager twin's buffers are staging, not graph inputs: the contract says `{}`, so the
        # harness poisons only what graphs read.
        return self.executor.inputs.tensors() if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return self.executor.address_views()

    def update_weights(self, seed: int) -> None:
        if self.executor.closed:
            raise RuntimeError("this target is closed; make a new one to load other weights")
        # The weights are rewritten in place, as an engine syncing weights from a trainer does, so
        # the captured graphs read the new values at the addresses they captured: keeping them
        # saves a recapture of every graph. Should a weight ever move, or change dtype or shape,
        # the graphs would read the old tensor: then they are dropped.
        before = _weight_layout(self.decoder.weights())
        self.decoder.load_weights(seed)
        moved = sorted(
            name
            for name, layout in _weight_layout(self.decoder.weights()).items()
            if before.get(name) != layout
        )
        if moved:
            self.executor.invalidate(f"weights replaced by seed {seed} moved: {', '.join(moved)}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.executor.close()
        finally:
            self.backend.deactivate()


def _weight_layout(weights: Mapping[str, Tensor]) -> dict[str, tuple[object, ...]]:
    """What a captured graph depends on of each weight: where it lives and how it is laid out."""
    return {
        name: (w.data_ptr(), w.dtype, tuple(w.shape), w.stride()) for name, w in weights.items()
    }


def make_target(
    mode: Literal["graph", "eager"],
    *,
    seed: int,
    backend: str = "auto",
    config: DecoderConfig | None = None,
    capture_sizes: Sequence[int] | None = None,
    max_num_reqs: int = 32,
    max_num_tokens: int = 128,
    max_query_len: int = 4,
    memory: str = "auto",
    piecewise: bool = True,
) -> RuntimeTarget:
    """The default target on `backend` ("sim" | "cuda" | "auto").

    Defaults suit `DecoderConfig.tiny()`: FULL graphs for 1..16 requests (`schedule("vllm", 16)`),
    speculative decoding up to 3 draft tokens (query length 4), and room for eager batches of up to
    32 requests and 128 tokens above the largest graph. With `piecewise`, batches no FULL graph
    serves (prefill, mixed, oversized) replay piecewise graphs instead of running eagerly.
    Made inside `runtime.data_parallel.joined(member)`, the target coordinates every step with the
    other ranks of `member`'s group.
    """
    config = DecoderConfig.tiny() if config is None else config
    sizes = schedule("vllm", 16) if capture_sizes is None else list(capture_sizes)
    return RuntimeTarget(
        mode,
        config,
        seed=seed,
        backend=backends.get(backend),
        capture_sizes=sizes,
        max_num_reqs=max_num_reqs,
        max_num_tokens=max_num_tokens,
        max_query_len=max_query_len,
        memory=memory,
        piecewise=piecewise,
        data_parallel=current(),
    )
