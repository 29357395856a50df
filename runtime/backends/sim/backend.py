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

import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from pytest_graphmode.runtime.backends.errors import CaptureError, UseAfterFreeError
from pytest_graphmode.runtime.backends.new_threads import LiveThreads
from pytest_graphmode.runtime.backends.race import Race
from pytest_graphmode.runtime.backends.sim.attention import patch_causal_bias_new
from pytest_graphmode.runtime.backends.sim.capture import patch_custom_op_alias_check
from pytest_graphmode.runtime.backends.sim.device import (
    SIM_DEVICE,
    SimDeviceTensor,
    patch_parameter_new,
)
from pytest_graphmode.runtime.backends.sim.device_mode import DeviceMode
from pytest_graphmode.runtime.backends.sim.dispatch import Dispatching
from pytest_graphmode.runtime.backends.sim.frees import StreamOrderedFrees
from pytest_graphmode.runtime.backends.sim.graphs import SimGraph
from pytest_graphmode.runtime.backends.sim.happens_before import RaceChecker
from pytest_graphmode.runtime.backends.sim.memory_ledger import DeviceMemory
from pytest_graphmode.runtime.backends.sim.pool import SimPoolHandle
from pytest_graphmode.runtime.backends.sim.streams import SimEvent, SimStream, StreamScheduler
from pytest_graphmode.runtime.backends.sim.sync_debug import warn_or_error_on_sync
from pytest_graphmode.runtime.backends.sim.threads import (
    ThreadStreams,
    follow_new_threads,
    serialized,
)

__all__ = ["FollowerSimMode", "SimBackend", "SimGraph", "current_backend"]

_BACKEND: SimBackend | None = None


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


class SimBackend(Dispatching):
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
        self.threads = LiveThreads()
        self._restores: list[Callable[[], None]] = []
        self._capture_stream = SimStream(_backend=self)
        self._active = None
        self._passthrough = 0
        self._pinned = set()
        self._activations = 0
        self._mode: _SimMode | None = None
        self._device_mode = None
        self._placing = None
        self._call_args = None
        self._races = RaceChecker()
        self._frees = StreamOrderedFrees(
            self._races, self._races.agent(self._default), self._pinned
        )
        self.memory = DeviceMemory()

    # -- activation ----------------------------------------------------------------------------

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
                patch_causal_bias_new(),
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
        warn_or_error_on_sync()
        self.scheduler.drain_all()
        self._races.host_waits_for_all()
        self._frees.host_passed_all()

    @serialized
    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        """`t.record_stream(stream)`: on an output of a capture under way, the capture's
        (`Capture.recorded_on`); on other memory, the free tracker's (frees.py)."""
        active = self._active
        if active is not None and active.capture.recorded_on(t, stream):
            return
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
        """Give back the reserved memory no tensor uses (memory_ledger.py): the host memory
        itself went back when its tensors were freed."""
        self.memory.empty_cache()

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory: the total less what the caching allocator
        would hold (memory_ledger.py)."""
        return self.memory.mem_get_info()

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

    @contextmanager
    def placing(self, device: bool) -> Iterator[None]:
        """Operations dispatched in the block make their results on the device (True) or the
        host (False), whatever their arguments: a factory call that named its device."""
        previous, self._placing = self._placing, device
        try:
            yield
        finally:
            self._placing = previous


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
