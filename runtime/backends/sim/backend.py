"""The sim backend: torch.cuda's graph and stream API on the CPU, with CUDA's failure modes.

While the backend is active (`with backend.active():`, or `activate()` / `deactivate()`, counted so
that nested users compose), every ATen operation of the process passes through one dispatch mode and
`Tensor.tolist` is a host read; when the last user deactivates it, torch is restored exactly. Outside
a capture, operations on the default stream run at once (after the work queued
before them on that stream); work on other streams and `non_blocking` copies to or from pinned memory
are queued and run by the seeded scheduler, and so is every graph replay, even on the default stream
(replay is asynchronous, as on a GPU). Inside a capture, operations on the capturing streams are
recorded, not computed. Host-side operations on pinned memory always run at once, as host code does.
Every operation is also judged, when it is issued, by the happens-before race checker
(happens_before.py): `take_races()` hands over the races it found.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from pytest_graphmode.runtime.backends.errors import CaptureError, UseAfterFreeError
from pytest_graphmode.runtime.backends.race import Race
from pytest_graphmode.runtime.backends.sim import footprint, ops
from pytest_graphmode.runtime.backends.sim.capture import (
    KEEPS_CAPTURED_PINNED_BLOCKS,
    Capture,
    Program,
    keep_bases_of_views,
    patch_custom_op_alias_check,
)
from pytest_graphmode.runtime.backends.sim.device import (
    SIM_DEVICE,
    SIM_MEMORY,
    SimDeviceTensor,
    mark_device,
    patch_parameter_new,
)
from pytest_graphmode.runtime.backends.sim.device_mode import DeviceMode
from pytest_graphmode.runtime.backends.sim.frees import StreamOrderedFrees
from pytest_graphmode.runtime.backends.sim.generators import is_device_generator
from pytest_graphmode.runtime.backends.sim.happens_before import HOST, RaceChecker, Touch
from pytest_graphmode.runtime.backends.sim.limits import (
    SimUnsupportedError,
    check_kernel_dtypes,
    check_runnable,
)
from pytest_graphmode.runtime.backends.sim.ops import OpFacts
from pytest_graphmode.runtime.backends.sim.pool import SimCapturePool, SimPoolHandle, poison_
from pytest_graphmode.runtime.backends.sim.streams import (
    SimEvent,
    SimStream,
    StreamScheduler,
    new_marker,
    new_wait,
    new_work,
)
from pytest_graphmode.runtime.backends.sim.threads import (
    SimThreads,
    ThreadStreams,
    follow_new_threads,
    serialized,
)

_BACKEND: SimBackend | None = None
# Where a runner's own operator has its host kernel (`SimBackend._dispatch`)
_HOST_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_ERROR_MODES = ("global", "thread_local", "relaxed")


def current_backend() -> SimBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = SimBackend(seed=int(os.environ.get("GRAPHMODE_SIM_SEED", "0")))
    return _BACKEND


class _SimMode(TorchDispatchMode):
    # torch wraps __torch_dispatch__ in a guard that keeps torch.compile out of the frames below
    # it. Turning the guard off (`_should_skip_dynamo`) saves a frame per operation in a
    # microbenchmark but made whole campaigns 2.5x slower (H200 host, 5 examples x 8 steps):
    # keep it.
    def __init__(self, backend: SimBackend, device_mode: DeviceMode) -> None:
        super().__init__()
        self.backend = backend
        # The function mode entered with this one, in this thread (`SimBackend._dispatch`)
        self.device_mode = device_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # The sim's own tensor calls below are no calls of the program: the device mode (a
        # torch function mode, still on its stack here) need not see them.
        backend = self.backend
        with torch._C.DisableTorchFunction():
            if backend.threads.alive:
                with backend.threads.lock:
                    return backend._dispatch(func, args, kwargs or {}, self)
            return backend._dispatch(func, args, kwargs or {}, self)


class FollowerSimMode(_SimMode):
    """The sim's dispatch mode in a thread the sim started (threads.py): it passes every
    operation through while the sim is not active."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not self.backend.is_active:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclass(eq=False)
class _Active:
    graph: SimGraph
    capture: Capture
    origin: SimStream
    # the global generator's seed at capture_begin: CUDA refuses manual_seed(other) in a capture
    seed: int
    # "global" / "thread_local": allocating outside the capture is refused; "relaxed": allowed
    error_mode: str
    # member stream -> whether it has work not yet joined back into the origin
    unjoined: dict[SimStream, bool] = field(default_factory=dict)
    ops_on: dict[SimStream, int] = field(default_factory=dict)


