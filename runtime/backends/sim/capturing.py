"""Capture and replay in the sim backend: a capture's beginning, end and abort, and a graph's
launch, queued as one piece of device work; the layer of `SimBackend` over its streams and
events (state.py). What a capture records and a replay runs is capture.py's."""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

import torch

from pytest_graphmode.runtime.backends.errors import CaptureError
from pytest_graphmode.runtime.backends.sim.capture import (
    KEEPS_CAPTURED_PINNED_BLOCKS,
    Capture,
    Program,
)
from pytest_graphmode.runtime.backends.sim.events import StreamsAndEvents
from pytest_graphmode.runtime.backends.sim.pool import SimCapturePool, SimPoolHandle
from pytest_graphmode.runtime.backends.sim.state import ActiveCapture
from pytest_graphmode.runtime.backends.sim.streams import SimEvent, new_work
from pytest_graphmode.runtime.backends.sim.threads import serialized

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.graphs import SimGraph

_ERROR_MODES = ("global", "thread_local", "relaxed")


class Capturing(StreamsAndEvents):
    """Stream capture into a `SimGraph`, and its replays."""

    @serialized
    def _begin_capture(self, graph: SimGraph, pool: Any, error_mode: str = "global") -> None:
        if not self.is_active:
            raise RuntimeError(
                "the sim backend is not active, so it cannot see the operations of a capture: "
                "capture inside `with backend.active():` (targets and the harness activate it)"
            )
        if self._active is not None:
            raise CaptureError("a capture is already in progress; captures cannot nest")
        origin = self._current
        if origin is self._default:
            raise CaptureError("capture must run on a non-default stream: use graph(g) or a Stream")
        if graph._program is not None:
            raise CaptureError(
                "this graph already holds a captured graph: reset() it or use a new Graph to capture "
                "again"
            )
        if error_mode not in _ERROR_MODES:
            raise ValueError(
                f"capture_error_mode={error_mode!r}: choose one of {', '.join(_ERROR_MODES)}"
            )
        handle = self._resolve_pool(pool)
        if isinstance(handle, SimPoolHandle):
            if handle.refuses_captures():
                raise RuntimeError(_released_pool(handle))
            handle.held_by(graph)
        self.scheduler.drain(origin)
        capture = Capture(handle, keeps_pinned=KEEPS_CAPTURED_PINNED_BLOCKS, memory=self.memory)
        self._active = ActiveCapture(
            graph,
            capture,
            origin,
            torch.initial_seed(),
            error_mode,
            threading.get_ident(),
            {origin: False},
            {origin: 0},
        )
        graph._program = None
        graph._pool = handle

    @serialized
    def _end_capture(self, graph: SimGraph) -> None:
        active = self._require_active(graph)
        self._active = None
        try:
            self._finish_capture(graph, active)
        except BaseException:
            _failed(graph)
            raise
        finally:
            active.capture.ended()

    def _finish_capture(self, graph: SimGraph, active: ActiveCapture) -> None:
        self._check_seed(active)
        if active.capture.invalid is not None:
            raise CaptureError(f"capture was invalidated: {active.capture.invalid}")
        unjoined = [
            s for s, pending in active.unjoined.items() if pending and s is not active.origin
        ]
        if unjoined:
            raise CaptureError(
                f"{len(unjoined)} stream(s) forked into the capture were not joined back before "
                "capture_end (cudaErrorStreamCaptureUnjoined): make the capturing stream "
                "wait_stream() on each side stream after its last work"
            )
        for race in active.capture.order.take_races():
            self._races.report(race)
        # Internal: instantiating the graph computes views of its own memory, which are no
        # scheduling points for queued work and no operations of the caller.
        graph._program = self._internal(active.capture.finish)

    @serialized
    def _abort_capture(self, graph: SimGraph) -> None:
        """End `graph`'s capture, if it is under way, keeping nothing of it. (A graph whose
        capture never began keeps what it holds: capture_begin refused it.)"""
        active = self._active
        if active is not None and active.graph is graph:
            self._active = None
            graph._program = None
            _failed(graph)
            active.capture.ended()

    def _require_active(self, graph: SimGraph) -> ActiveCapture:
        if self._active is None or self._active.graph is not graph:
            raise RuntimeError("capture_end() without a matching capture_begin() on this graph")
        return self._active

    @staticmethod
    def _resolve_pool(pool: Any) -> Any:
        if pool is None:
            return SimPoolHandle()
        if isinstance(pool, SimPoolHandle | SimCapturePool):
            return pool
        raise TypeError(
            f"pool={pool!r}: pass a handle from graph_pool_handle(), another graph's pool(), or an "
            "object with allocate(nbytes) and release(block)"
        )

    @serialized
    def _launch(self, program: Program) -> None:
        active = self.capturing_here()
        if active is not None:
            raise active.capture.fail("replaying a graph inside a capture is not supported by sim")
        previous = program.last_launch
        if previous is not None and previous.recorded_on is not self._current:
            # CUDA runs one launch of a graph at a time: a launch on another stream waits for the
            # last one (two different graphs run side by side).
            self.stream_wait_event(self._current, previous)
        # Internal: the check's own tensor operations are no scheduling points for queued work.
        storages = self._internal(program.live_storages)
        # Asynchronous, as on a GPU, even on the default stream: replay() returns before the graph
        # ran, so host writes to pinned memory it reads, and host reads of pinned memory it
        # writes, race with it until something waits for the stream.
        touched = []
        pinned_reads = False
        written: list[Any] = []  # pinned storages it writes
        pinned_now = self._pinned
        for ref, fp, write in program.accesses:
            storage = ref()
            if storage is not None:
                touched.append((storage, fp, write))
                if pinned_now and fp.storage in pinned_now:
                    if write:
                        written.append(storage)
                    else:
                        pinned_reads = True
        races = self._races
        agent = races.agent(self._current)
        accesses = races.access(agent, touched, "graph replay", keep=pinned_reads)
        self._note_uses(self._current, agent, touched, "graph replay")
        pinned = [storage for storage, _, _ in touched] if accesses else []
        watches = self._watch_pinned_reads(accesses, pinned)

        retired = self._retired_by(agent, written) if written else []
        draws = program.draws.reserve() if program.draws else None
        branches = program.branches
        order = branches.linear_extension(self.scheduler.rng) if branches else None
        replay = functools.partial(program.run, storages, draws, order)
        run = self._after_watches(watches, replay, retired)
        self.scheduler.enqueue(self._current, new_work(run, "graph replay"))
        launched = SimEvent()
        self.event_record(launched, self._current)
        program.last_launch = launched
        for event in program.external_events:  # where the graph records them: once it has run
            self.event_record(event, self._current)


def _failed(graph: SimGraph) -> None:
    """A capture that did not end keeps its use of the pool for good, as on CUDA."""
    if isinstance(graph._pool, SimPoolHandle):
        graph._pool.let_go(graph, failed=True)


def _released_pool(handle: SimPoolHandle) -> str:
    return (
        "it->second->use_count > 0 INTERNAL ASSERT FAILED (as CUDA's caching allocator reports "
        f"it): every graph captured into graph pool {handle.id} was reset or destroyed while an "
        "output of theirs is still alive, and torch keeps such a pool, refusing to share it, "
        "until its last block is freed. Capture the new graph before resetting the last one on "
        "this pool, drop the old graphs' outputs first, or take a new graph_pool_handle()"
    )
