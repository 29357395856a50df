"""Capturing one graph for a key: warm up eagerly (an executor's first capture only), then record
the step into the key's pool.

A FULL graph records the whole step, sampling included. A PIECEWISE graph records the decoder body
as pieces with attention run eagerly between them (`runtime.piecewise`); the logits gather and
sampling depend on the request rows and run eagerly after the last piece.

A capture either completes or leaves nothing behind: a failure resets the graph and releases the
key's pool view, and the caller gets the exception to record as the key's fallback reason. An
interrupt (KeyboardInterrupt, SystemExit) is cleaned up the same way and propagates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from pytest_graphmode.runtime.backends import Backend
from pytest_graphmode.runtime.buffers import SamplingInputs
from pytest_graphmode.runtime.keys import GraphKey
from pytest_graphmode.runtime.model import Decoder, DecoderInputs, sample
from pytest_graphmode.runtime.piecewise import PiecewiseGraph, capture_piecewise

StepFn = Callable[[], tuple[Tensor, Tensor]]
"""Runs one step on the static inputs: (logits [R, vocab], next_tokens [R])."""


class CapturedStep(Protocol):
    key: GraphKey
    seconds: float

    def replay(self, num_reqs: int) -> tuple[Tensor, Tensor]:
        """Run the step on the staged inputs; the first `num_reqs` rows, owned by the caller."""
        ...

    def reset(self) -> None: ...


@dataclass(eq=False)
class FullGraph:
    """One graph for the whole step and the static outputs it writes on every replay."""

    key: GraphKey
    graph: Any  # the backend's Graph
    logits: Tensor  # [R, vocab]; overwritten by the next replay, hence the copies
    next_tokens: Tensor  # [R]
    seconds: float

    def replay(self, num_reqs: int) -> tuple[Tensor, Tensor]:
        self.graph.replay()
        return self.logits[:num_reqs].clone(), self.next_tokens[:num_reqs].clone()

    def reset(self) -> None:
        self.graph.reset()


@dataclass(eq=False)
class PiecewiseStep:
    """Piecewise graph of the decoder body; logits and sampling run eagerly after it."""

    key: GraphKey
    pieces: PiecewiseGraph
    decoder: Decoder
    inputs: DecoderInputs
    sampling: SamplingInputs
    seconds: float

    def replay(self, num_reqs: int) -> tuple[Tensor, Tensor]:
        hidden = self.pieces.replay(self.inputs, self.decoder.kv_cache)  # [T, hidden]
        logits = self.decoder.logits(hidden, self.inputs)  # fresh: the caller may keep it
        s = self.sampling
        next_tokens = sample(logits, s.seeds, s.temperatures, s.positions)
        return logits[:num_reqs], next_tokens[:num_reqs]

    def reset(self) -> None:
        self.pieces.reset()


def warm_up(backend: Backend, run: Callable[[], object]) -> None:
    """Run the step eagerly once on a side stream, as PyTorch recommends before a capture, so
    lazy initialisation and workspace allocation happen outside the graph.

    What a warm-up initialises (library handles, the allocator's first blocks) is set up once per
    process and device, not once per shape, so the executor warms up before its first capture
    only: every later warm-up was one more eager step per captured shape, for nothing.

    It runs on the inputs staged now: a real batch when a step captures on first use. Its KV
    writes are exactly the ones the replay that follows repeats, so the step's result and the
    cache are the same as with one run."""
    side = backend.Stream()
    try:
        side.wait_stream(backend.current_stream())
        with backend.stream(side):
            run()
    finally:
        # Also when interrupted: whatever the side stream queued is ordered before later work.
        _join(backend, side)


def _join(backend: Backend, side: Any) -> None:
    """Make the current stream wait for everything `side` queued. Interrupted half way (the
    event recorded on `side`, not yet waited on), it joins again before the interrupt goes on."""
    current = backend.current_stream()
    try:
        current.wait_stream(side)
    except BaseException:
        current.wait_stream(side)
        raise


def capture_full(
    backend: Backend, key: GraphKey, run: StepFn, memory: Any, *, warm: bool = True
) -> FullGraph:
    """Warm up (unless `warm` is False), then capture `run` as the graph of `key`."""
    started = time.perf_counter()
    if warm:
        warm_up(backend, run)
    graph = backend.Graph()
    try:
        with backend.graph(graph, pool=memory.pool_for(key)):
            logits, next_tokens = run()
        memory.captured(key)
    except BaseException:
        graph.reset()
        _discard(memory, key)
        raise
    return FullGraph(key, graph, logits, next_tokens, time.perf_counter() - started)


def capture_pieces(
    backend: Backend,
    key: GraphKey,
    decoder: Decoder,
    inputs: DecoderInputs,
    sampling: SamplingInputs,
    memory: Any,
    *,
    warm: bool = True,
) -> PiecewiseStep:
    """Warm up (unless `warm` is False), then capture the decoder body on `inputs` as the
    piecewise graph of `key`."""
    started = time.perf_counter()
    if warm:
        warm_up(backend, lambda: decoder.forward(inputs, use_adapters=key.adapters))
    pieces: PiecewiseGraph | None = None
    try:
        pieces = capture_piecewise(
            backend,
            inputs,
            lambda attention: decoder.hidden(
                inputs, use_adapters=key.adapters, attention=attention
            ),
            decoder.attention,
            pool=memory.pool_for(key),
        )
        memory.captured(key)
    except BaseException:
        if pieces is not None:
            pieces.reset()
        _discard(memory, key)
        raise
    seconds = time.perf_counter() - started
    return PiecewiseStep(key, pieces, decoder, inputs, sampling, seconds)


def _discard(memory: Any, key: GraphKey) -> None:
    """Give back `key`'s pool view, if it got one: an interrupt can come before `pool_for`."""
    if memory.holds(key):
        memory.discard(key)