def _tensors(args: Any, kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensor arguments of a call (lists flattened), and those of them on the host."""
    found: list[torch.Tensor] = []
    host: list[torch.Tensor] = []
    for x in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(x, torch.Tensor):
            found.append(x)
            if not isinstance(x, SimDeviceTensor):
                host.append(x)
        elif isinstance(x, list | tuple):
            for i in x:
                if isinstance(i, torch.Tensor):
                    found.append(i)
                    if not isinstance(i, SimDeviceTensor):
                        host.append(i)
    return found, host


class SimGraph:
    """Shaped like torch.cuda.CUDAGraph."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._backend = current_backend()
        self._program: Program | None = None
        self._pool: Any = None
        # generators besides the default whose draws this graph may capture
        self._generators: list[Any] = []

    def register_generator_state(self, generator: Any) -> None:
        """Let this graph's captures draw from `generator`, a device generator: each replay
        advances it and draws what its seed and offset give then (generators.py)."""
        if not is_device_generator(generator):
            raise RuntimeError(
                f"register_generator_state takes a device generator (torch.Generator(device="
                f"'cuda')); got one for {generator.device}"
            )
        if not self.draws_from(generator):
            self._generators.append(generator)

    def draws_from(self, generator: Any) -> bool:
        """Whether `generator` is registered with this graph."""
        return any(generator is g for g in self._generators)

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self._backend._begin_capture(self, pool, capture_error_mode)

    def capture_end(self) -> None:
        self._backend._end_capture(self)

    def replay(self) -> None:
        if self._program is None:
            raise RuntimeError("replay() of a graph that was never captured, or was reset")
        self._backend._launch(self._program)

    def reset(self) -> None:
        # As CUDA's: the graph lets go of its pool, and pool() has nothing to share until the
        # next capture.
        self._program = None
        self._pool = None

    def instantiate(self) -> None:
        """A sim graph is ready to replay when its capture ends (CUDA instantiates a
        `keep_graph=True` graph here, or at its first replay)."""
        if self._program is None:
            raise RuntimeError("instantiate() of a graph that was never captured, or was reset")

    def enable_debug_mode(self) -> None:
        """Nothing to keep: the sim's graph is its recorded program."""

    def debug_dump(self, debug_path: str) -> None:
        raise SimUnsupportedError(
            "CUDAGraph.debug_dump (a CUDA driver graph, which the sim has not)"
        )

    def raw_cuda_graph(self) -> Any:
        raise SimUnsupportedError("CUDAGraph.raw_cuda_graph (a CUDA driver graph handle)")

    def raw_cuda_graph_exec(self) -> Any:
        raise SimUnsupportedError("CUDAGraph.raw_cuda_graph_exec (a CUDA driver graph handle)")

    def get_graph_data(self) -> Any:
        raise SimUnsupportedError("CUDAGraph.get_graph_data (a CUDA driver graph's nodes)")

    def pool(self) -> Any:
        if self._pool is None:
            raise RuntimeError("pool() of a graph that was never captured, or was reset")
        return self._pool


class SimBackend:
    """CPU stand-in for torch.cuda's graph API. One per process: its dispatch mode, while active,
    sees every operation of the process."""

    name = "sim"
    device = SIM_DEVICE
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
        self._streams = ThreadStreams()
        self.threads = SimThreads()
        self._restores: list[Callable[[], None]] = []
        self._capture_stream = SimStream(_backend=self)
        self._active: _Active | None = None
        self._passthrough = 0
        self._pinned: set[int] = set()
        self._activations = 0
        self._mode: _SimMode | None = None
        self._device_mode: DeviceMode | None = None
        # Where the factory call being dispatched puts its result (True: the device), set by the
        # device mode for calls that name a device; None: decided by the operation's arguments.
        self._placing: bool | None = None
        self._races = RaceChecker()
        self._frees = StreamOrderedFrees(
            self._races, self._races.agent(self._default), self._pinned
        )

    # -- activation ----------------------------------------------------------------------------

    @property
    def is_active(self) -> bool:
        return self._activations > 0

    @serialized
    def activate(self) -> None:
        """Route torch through the sim until the matching `deactivate()`; calls nest."""
        if self._activations == 0:
            device_mode = DeviceMode(self)
            device_mode.__enter__()
            self._device_mode = device_mode
            mode = _SimMode(self, device_mode)
            mode.__enter__()
            self._mode = mode
            # torch names the sim replaces while active, each with what puts it back
            self._restores = [
                _patch_tolist(self),
                follow_new_threads(self),
                patch_parameter_new(),
                patch_custom_op_alias_check(),
            ]
        self._activations += 1

    @serialized
    def deactivate(self) -> None:
        """End one `activate()`; the last one runs queued work and gives torch back untouched."""
        if self._activations == 0:
            raise RuntimeError("deactivate() without a matching activate()")
        if self._activations == 1:
            assert self._mode is not None and self._device_mode is not None
            stack = _get_current_dispatch_mode_stack()
            functions = _get_current_function_mode_stack()
            if not stack or stack[-1] is not self._mode:
                raise RuntimeError(
                    "deactivate() while another dispatch mode entered after activate() is still "
                    "active: exit that mode first"
                )
            if not functions or functions[-1] is not self._device_mode:
                raise RuntimeError(
                    "deactivate() while another torch function mode entered after activate() is "
                    "still active: exit that mode first"
                )
            # Queued work that raises (a replay reading freed memory, say) is reported, but torch
            # is given back all the same and nothing is left queued for a later activation.
            error: Exception | None = None
            while self._active is None and self.scheduler.pending():
                try:
                    self.scheduler.drain_all()
                except Exception as exc:
                    error = error or exc
            if self._active is None:
                self._races.host_waits_for_all()
                self._frees.host_passed_all()
            for restore in reversed(self._restores):
                restore()
            self._restores = []
            self._mode.__exit__(None, None, None)
            self._mode = None
            self._device_mode.__exit__(None, None, None)
            self._device_mode = None
            self._activations -= 1
            if error is not None:
                raise error
            return
        self._activations -= 1

    @contextmanager
    def active(self) -> Iterator[SimBackend]:
        """`activate()` for the duration of the block."""
        self.activate()
        try:
            yield self
        finally:
            self.deactivate()

    # -- the torch.cuda surface ----------------------------------------------------------------

    def set_scheduler_seed(self, seed: int) -> None:
        """Choose the order in which independent streams' queued work runs."""
        self.scheduler.set_seed(seed)

    @property
    def _current(self) -> SimStream:
        """This thread's current stream (as on CUDA, each thread has its own)."""
        current = self._streams.current
        return self._default if current is None else current

    @_current.setter
    def _current(self, stream: SimStream) -> None:
        self._streams.current = stream

    def current_stream(self) -> SimStream:
        return self._current

    def default_stream(self) -> SimStream:
        return self._default

    def set_stream(self, s: SimStream) -> None:
        """Make `s` the current stream until it is set again (`torch.cuda.set_stream`)."""
        if not isinstance(s, SimStream):
            raise TypeError(f"set_stream: expected a sim stream, got {s!r}")
        self._current = s

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

    @serialized
    def synchronize(self) -> None:
        self._forbid_in_capture("synchronize()")
        self.scheduler.drain_all()
        self._races.host_waits_for_all()
        self._frees.host_passed_all()

    @serialized
    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        """`t.record_stream(stream)` (frees.py)."""
        self._frees.record_stream(t, self._races.agent(stream))

    @serialized
    def take_races(self) -> list[Race]:
        """The stream races the happens-before checker found since the last call, first found
        first (at most a few dozen; each pair of lines once). See docs/backends.md."""
        return self._races.take()

    def graph_pool_handle(self) -> SimPoolHandle:
        return SimPoolHandle()

    def is_current_stream_capturing(self) -> bool:
        """Whether the current stream takes part in a capture (the capturing stream, or one
        forked from it), as `torch.cuda.is_current_stream_capturing` answers."""
        return self.capturing_here() is not None

    def empty_cache(self) -> None:
        """Nothing to give back: the sim's device memory is host memory, freed with its tensors."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory: the sim does not account it (`SIM_MEMORY`)."""
        return SIM_MEMORY, SIM_MEMORY

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
            # An interrupt right after capture_begin or right before capture_end must not leave
            # the stream capturing: every later operation would be recorded, not run.
            try:
                cuda_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
                yield cuda_graph
                cuda_graph.capture_end()
            except BaseException:
                self._abort_capture(cuda_graph)
                raise

    def empty_pinned(
        self, size: int | tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Pinned host memory: the only host memory a capture may copy to or from, and the only
        memory an async copy reads or writes when it runs rather than when it is issued."""
        self._passthrough += 1
        try:
            t = torch.empty(size, dtype=dtype)
        finally:
            self._passthrough -= 1
        self.register_pinned(t)
        return t

    @serialized
    def register_pinned(self, t: torch.Tensor) -> None:
        """Treat the storage of host tensor `t` as pinned for as long as it lives."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        self._pinned.add(ptr)
        weakref.finalize(storage, self._pinned.discard, ptr)
        if self._active is not None:
            self._active.capture.made_pinned(storage)

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in pinned host memory."""
        return bool(self._pinned) and t.untyped_storage().data_ptr() in self._pinned

    @contextmanager
    def placing(self, device: bool) -> Iterator[None]:
        """Operations dispatched in the block make their results on the device (True) or the
        host (False), whatever their arguments: a factory call that named its device."""
        previous, self._placing = self._placing, device
        try:
            yield
        finally:
            self._placing = previous

    # -- streams and events --------------------------------------------------------------------

    @serialized
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
        self._check_captured_record(event, "a stream's wait")
        marker = event.marker
        if active is not None and stream in active.unjoined and marker is not None:
            raise active.capture.fail(
                "a capturing stream waited on an event recorded outside the capture "
                "(cudaErrorStreamCaptureIsolation): a graph cannot depend on uncaptured work; "
                "record the event inside the capture, or wait before capturing"
            )
        if event.clock is not None:
            self._races.wait(self._races.agent(stream), event.clock)
        if marker is None or marker.done:
            return
        self.scheduler.enqueue(stream, new_wait(marker))

    @serialized
    def event_record(self, event: SimEvent, stream: SimStream | None) -> None:
        stream = stream or self._current
        event.recorded_on = stream
        active = self._active
        if active is not None and stream in active.unjoined:
            event.capture_position = (active, active.ops_on[stream])
            event.marker = None
            event.clock = None
            if event.external:
                active.capture.records_external(event)
            return
        event.capture_position = None
        event.marker = new_marker(stream)
        event.clock = self._races.record(self._races.agent(stream))
        self.scheduler.enqueue(stream, event.marker)

    @staticmethod
    def _check_captured_record(event: SimEvent, what: str) -> None:
        """CUDA refuses to wait for or on an event whose last record is a node of a graph (a
        record inside a capture), unless the event was made with external=True."""
        if event.capture_position is not None and not event.external:
            raise RuntimeError(
                f"invalid argument (as CUDA reports it): {what} of an event last recorded inside a graph "
                "capture; make it with torch.cuda.Event(external=True) to use it outside the "
                "graph, or record it again outside"
            )

    @serialized
    def event_query(self, event: SimEvent) -> bool:
        self._forbid_in_capture("Event.query()")
        self._check_captured_record(event, "Event.query()")
        self.scheduler.maybe_progress()
        done = event.marker is None or event.marker.done
        if done and event.clock is not None:
            self._races.host_waits(event.clock)  # the host saw it complete
        return done

    @serialized
    def event_synchronize(self, event: SimEvent) -> None:
        self._forbid_in_capture("Event.synchronize()")
        self._check_captured_record(event, "Event.synchronize()")
        if event.marker is not None:
            self.scheduler.run_until(event.marker)
        if event.clock is not None:
            self._races.host_waits(event.clock)

    @serialized
    def stream_query(self, stream: SimStream) -> bool:
        self._forbid_in_capture("Stream.query()")
        self.scheduler.maybe_progress()
        done = not self.scheduler.has_work(stream)
        if done:
            self._races.host_waits_for(self._races.agent(stream))
        return done

    @serialized
    def stream_synchronize(self, stream: SimStream) -> None:
        self._forbid_in_capture("Stream.synchronize()")
        self.scheduler.drain(stream)
        self._races.host_waits_for(self._races.agent(stream))

    @serialized
    def host_read(self, what: str, t: torch.Tensor | None = None) -> None:
        """The host is about to read device memory (`t`, when known): in a capture that is
        illegal, else it waits for the current stream, which copies it to the host. The sim's
        own internal work reads nothing for the program."""
        if self._passthrough:
            return
        active = self.capturing_here()
        if active is not None:
            raise active.capture.fail(
                f"{what} cannot be captured: a host read of a device value. Move it out of the "
                "capture region, or keep the value on the device."
            )
        if t is not None:
            self._note(self._current, [(t, False)], what)
        self._host_waits_for(self._current)

    def _host_waits_for(self, stream: SimStream) -> None:
        self.scheduler.drain(stream)
        self._races.host_waits_for(self._races.agent(stream))

    def _forbid_in_capture(self, what: str) -> None:
        if self._active is not None:
            raise self._active.capture.fail(
                f"{what} during a capture: synchronizing is not allowed while a stream is capturing"
            )

    # -- capture ---------------------------------------------------------------------------------

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
        self.scheduler.drain(origin)
        capture = Capture(handle, _release_block, keeps_pinned=KEEPS_CAPTURED_PINNED_BLOCKS)
        self._active = _Active(
            graph, capture, origin, torch.initial_seed(), error_mode, {origin: False}, {origin: 0}
        )
        graph._program = None
        graph._pool = handle

    @serialized
    def _end_capture(self, graph: SimGraph) -> None:
        active = self._require_active(graph)
        self._active = None
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
        # Internal: instantiating the graph computes views of its own memory, which are no
        # scheduling points for queued work and no operations of the caller.
        graph._program = self._internal(active.capture.finish)

    @serialized
    def _abort_capture(self, graph: SimGraph) -> None:
        """End `graph`'s capture, if it is under way, keeping nothing of it. (A graph whose
        capture never began keeps what it holds: capture_begin refused it.)"""
        if self._active is not None and self._active.graph is graph:
            self._active = None
            graph._program = None

    @staticmethod
    def _check_seed(active: _Active) -> None:
        """CUDA's generator refuses a new seed while a stream captures (the graph's random
        operations are bound to the seed of the capture); torch.manual_seed bypasses the
        dispatcher, so the sim checks at the next captured operation and at capture_end."""
        if active.capture.invalid is None and torch.initial_seed() != active.seed:
            raise active.capture.fail(
                f"manual_seed({torch.initial_seed()}) during a capture begun with seed "
                f"{active.seed}: a generator can only be re-seeded with the same seed while a "
                "stream is capturing"
            )

    def capturing_here(self) -> _Active | None:
        """The capture the current stream takes part in, if any."""
        active = self._active
        if active is not None and self._current in active.unjoined:
            return active
        return None

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
        for ref, fp, write in program.accesses:
            storage = ref()
            if storage is not None:
                touched.append((storage, fp, write))
        races = self._races
        reads_pinned = any(not write and fp.storage in self._pinned for _, fp, write in touched)
        agent = races.agent(self._current)
        accesses = races.access(agent, touched, "graph replay", keep=reads_pinned)
        self._note_uses(self._current, agent, touched, "graph replay")
        pinned = [storage for storage, _, _ in touched] if accesses else []
        watches = self._watch_pinned_reads(accesses, pinned)

        run = self._after_watches(watches, functools.partial(program.run, storages))
        self.scheduler.enqueue(self._current, new_work(run, "graph replay"))
        launched = SimEvent()
        self.event_record(launched, self._current)
        program.last_launch = launched
        for event in program.external_events:  # where the graph records them: once it has run
            self.event_record(event, self._current)

    # -- dispatch ------------------------------------------------------------------------------

    def _internal(self, run: Callable[[], Any]) -> Any:
        self._passthrough += 1
        try:
            with torch._C.DisableTorchFunction():
                return run()
        finally:
            self._passthrough -= 1

    def _note(
        self,
        stream: SimStream | None,
        touched: list[tuple[torch.Tensor, bool]],
        op: str,
        *,
        keep: bool = False,
    ) -> list[Any]:
        """Tell the race checker what an operation issued now touches; stream None: the host.
        `keep`: judge and record now, and return the accesses (see RaceChecker.access)."""
        found = []
        for t, write in touched:
            located = footprint.of(t)
            if located is not None:
                found.append((located[0], located[1], write))
        return self._access(stream, found, op, keep=keep)

    def _access(
        self, stream: SimStream | None, touched: list[Touch], op: str, *, keep: bool = False
    ) -> list[Any]:
        """An operation issued now on `stream` (None: the host) touches these bytes: judged by the
        race checker, and, on a stream, noted by the free tracker."""
        races = self._races
        if stream is None:
            return races.access(HOST, touched, op, keep=keep)
        agent = races.agent(stream)
        accesses = races.access(agent, touched, op, keep=keep)
        self._note_uses(stream, agent, touched, op)
        return accesses

    def _note_uses(self, stream: SimStream, agent: int, touched: list[Touch], op: str) -> None:
        """Tell the free tracker which storages a device operation issued now touches, where one
        may be another stream's memory: always off the default stream, on it only while memory
        allocated elsewhere lives."""
        if stream is not self._default or self._frees.side_allocations:
            self._frees.used(agent, touched, op)

    def _note_call(
        self,
        stream: SimStream | None,
        op: OpFacts,
        args: Any,
        kwargs: Any,
        result: Any,
        tensors: list[torch.Tensor],
    ) -> None:
        """`_note` of a call that ran: its tensor arguments (`tensors`) and fresh outputs, in one
        pass (ops.touched, without its intermediate list: this runs for every eager operation)."""
        if op.quiet:
            return
        found = []
        of = footprint.of
        if op.written_positions:
            written = ops.written_args(op, args, kwargs)
            for t in tensors:
                located = of(t)
                if located is not None:
                    found.append((located[0], located[1], any(t is w for w in written)))
        else:
            for t in tensors:
                located = of(t)
                if located is not None:
                    found.append((located[0], located[1], False))
        for t in ops.fresh_outputs(op, result):
            located = of(t)
            if located is not None:
                found.append((located[0], located[1], True))
        self._access(stream, found, op.name)

    def _after_watches(self, watches: list[Any], run: Callable[[], Any]) -> Callable[[], None]:
        """Queued work that first judges its watched pinned reads (host writes torch could not
        see happened before it ran), then runs `run` as sim-internal work."""
        races = self._races

        def work() -> None:
            for watch in watches:
                races.check(watch, drop=False)
            self._internal(run)

        return work

    def _watch_pinned_reads(self, accesses: list[Any], storages: list[Any]) -> list[Any]:
        """Pinned bytes read by queued device work: watched for host writes torch cannot see."""
        watches = []
        for access, storage in zip(accesses, storages, strict=True):
            if not access.write and access.fp.storage in self._pinned:
                self._races.check_watched(access.fp.storage)
                watch = self._races.watch(access, storage)
                if watch is not None:
                    watches.append(watch)
        return watches

    def _dispatch(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mode: _SimMode
    ) -> Any:
        if self._passthrough:
            return func(*args, **kwargs)
        op = ops.facts(func)
        if op.apart:
            return self._apart(op, args, kwargs, mode)
        tensors, host = _tensors(args, kwargs)
        placing = self._placing
        if placing is None:
            device = len(host) < len(tensors)
        else:
            host, device = [], placing
        if not device:
            return self._host_op(op, args, kwargs, tensors)
        if op.runnable is not True:
            check_runnable(op)
        if host:
            if op.is_copy:
                return self._cross(args, kwargs)
            self._check_host_operands(op, args, host)
        result = mark_device(self._device_op(op, args, kwargs, tensors, bool(host)))
        if op.is_view and args:
            keep_bases_of_views(args[0], result)
        return result

    def _apart(
        self, op: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any], mode: _SimMode
    ) -> Any:
        """An operation the sim does not take as one device operation (`OpFacts.apart`)."""
        func = op.func
        if op.python_kernel:
            # A runner's own operator written in Python (`torch.library.custom_op`, as vLLM
            # keeps attention opaque): CUDA runs its Python once, at the call (at capture, for a
            # graph), and records the kernels it launches. Run here below the sim's mode, with
            # both modes entered again (the function mode too: the call is still inside its
            # handler), so that each operation it makes reaches the sim as the runner's own
            # would; recorded whole, a replay would have run its Python again.
            with torch._C._EnableTorchFunction(), mode.device_mode, mode:
                return func.redispatch(_HOST_KERNEL, *args, **kwargs)
        if op.composite:
            # Outside inference mode autograd breaks such an operation into the ones it is made
            # of before the sim sees it; in inference mode (no autograd) it arrives whole, and
            # some of them (`to`, `reshape`, `contiguous`) copy where their schema promises a
            # view. Broken up here as autograd would, with the sim's mode entered again so that
            # each part reaches it.
            with mode:
                return func.decompose(*args, **kwargs)
        return func(*args, **kwargs)  # a metadata query: no device work, no read

    def _host_op(
        self,
        op: OpFacts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
    ) -> Any:
        """Host code on host memory: it runs at once, whatever the device is doing."""
        self.scheduler.maybe_progress()  # the device keeps working while the host does
        result = op.func(*args, **kwargs)
        # Only pinned memory is touched by queued device work: pageable memory crosses to and
        # from the device synchronously, so a host access to it has nothing to race with.
        if self._pinned and any(self.is_pinned(t) for t in tensors):
            self._note_call(None, op, args, kwargs, result, tensors)
        return result

    def _cross(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A copy between host and device memory, with CUDA's rules: only a non_blocking copy
        with pinned memory is asynchronous, and only it can be captured."""
        dst, src = args[0], args[1]
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        upload = isinstance(dst, SimDeviceTensor)
        pinned = self.is_pinned(src if upload else dst)
        stream = self._current
        active = self._active
        if active is not None and stream in active.unjoined:
            if not (non_blocking and pinned):
                raise active.capture.fail(_crossing_refused(upload, non_blocking))
            self._check_seed(active)
            active.ops_on[stream] += 1
            if stream is not active.origin:
                active.unjoined[stream] = True
            return active.capture.record(ops.facts(ops.aten.copy_.default), args, kwargs)
        self.scheduler.maybe_progress()
        if non_blocking and pinned:
            touched = [(src, False), (dst, True)]
            accesses = self._note(stream, touched, "aten.copy_", keep=upload)
            reads = [access for access in accesses if not access.write]
            watches = self._watch_pinned_reads(reads, [src.untyped_storage()] * len(reads))
            (held_dst, held_src), held = self._held((dst, src))
            copy = self._after_watches(
                watches,
                _queued_call(
                    ops.aten.copy_.default, (held_dst, held_src), {}, {}, held, self._frees
                ),
            )
            self.scheduler.enqueue(stream, new_work(copy, "async copy"))
            return dst
        # A blocking copy, or one with pageable memory: in stream order on the current stream,
        # and the host waits for it (a pageable source is staged before the call returns).
        self._note(stream, [(src, False), (dst, True)], "aten.copy_")
        self._host_waits_for(stream)
        return ops.aten.copy_.default(*args, **kwargs)

    def _device_op(
        self,
        op: OpFacts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
        host_scalars: bool,
    ) -> Any:
        """Device work: recorded in a capture, run at once on the default stream, else queued.
        `host_scalars`: a 0-dim host tensor is among the arguments (a kernel argument, read when
        the operation is issued)."""
        func = op.func
        stream = self._current
        active = self._active
        if active is not None:
            if stream not in active.unjoined:
                if active.error_mode != "relaxed" and op.allocates:
                    raise active.capture.fail(
                        f"{op.name} on a stream outside the capture needs a new "
                        "allocation while a stream is capturing (operation not permitted when "
                        "stream is capturing): allocate before the capture, or capture with "
                        "capture_error_mode='relaxed'"
                    )
                result = func(*args, **kwargs)  # not part of the capture: runs at once
                self._note_call(stream, op, args, kwargs, result, tensors)
                self._note_allocation(stream, op, result)
                return result
            self._check_seed(active)
            active.ops_on[stream] += 1
            if stream is not active.origin:
                active.unjoined[stream] = True
            if not op.quiet and ops.capture_violation(op, args, kwargs) is None:
                check_kernel_dtypes(op, args, kwargs, tensors, self._internal)
            return active.capture.record(op, args, kwargs)
        self.scheduler.maybe_progress()
        if op.allocates and self._frees.watched:
            self._before_allocation(stream, op)
        if ops.capture_violation(op, args, kwargs) is not None:
            self._note(stream, ops.touched(op, args, kwargs, ()), op.name)
            self._host_waits_for(stream)  # a host read: it waits for the stream
            result = func(*args, **kwargs)
            self._note_allocation(stream, op, result)
            return result
        if stream is self._default:
            self.scheduler.drain(stream)
            result = func(*args, **kwargs)
            self._note_call(stream, op, args, kwargs, result, tensors)
            return result
        if not op.quiet:
            check_kernel_dtypes(op, args, kwargs, tensors, self._internal)
        if host_scalars:
            args, kwargs = _baked(args), {k: _baked(v) for k, v in kwargs.items()}
            return self._defer(stream, op, args, kwargs, None)
        return self._defer(stream, op, args, kwargs, tensors)

    def _defer(
        self,
        stream: SimStream,
        op: OpFacts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor] | None,
    ) -> Any:
        """Queue an operation on a side stream; its fresh outputs are poison until it runs.
        `tensors`: its tensor arguments, when the caller has them (ops.touched)."""
        func = op.func
        agent = self._races.agent(stream)
        if op.quiet:
            result = func(*args, **kwargs)  # metadata or allocation only: nothing to order
            if op.empty:
                self._frees.allocated(agent, result)
            return result
        positions = op.fresh_positions
        metas = ops.meta_outputs(op, args, kwargs) if positions else []
        fresh = {}
        for p in positions:
            out = torch.empty_strided(metas[p].shape, metas[p].stride, dtype=metas[p].dtype)
            poison_(out)
            fresh[p] = out
        if fresh:
            self._frees.allocated(agent, list(fresh.values()))

        touched = ops.touched(op, args, kwargs, list(fresh.values()), tensors)
        self._note(stream, touched, op.name)
        if op.changes_metadata:
            run = _queued_call(func, args, kwargs, fresh, [], self._frees)
        else:
            (args_held, kwargs_held, fresh_held), held = self._held((args, kwargs, fresh))
            run = _queued_call(func, args_held, kwargs_held, fresh_held, held, self._frees)
        self.scheduler.enqueue(stream, new_work(lambda: self._internal(run), op.name))
        return ops.assemble_returns(op, args, kwargs, fresh)

    def _note_allocation(self, stream: SimStream, op: OpFacts, result: Any) -> None:
        """Memory allocated by an operation that ran at once on `stream` belongs to `stream`
        (the default stream's needs no note: it is what memory belongs to unless noted)."""
        if op.allocates and stream is not self._default:
            fresh = ops.fresh_outputs(op, result)
            if fresh:
                self._frees.allocated(self._races.agent(stream), fresh)

    def _held(self, what: tuple[Any, ...]) -> tuple[Any, list[int]]:
        """What queued work holds of `what`: aliases of its tensors, never the program's own,
        so that the program's frees stay visible (frees.py); and the storages to release."""
        # Torch's own detach, past the sim's modes: an alias is no operation of the program.
        with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
            return self._frees.hold(what)

    def _before_allocation(self, stream: SimStream, op: OpFacts) -> None:
        """An allocation issued on `stream`: memory freed while another stream still used it,
        without an order or record_stream, may be handed out now; it is overwritten as the new
        owner would."""
        freed = self._frees.freed_before_allocation(self._races.agent(stream), op.name)
        for storage in freed:
            self._internal(functools.partial(_overwrite, storage))

    def _check_host_operands(
        self, op: OpFacts, args: tuple[Any, ...], host: list[torch.Tensor]
    ) -> None:
        """A device operation accepts host tensors only as 0-dim operands (kernel arguments) and,
        as torch does on CUDA, as the indices of advanced indexing, which it copies to the device
        first: a capture refuses that copy."""
        if op.indexing and all(any(t is i for i in ops.flat(args[1])) for t in host):
            active = self.capturing_here()
            if active is not None:
                raise active.capture.fail(
                    f"{op.name} with host indices cannot be captured: they are copied to "
                    "the device first (a blocking copy). Keep the indices on the device."
                )
            return
        _check_host_operands(op, host)


