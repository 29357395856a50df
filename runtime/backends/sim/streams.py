"""Streams, events and the seeded scheduler that runs queued device work.

Device work queued on a stream runs at the latest moment its declared dependencies allow: when a later
operation on the same stream executes, when someone waits for it (event, stream synchronize, device
synchronize) or when the host reads its result. At every operation the scheduler may also let some
queued work run early, chosen by a seeded random generator. Independent streams are therefore ordered
differently under different seeds, and a missing dependency shows up as a wrong value for some seeds,
reproducibly per seed.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pytest_graphmode.runtime.backends.sim.device import SIM_DEVICE
from pytest_graphmode.runtime.backends.sim.limits import SimUnsupportedError


@dataclass(eq=False)
class _Work:
    run: Callable[[], None]
    label: str


@dataclass(eq=False)
class _Marker:
    """An event recorded at this point of a stream; done once the stream reaches it. The stream
    is the marker's own: an event recorded again elsewhere moves, and a wait already queued on
    this record must still run this stream (as a CUDA wait is bound to the record before it)."""

    stream: SimStream
    done: bool = False
    at: float = 0.0


@dataclass(eq=False)
class _Wait:
    marker: _Marker


_Item = _Work | _Marker | _Wait


class StreamScheduler:
    """Owns every stream's queue; the single place where queued device work runs.

    Only streams with queued work have a queue: a queue is dropped when its last item runs, so a
    process that creates a stream per capture does not accumulate queues (nor keep those streams
    alive), and a scheduling point costs the same after a million captures as after one.
    """

    # Chance, at each scheduling point, that one queued item runs early.
    EAGERNESS = 0.5

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._queues: dict[SimStream, deque[_Item]] = {}
        self._running = False

    def set_seed(self, seed: int) -> None:
        self._rng = random.Random(seed)

    @property
    def rng(self) -> random.Random:
        """The seeded generator that picks schedules (also a replay's order of its branches)."""
        return self._rng

    def enqueue(self, stream: SimStream, item: _Item) -> None:
        self._queues.setdefault(stream, deque()).append(item)

    def has_work(self, stream: SimStream) -> bool:
        return bool(self._queues.get(stream))

    def pending(self) -> bool:
        return bool(self._queues)

    @property
    def queue_count(self) -> int:
        """How many streams have queued work (each has one queue; the others have none)."""
        return len(self._queues)

    def maybe_progress(self) -> None:
        """A scheduling point: perhaps run one queued item of a random stream."""
        if self._running or not self._queues:
            return
        if self._rng.random() >= self.EAGERNESS:
            return
        streams = list(self._queues)
        stream = streams[self._rng.randrange(len(streams))]
        head = self._queues[stream][0]
        if isinstance(head, _Wait) and not head.marker.done:
            return
        self._run_next(stream)

    def drain(self, stream: SimStream) -> None:
        while stream in self._queues:
            self._run_next(stream)

    def run_until(self, marker: _Marker) -> None:
        while not marker.done:
            self._run_next(marker.stream)

    def drain_all(self) -> None:
        while True:
            streams = list(self._queues)
            if not streams:
                return
            self._rng.shuffle(streams)
            for stream in streams:
                self.drain(stream)

    def _run_next(self, stream: SimStream) -> None:
        queue = self._queues[stream]
        item = queue[0]
        if isinstance(item, _Wait):
            # Dependencies are honoured by running the other stream up to the awaited point.
            self.run_until(item.marker)
        queue.popleft()
        if not queue:
            del self._queues[stream]
        if isinstance(item, _Marker):
            item.done = True
            item.at = time.perf_counter()
        elif isinstance(item, _Work):
            was_running, self._running = self._running, True
            try:
                # Below autograd, as the operation was when it was issued (the sim sees device
                # work beneath it): work issued in inference mode writes inference tensors,
                # which torch refuses to update above it, outside the mode, where a
                # synchronize or a later operation runs the queue.
                with torch._C._AutoDispatchBelowADInplaceOrView():
                    item.run()
            except Exception as error:
                _note_ran_late(error, item, stream)
                raise
            finally:
                self._running = was_running


QUEUED_EARLIER = "raised by device work queued earlier"


def _note_ran_late(error: Exception, item: _Work, stream: SimStream) -> None:
    """Say on `error` that queued work raised it, not the operation its traceback ends in: the
    sim runs queued work when a later operation or a synchronize needs it, as CUDA reports a
    kernel's error at a later call (or as a device-side assert). Said once: a stream an item
    waits for runs before the item, outside its handler."""
    error.add_note(
        f"{QUEUED_EARLIER} on {stream!r} ({item.label}): the sim ran it when a later operation "
        "or a synchronize reached it, which is where the traceback above passes through the "
        "stream scheduler; the operation that raised is the innermost frame. On CUDA such an "
        "error is reported asynchronously too, at a later call, or as a device-side assert"
    )


_stream_ids = itertools.count()


# Why an event cannot be shared between processes: each process has a sim device of its own.
_ONE_PROCESS = (
    "the sim's device belongs to one process, so nothing on it can be shared with another"
)


# The highest priority torch gives a stream (lower numbers are higher priorities).
_GREATEST_PRIORITY = -3


class SimStream:
    """A queue of device work, shaped like torch.cuda.Stream."""

    def __init__(
        self,
        device: object = None,
        priority: int = 0,
        stream_id: int | None = None,
        device_index: int | None = None,
        device_type: int | None = None,
        *,
        _backend: Any = None,
    ) -> None:
        from pytest_graphmode.runtime.backends.sim.backend import current_backend

        if (stream_id, device_index, device_type) != (None, None, None):
            # torch.cuda.Stream's way of naming a stream that already exists, by its id.
            raise SimUnsupportedError(
                "torch.cuda.Stream(stream_id=..., device_index=..., device_type=...)",
                why="it names a stream made elsewhere by its id; make streams with "
                "torch.cuda.Stream()",
            )
        self._backend = _backend or current_backend()
        # torch keeps streams of four priorities (0 to -3) and gives the nearest of them
        # (measured on an H100 with torch 2.11, whose device reports 0 to -5).
        self.priority = min(0, max(_GREATEST_PRIORITY, priority))
        self.stream_id = next(_stream_ids)
        self._blocks: list[Any] = []  # the `with` blocks open on this stream, innermost last

    @property
    def is_default(self) -> bool:
        return self is self._backend.default_stream()

    # What torch.cuda.Stream tells about itself. `cuda_stream` is the handle a runner hands to a
    # kernel or compares streams by: 0 for the default stream, as on CUDA, else unique per stream.
    device_index = 0
    device_type = 1  # torch's DeviceType.CUDA

    @property
    def device(self) -> torch.device:
        return SIM_DEVICE

    @property
    def cuda_stream(self) -> int:
        return 0 if self.is_default else self.stream_id + 1

    def wait_event(self, event: SimEvent) -> None:
        self._backend.stream_wait_event(self, event)

    def wait_stream(self, stream: SimStream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event if event is not None else SimEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return self._backend.stream_query(self)

    def synchronize(self) -> None:
        self._backend.stream_synchronize(self)

    @property
    def native_handle(self) -> int:
        return self.cuda_stream

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(least, greatest) priority, as torch reports them on a GPU of compute capability 9.0:
        the priorities of its own stream pools, not the device's wider range."""
        return 0, _GREATEST_PRIORITY

    def __enter__(self) -> SimStream:
        # `with torch.cuda.Stream() as s:` is `with torch.cuda.stream(s):`.
        block = self._backend.stream(self)
        block.__enter__()
        self._blocks.append(block)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._blocks.pop().__exit__(*exc)

    def __repr__(self) -> str:
        kind = "default" if self.is_default else f"#{self.stream_id}"
        return f"<sim stream {kind}>"


class SimEvent:
    """A point in a stream, shaped like torch.cuda.Event."""

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> None:
        from pytest_graphmode.runtime.backends.sim.backend import current_backend

        self._backend = current_backend()
        self.enable_timing = enable_timing
        # Recorded inside a capture, it may still be waited for outside the graph (CUDA's
        # external event record node).
        self.external = external
        self.marker: _Marker | None = None
        self.recorded_on: SimStream | None = None
        self.capture_position: tuple[object, int] | None = None
        # Where it was recorded in the order of a capture's work (capture_order.EventPoint)
        self.capture_point: Any = None
        # The race checker's vector clock of the recording point (None: never recorded, or
        # recorded inside a capture, where a replay is one piece of work)
        self.clock: dict[int, int] | None = None

    def record(self, stream: SimStream | None = None) -> None:
        self._backend.event_record(self, stream)

    def ipc_handle(self) -> bytes:
        raise SimUnsupportedError("torch.cuda.Event.ipc_handle", why=_ONE_PROCESS)

    @classmethod
    def from_ipc_handle(cls, device: object, handle: bytes) -> SimEvent:
        raise SimUnsupportedError("torch.cuda.Event.from_ipc_handle", why=_ONE_PROCESS)

    def wait(self, stream: SimStream | None = None) -> None:
        (stream or self._backend.current_stream()).wait_event(self)

    def query(self) -> bool:
        return self._backend.event_query(self)

    def synchronize(self) -> None:
        self._backend.event_synchronize(self)

    def elapsed_time(self, end: SimEvent) -> float:
        """Milliseconds between two completed events (wall clock of the simulated device)."""
        if not (self.enable_timing and end.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        if self.marker is None or end.marker is None or not (self.marker.done and end.marker.done):
            raise RuntimeError("elapsed_time needs both events recorded and completed")
        return (end.marker.at - self.marker.at) * 1e3


def new_marker(stream: SimStream) -> _Marker:
    return _Marker(stream)


def new_wait(marker: _Marker) -> _Wait:
    return _Wait(marker)


def new_work(run: Callable[[], None], label: str) -> _Work:
    return _Work(run, label)
