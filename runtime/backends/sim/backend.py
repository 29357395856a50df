"""The sim backend: torch.cuda's graph and stream API on the CPU, with CUDA's failure modes.

Every ATen operation of the process passes through one dispatch mode, installed when the backend is
first created. Outside a capture, operations on the default stream run at once (after the work queued
before them on that stream); work on other streams and `non_blocking` copies to or from pinned memory
are queued and run by the seeded scheduler. Inside a capture, operations on the capturing streams are
recorded, not computed. Host-side operations on pinned memory always run at once, as host code does.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_graphmode.runtime.backends.errors import CaptureError, UseAfterFreeError
from pytest_graphmode.runtime.backends.sim import ops
from pytest_graphmode.runtime.backends.sim.capture import Capture, Program
from pytest_graphmode.runtime.backends.sim.pool import SimCapturePool, SimPoolHandle, poison_
from pytest_graphmode.runtime.backends.sim.streams import (
    SimEvent,
    SimStream,
    StreamScheduler,
    new_marker,
    new_wait,
    new_work,
)

_BACKEND: SimBackend | None = None


def current_backend() -> SimBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = SimBackend(seed=int(os.environ.get("GRAPHMODE_SIM_SEED", "0")))
    return _BACKEND


class _SimMode(TorchDispatchMode):
    def __init__(self, backend: SimBackend) -> None:
        super().__init__()
        self.backend = backend

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return self.backend._dispatch(func, args, kwargs or {})


@dataclass(eq=False)
class _Active:
    graph: SimGraph
    capture: Capture
    origin: SimStream
    # member stream -> whether it has work not yet joined back into the origin
    unjoined: dict[SimStream, bool] = field(default_factory=dict)
    ops_on: dict[SimStream, int] = field(default_factory=dict)


def _tensors(args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, list | tuple):
            found.extend(i for i in x if isinstance(i, torch.Tensor))
    return found


class SimGraph:
    """Shaped like torch.cuda.CUDAGraph."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._backend = current_backend()
        self._program: Program | None = None
        self._pool: Any = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self._backend._begin_capture(self, pool)

    def capture_end(self) -> None:
        self._backend._end_capture(self)

    def replay(self) -> None:
        if self._program is None:
            raise RuntimeError("replay() of a graph that was never captured, or was reset")
        self._backend._launch(self._program)

    def reset(self) -> None:
        self._program = None

    def pool(self) -> Any:
        if self._pool is None:
            raise RuntimeError("pool() of a graph that was never captured")
        return self._pool