def _check_host_operands(op: OpFacts, host: list[torch.Tensor]) -> None:
    for t in host:
        if t.dim() != 0:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"{SIM_DEVICE} and cpu! ({op.name} got a host tensor of shape "
                f"{list(t.shape)}: copy it to the device first)"
            )


def _queued_call(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fresh: dict[int, torch.Tensor],
    held: list[int],
    frees: StreamOrderedFrees,
) -> Callable[[], None]:
    """Queued device work: run `func` and copy its fresh results into the outputs handed out when
    it was issued, then release the storages its aliases hold (`held`). Holds only what it is
    given (never the issuing frame)."""

    def run() -> None:
        try:
            result = func(*args, **kwargs)
            results = result if isinstance(result, tuple | list) else [result]
            for p, out in fresh.items():
                out.copy_(results[p])
        finally:
            frees.release(held)

    return run


def _overwrite(storage: torch.UntypedStorage) -> None:
    """Every byte of `storage` set to 0xFF (NaN in floating point, -1 in integers): what an
    allocation handed a freed block may write before queued work reads it."""
    torch.empty(0, dtype=torch.uint8).set_(storage).fill_(255)


def _baked(x: Any) -> Any:
    """A 0-dim host tensor argument as it is now: queued work reads the value it was issued with."""
    if isinstance(x, torch.Tensor):
        return x if isinstance(x, SimDeviceTensor) else x.clone()
    if isinstance(x, list | tuple):
        return type(x)(_baked(i) for i in x)
    return x


