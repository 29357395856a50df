"""What every part of the sim backend shares: its state, declared once, and the questions about it
that each part asks (is a capture under way here, is memory pinned, which stream is current).

`SimBackend` (backend.py) is built in layers, one module each, every layer a subclass of the one
before: this state, the race and free notes of what operations touch (access_notes.py), streams
and events (events.py), capture and replay (capturing.py), the dispatch of every operation
(dispatch.py), and the backend itself, its activation and torch.cuda's surface (backend.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pytest_graphmode.runtime.backends.sim.capture import Capture
from pytest_graphmode.runtime.backends.sim.streams import SimStream
from pytest_graphmode.runtime.backends.sim.sync_debug import warn_or_error_on_sync

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.new_threads import LiveThreads
    from pytest_graphmode.runtime.backends.sim.device_mode import DeviceMode
    from pytest_graphmode.runtime.backends.sim.frees import StreamOrderedFrees
    from pytest_graphmode.runtime.backends.sim.graphs import SimGraph
    from pytest_graphmode.runtime.backends.sim.happens_before import RaceChecker
    from pytest_graphmode.runtime.backends.sim.memory_ledger import DeviceMemory
    from pytest_graphmode.runtime.backends.sim.streams import StreamScheduler
    from pytest_graphmode.runtime.backends.sim.threads import ThreadStreams


@dataclass(eq=False)
class ActiveCapture:
    graph: SimGraph
    capture: Capture
    origin: SimStream
    # the global generator's seed at capture_begin: CUDA refuses manual_seed(other) in a capture
    seed: int
    # "global": an unsafe call (allocating, waiting for a stream or event outside the capture) is
    # refused in every thread; "thread_local": in the capturing thread only; "relaxed": never
    error_mode: str
    # the thread that began the capture
    thread: int = 0
    # member stream -> whether it has work not yet joined back into the origin
    unjoined: dict[SimStream, bool] = field(default_factory=dict)
    ops_on: dict[SimStream, int] = field(default_factory=dict)

    def refuses_unsafe_call(self) -> bool:
        """Whether an unsafe call in the calling thread is refused: an allocation outside the
        capture, a wait for or a query of a stream or event outside it (CUDA's capture modes:
        refused from any thread while a global capture runs, only from the capturing thread
        while a thread-local one does, never while a relaxed one does)."""
        if self.error_mode == "global":
            return True
        return self.error_mode == "thread_local" and threading.get_ident() == self.thread


class SimState:
    """The sim backend's state (made in `SimBackend.__init__`) and the queries on it."""

    scheduler: StreamScheduler
    threads: LiveThreads
    _default: SimStream
    _streams: ThreadStreams
    _capture_stream: SimStream
    _active: ActiveCapture | None
    # >0: the sim's own tensor work runs, which is no operation of the program
    _passthrough: int
    _pinned: set[int]
    _activations: int
    _device_mode: DeviceMode | None
    # Where the factory call being dispatched puts its result (True: the device), set by the
    # device mode for calls that name a device; None: decided by the operation's arguments.
    _placing: bool | None
    # The arguments of the builtin torch call in progress (`device.call_through`): the tensors its
    # C++ makes inside, with its inputs' options, are device tensors when an input is one.
    _call_args: tuple[tuple[Any, ...], dict[str, Any]] | None
    _races: RaceChecker
    _frees: StreamOrderedFrees
    # What torch.cuda's caching allocator would count of the device tensors (memory_ledger.py)
    memory: DeviceMemory

    @property
    def is_active(self) -> bool:
        return self._activations > 0

    @property
    def _current(self) -> SimStream:
        """This thread's current stream (as on CUDA, each thread has its own)."""
        current = self._streams.current
        return self._default if current is None else current

    @_current.setter
    def _current(self, stream: SimStream) -> None:
        self._streams.current = stream

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in pinned host memory."""
        return bool(self._pinned) and t.untyped_storage().data_ptr() in self._pinned

    def capturing_here(self) -> ActiveCapture | None:
        """The capture the current stream takes part in, if any."""
        active = self._active
        if active is not None and self._current in active.unjoined:
            return active
        return None

    def _forbid_in_capture(self, what: str, stream: SimStream | None = None) -> None:
        """Refuse a wait or query while a capture runs. `stream`: the stream a wait or query of a
        stream or event concerns, which CUDA's capture modes decide for (another thread's under
        "thread_local", anyone's under "relaxed", is allowed; a stream taking part in the
        capture, never); None: the whole device, always refused."""
        active = self._active
        if active is None:
            return
        if (
            stream is not None
            and stream not in active.unjoined
            and not active.refuses_unsafe_call()
        ):
            return
        raise active.capture.fail(
            f"{what} during a capture: synchronizing is not allowed while a stream is capturing"
        )

    @staticmethod
    def _check_seed(active: ActiveCapture) -> None:
        """CUDA's generator refuses a new seed while a stream captures (the graph's random
        operations are bound to the seed of the capture); torch.manual_seed bypasses the
        dispatcher, so the sim checks at the next captured operation and at capture_end."""
        if active.capture.invalid is None and torch.initial_seed() != active.seed:
            raise active.capture.fail(
                f"manual_seed({torch.initial_seed()}) during a capture begun with seed "
                f"{active.seed}: a generator can only be re-seeded with the same seed while a "
                "stream is capturing"
            )

    def _internal(self, run: Callable[[], Any]) -> Any:
        self._passthrough += 1
        try:
            with torch._C.DisableTorchFunction():
                return run()
        finally:
            self._passthrough -= 1

    def _host_waits_for(self, stream: SimStream, checked: bool = True) -> None:
        """The host waits for `stream`'s work. `checked`: torch checks its sync debug mode there
        (a host read, a blocking copy; not the staging of a pageable `non_blocking` copy)."""
        if checked:
            warn_or_error_on_sync()
        self.scheduler.drain(stream)
        self._races.host_waits_for(self._races.agent(stream))