class SimBackend:
    """CPU stand-in for torch.cuda's graph API. One per process: the dispatch mode is global."""

    name = "sim"
    device = torch.device("cpu")
    CaptureError = CaptureError
    UseAfterFreeError = UseAfterFreeError
    Graph = SimGraph
    Stream = SimStream
    Event = SimEvent

    def __init__(self, seed: int = 0) -> None:
        global _BACKEND
        _BACKEND = self
        self.scheduler = StreamScheduler(seed)
        self._default = SimStream(_backend=self)
        self._current = self._default
        self._capture_stream = SimStream(_backend=self)
        self._active: _Active | None = None
        self._passthrough = 0
        self._pinned: set[int] = set()
        self._mode = _SimMode(self)
        self._mode.__enter__()
        _patch_tolist(self)

    # -- the torch.cuda surface ----------------------------------------------------------------

    def set_scheduler_seed(self, seed: int) -> None:
        """Choose the order in which independent streams' queued work runs."""
        self.scheduler.set_seed(seed)

    def current_stream(self) -> SimStream:
        return self._current

    def default_stream(self) -> SimStream:
        return self._default

    @contextmanager
    def stream(self, s: SimStream | None) -> Iterator[SimStream | None]:
        if s is None:
            yield None
            return
        previous, self._current = self._current, s
        try:
            yield s
        finally:
            self._current = previous

    def synchronize(self) -> None:
        self._forbid_in_capture("synchronize()")
        self.scheduler.drain_all()

    def graph_pool_handle(self) -> SimPoolHandle:
        return SimPoolHandle()

    @contextmanager
    def graph(
        self,
        cuda_graph: SimGraph,
        pool: Any = None,
        stream: SimStream | None = None,
        capture_error_mode: str = "global",
    ) -> Iterator[SimGraph]:
        self.synchronize()
        with self.stream(stream if stream is not None else self._capture_stream):
            cuda_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            try:
                yield cuda_graph
            except BaseException:
                self._abort_capture(cuda_graph)
                raise
            cuda_graph.capture_end()

    def empty_pinned(
        self, size: int | tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Host memory that the scheduler treats as pinned: async copies read it when they run."""
        self._passthrough += 1
        try:
            t = torch.empty(size, dtype=dtype)
        finally:
            self._passthrough -= 1
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        self._pinned.add(ptr)
        weakref.finalize(storage, self._pinned.discard, ptr)
        return t

    # -- streams and events --------------------------------------------------------------------

    def stream_wait_event(self, stream: SimStream, event: SimEvent) -> None:
        active = self._active
        if active is not None and event.capture_position is not None:
            owner, position = event.capture_position
            if owner is active:
                if stream not in active.unjoined:
                    active.unjoined[stream] = True  # forked into the capture
                    active.ops_on[stream] = 0
                elif event.recorded_on is not None and position == active.ops_on.get(
                    event.recorded_on
                ):
                    active.unjoined[event.recorded_on] = False
                return
        marker = event.marker
        if marker is None or marker.done:
            return
        if active is not None and stream in active.unjoined:
            raise active.capture.fail(
                "a capturing stream waited on an event recorded outside the capture that has not "
                "completed yet; synchronize before capturing"
            )
        self.scheduler.enqueue(stream, new_wait(marker))

    def event_record(self, event: SimEvent, stream: SimStream | None) -> None:
        stream = stream or self._current
        event.recorded_on = stream
        active = self._active
        if active is not None and stream in active.unjoined:
            event.capture_position = (active, active.ops_on[stream])
            event.marker = None
            return
        event.capture_position = None
        event.marker = new_marker(event)
        self.scheduler.enqueue(stream, event.marker)

    def event_query(self, event: SimEvent) -> bool:
        self._forbid_in_capture("Event.query()")
        self.scheduler.maybe_progress()
        return event.marker is None or event.marker.done

    def event_synchronize(self, event: SimEvent) -> None:
        self._forbid_in_capture("Event.synchronize()")
        if event.marker is not None:
            self.scheduler.run_until(event.marker)

    def stream_query(self, stream: SimStream) -> bool:
        self._forbid_in_capture("Stream.query()")
        self.scheduler.maybe_progress()
        return not self.scheduler.has_work(stream)

    def stream_synchronize(self, stream: SimStream) -> None:
        self._forbid_in_capture("Stream.synchronize()")
        self.scheduler.drain(stream)

    def host_read(self, what: str) -> None:
        """The host is about to read device memory: in a capture that is illegal, else it waits."""
        active = self._active
        if active is not None and self._current in active.unjoined:
            raise active.capture.fail(
                f"{what} cannot be captured: a host read of a device value. Move it out of the "
                "capture region, or keep the value on the device."
            )
        self.scheduler.drain(self._current)

    def _forbid_in_capture(self, what: str) -> None:
        if self._active is not None:
            raise self._active.capture.fail(
                f"{what} during a capture: synchronizing is not allowed while a stream is capturing"
            )

    # -- capture ---------------------------------------------------------------------------------

    def _begin_capture(self, graph: SimGraph, pool: Any) -> None:
        if self._active is not None:
            raise CaptureError("a capture is already in progress; captures cannot nest")
        origin = self._current
        if origin is self._default:
            raise CaptureError("capture must run on a non-default stream: use graph(g) or a Stream")
        handle = self._resolve_pool(pool)
        self.scheduler.drain(origin)
        capture = Capture(handle, _release_block)
        self._active = _Active(graph, capture, origin, {origin: False}, {origin: 0})
        graph._program = None
        graph._pool = handle

    def _end_capture(self, graph: SimGraph) -> None:
        active = self._require_active(graph)
        self._active = None
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
        graph._program = active.capture.finish()

    def _abort_capture(self, graph: SimGraph) -> None:
        if self._active is not None and self._active.graph is graph:
            self._active = None
        graph._program = None

    def _require_active(self, graph: SimGraph) -> _Active:
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

    def _launch(self, program: Program) -> None:
        active = self._active
        if active is not None and self._current in active.unjoined:
            raise active.capture.fail("replaying a graph inside a capture is not supported by sim")
        # Internal: the check's own tensor operations are no scheduling points for queued work.
        self._internal(program.check_alive)
        self._submit(self._current, program.run, "graph replay")

    # -- dispatch ------------------------------------------------------------------------------

    def _submit(self, stream: SimStream, run: Callable[[], None], label: str) -> None:
        """Device work: at once on the default stream (after what it queued), queued elsewhere."""
        if stream is self._default:
            self.scheduler.drain(stream)
            self._internal(run)
        else:
            self.scheduler.enqueue(stream, new_work(lambda: self._internal(run), label, None))

    def _internal(self, run: Callable[[], Any]) -> Any:
        self._passthrough += 1
        try:
            return run()
        finally:
            self._passthrough -= 1

    def _is_pinned(self, t: torch.Tensor) -> bool:
        return bool(self._pinned) and t.untyped_storage().data_ptr() in self._pinned

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._passthrough:
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        pinned = [self._is_pinned(t) for t in tensors]
        if tensors and all(pinned):
            self.scheduler.maybe_progress()  # the device keeps working while the host does
            return func(*args, **kwargs)  # host code on host memory
        stream = self._current
        active = self._active
        if active is not None:
            if stream not in active.unjoined:
                return func(*args, **kwargs)  # not part of the capture: runs at once
            active.ops_on[stream] += 1
            if stream is not active.origin:
                active.unjoined[stream] = True
            return active.capture.record(func, args, kwargs)
        self.scheduler.maybe_progress()
        if func is ops.aten.copy_.default and any(pinned):
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            dst, src = args[0], args[1]
            if non_blocking:
                work = new_work(
                    lambda: self._internal(lambda: dst.copy_(src)), "async copy", _storages([dst])
                )
                self.scheduler.enqueue(stream, work)
                return dst
            if self.scheduler.writes_pending(stream, _storage(src)):
                # A blocking read of device memory waits for the work that writes it.
                self.scheduler.drain(stream)
            # Otherwise a host memcpy: it does not wait for the device (queued copies still
            # reading a pinned source then see the new contents, as on a GPU).
            return func(*args, **kwargs)
        if ops.capture_violation(func, args, kwargs) is not None:
            self.scheduler.drain(stream)
            return func(*args, **kwargs)
        if stream is self._default:
            self.scheduler.drain(stream)
            return func(*args, **kwargs)
        return self._defer(stream, func, args, kwargs)

    def _defer(
        self, stream: SimStream, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Queue an operation on a side stream; its fresh outputs are poison until it runs."""
        if ops.is_view(func) or func in ops.EMPTY_OPS:
            return func(*args, **kwargs)  # metadata or allocation only: nothing to order
        positions = ops.fresh_return_positions(func)
        metas = ops.meta_outputs(func, args, kwargs) if positions else []
        fresh = {}
        for p in positions:
            out = torch.empty_strided(metas[p].shape, metas[p].stride(), dtype=metas[p].dtype)
            poison_(out)
            fresh[p] = out

        def run() -> None:
            result = func(*args, **kwargs)
            results = result if isinstance(result, tuple | list) else [result]
            for p, out in fresh.items():
                out.copy_(results[p])

        written = [*fresh.values(), *ops.written_args(func, args, kwargs)]
        work = new_work(lambda: self._internal(run), ops.op_name(func), _storages(written))
        self.scheduler.enqueue(stream, work)
        return ops.assemble_returns(func, args, kwargs, fresh)


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _storages(tensors: list[torch.Tensor]) -> frozenset[int]:
    return frozenset(_storage(t) for t in tensors)


def _release_block(pool: Any, block: torch.Tensor) -> None:
    pool.release(block)


def _patch_tolist(backend: SimBackend) -> None:
    """`Tensor.tolist` reads memory without passing through the dispatcher: make it a host read."""
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        if not backend._passthrough:
            backend.host_read("Tensor.tolist()")
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