def _crossing_refused(upload: bool, non_blocking: bool) -> str:
    what = "from host memory to the device" if upload else "from the device to host memory"
    why = "a blocking copy synchronizes" if not non_blocking else "its host memory is pageable"
    return (
        f"a copy {what} cannot be captured: {why}. Only a non_blocking copy to or from pinned "
        "memory (backend.empty_pinned, pin_memory=True) is recorded into a graph; copy before or "
        "after the capture, or stage through pinned memory."
    )


def _release_block(pool: Any, block: torch.Tensor) -> None:
    pool.release(block)


def _patch_tolist(backend: SimBackend) -> Callable[[], None]:
    """`Tensor.tolist` reads memory without passing through the dispatcher: make it a host read.
    Returns what puts torch's back."""
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        if not backend._passthrough:
            if isinstance(self, SimDeviceTensor):
                backend.host_read("Tensor.tolist()", self)
            elif backend.is_pinned(self):
                # Pinned memory is host memory: reading it waits for nothing, as on a GPU,
                # while the device may have run some queued work meanwhile.
                backend.scheduler.maybe_progress()
                backend._note(None, [(self, False)], "Tensor.tolist()")
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]

    def restore() -> None:
        torch.Tensor.tolist = original  # type: ignore[method-assign]

    return restore
