"""Delays on every stream a runner uses (cuda): asynchronous copies and event records land late,
or a step's computation does; or the host is late, every copy landing before it goes on.

A sleep kernel on the current stream before a step only delays the work queued on that stream;
a runner's own copy stream, or a copy issued after a blocking copy has drained the stream, still
runs as soon as it is issued, and the host rarely wins the race. `delayed_streams(cycles)` closes
that gap for the span of one step: while it is open, a `torch.cuda._sleep(cycles)` kernel is
enqueued

- ahead of every non-blocking copy between host memory and a cuda device (`Tensor.copy_` and
  `Tensor.to` / `.cuda()`, i.e. `aten.copy_` and `aten._to_copy`, in either direction),
  on the stream that copy is issued on: the current stream of the copy's cuda device at that
  moment, whichever stream the runner made current (a side stream, a copy stream);
- ahead of every `torch.cuda.Event.record` (and so every `torch.cuda.Stream.record_event`), on
  the stream the event is recorded on.
- ahead of the first operation the step queues on a stream it entered (`with
  torch.cuda.stream(side):`, which the backend facade's `stream()` is), on that stream, each time
  it enters one that was not current: the kernels the runner queues there run late, so a side
  stream's read of a tensor that the current stream then overwrites in place, with no join between
  the two, reads the new values.

So a copy out of a pinned staging buffer reads it only after the host has moved on, a download into
pinned memory is not there yet when the host reads it without waiting, an event completes late and
a side stream's work runs late: host-staging races and missing waits show as wrong values. Correct
code (an event recorded after the copy and waited on before the buffer is written again or the
result is read) stays correct, only slower.

Nothing is delayed while a CUDA graph capture is underway: a sleep issued on a capturing stream
would be recorded into the graph and replayed on every later replay, long after the stressed step,
and asking whether an event has completed or waiting for a stream, even one that is not capturing,
ends a capture begun in torch's default (global) mode with an error. Captured copies and records
are left as they are (their timing is the replay's; a replay under the delays notes the copies of
pinned memory its graph captured as in flight: runtime/backends/cuda_captures.py). A capture is underway from a
`torch.cuda.CUDAGraph.capture_begin` of the scope to its `capture_end` (what `torch.cuda.graph`
calls), or while the stream an operation is queued on is capturing; a capture begun on another
thread or by C++ code, on a stream the scope does not queue on, is not seen.

A race has two orders, and copies landing late show only one: work that needs a copy runs before
it. The other (a copy that overwrites what earlier work still reads: the next step's upload into
the static buffers a replay or an eager forward has not read yet) shows only when that work is late
instead. `delayed_compute(cycles)` enqueues the sleep kernel on the current stream as the step
begins, so the eager kernels the step queues there run late, and again ahead of every
`torch.cuda.CUDAGraph.replay`, on the stream it replays on, so a replay is late even after the
host has waited for that stream or on a stream of its own; copies and event records are left
undelayed. The replay's class attribute is replaced and put back as `Event.record` is. Eager
kernels queued after the host waited for the current stream inside the step (an `.item()`, a
blocking download) are not delayed, nor are eager kernels on side streams (`delayed_streams`
delays those).

Scope: the copies are seen by a `TorchDispatchMode` pushed on entry and popped on exit, so modes
the runner enters inside the scope see the operations before it, as usual. `torch.cuda.Event.record`
and `torch.cuda.StreamContext.__enter__` are replaced on their classes for the scope and the exact
attributes they had are put back on exit, also when the step raises; since they are class
attributes, other threads recording events or entering streams during the scope are delayed too.
The mode is per thread: a runner's own thread, started while the cuda backend is active, hands
its operations to the scope underway through a mode of its own (runtime/backends/cuda_threads.py),
so its copies are delayed and noted too; while such a thread is alive, the scope judges one
operation at a time.
Not covered: `torch.Event` / `torch.Stream` (the device-generic classes, recorded in C++ without a
Python hook), device-to-device copies, kernels on a side stream made current by
`torch.cuda.set_stream` alone, or launched there without the dispatcher (a Triton or C++ extension
kernel) before any operation that passes it, and copies issued by C++ code that bypasses the
dispatcher.

How long: a sleep starts as soon as it is queued, and the host goes on with the step (launching an
eager forward of a few hundred kernels takes milliseconds); once the sleep ends the device catches
up, and a race whose other side is the host's next step is hidden. So both scopes take
`hold_cycles`, the sleep that must outlast the host (the caller estimates it from the host time of
the steps to outlast, `sleep_cycles_per_second` converting): the first sleep on each stream is that
long, and so is any later one on a stream whose long sleep has already ended (the host waited for
that stream in between); the others are `cycles` long, the work queued after them waiting for the
long one anyway.

Which streams: every stream late by the same hold keeps their order, and a race between two of them
stays hidden. A download on an output stream that the host reads after waiting for another stream
(a copy stream, the compute stream) lands before the read when both are held back: the host's wait
on the other stream lasts the hold, and the download's hold runs meanwhile. So both scopes take
`held_stream`: None holds back every stream; k holds back only the k-th distinct stream the step
delays work on (counted from 0 in the order the step first queues such work there: the stream a
`wait_stream` records on, a copy stream, an output stream), and queues no sleep on any other. A
runner's steps use the same few streams, and a k past them would hold back nothing (on a runner
with one stream, two of the three streams drawn). So the scopes take a `StreamsMet` shared across
a runner's steps (the harness keeps one per phase: an eager prefill may queue on one stream where
a replayed decode queues on three): it keeps the most streams any earlier scope met, and k is
taken modulo that count where it has one. A step that meets more streams than any before it
counts k as given.

The host late instead: `landed_copies()` delays nothing and synchronizes the stream of every
non-blocking copy between host memory and a cuda device right after issuing it (outside a capture),
so the copy has read its source and written its destination before the host goes on. That is the
order a host write into a pinned staging buffer after its upload was queued (padding written last,
a buffer reused for the next request) needs to reach the device wrong: the upload has taken the
values from before the write. Undelayed, the host mostly wins that race, and with copies landing
late it always does; so neither shows it. Correct code is unaffected: the host only waits more.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from pytest_graphmode.runtime.backends import cuda_captures, cuda_threads, footprint
from pytest_graphmode.runtime.backends.cuda_races import InflightCopies, stream_name
from pytest_graphmode.runtime.backends.guarded_mode import GuardedOnceCompiling
from pytest_graphmode.runtime.backends.host_copies import copy_device, host_end
from pytest_graphmode.runtime.backends.replacing import replacing

# The delays' own frames issue the copies they note: the program's line is the caller's.
footprint.hide_file(__file__)


def async_copy_device(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> torch.device | None:
    """The cuda device whose current stream runs `func(*args, **kwargs)`, when that is a
    non-blocking copy between host memory and a cuda device; None for anything else."""
    return copy_device(func, args, kwargs, non_blocking=True)


class StreamsMet:
    """The most distinct streams any delayed scope given this count has met (0: none yet), for
    the scopes of later steps of the same runner to take `held_stream` modulo (module
    docstring)."""

    def __init__(self) -> None:
        self.most = 0

    def held(self, held_stream: int | None) -> int | None:
        """The place of the stream a scope holds back alone for `held_stream`."""
        if held_stream is None or not self.most:
            return held_stream
        return held_stream % self.most


@contextmanager
def delayed_streams(
    cycles: int,
    hold_cycles: int = 0,
    held_stream: int | None = None,
    met: StreamsMet | None = None,
    inflight: InflightCopies | None = None,
) -> Iterator[None]:
    """Delay every asynchronous host copy and event record, and the work the block queues on a
    stream it enters (`with torch.cuda.stream(side):`), by a sleep kernel on its own stream while
    the block runs, `hold_cycles` long where that stream is not already held back, else `cycles`
    long; with `held_stream`, only on the step's `held_stream`-th stream, modulo the streams
    earlier scopes given `met` met (module docstring). `inflight`: told of every such copy
    between pinned host memory and the device, and of every operation the host runs, so that it
    finds host accesses to a copy's bytes while the copy is in flight (cuda_races.py). Torch is
    as it was after the block, also when it raises."""
    sleeps = _Sleeps("delayed_streams", cycles, hold_cycles, held_stream, met)
    with (
        _counting_captures(sleeps.captures),
        _delayed_event_records(sleeps),
        _noting_entered_streams(sleeps),
        _noting_replayed_copies(sleeps.captures, inflight),
        _AsyncCopies(sleeps.captures, sleeps, inflight=inflight),
    ):
        yield


@contextmanager
def landed_copies() -> Iterator[None]:
    """Make every non-blocking copy between host memory and a cuda device that the block issues
    land before the block goes on: the stream it was issued on is synchronized right after it,
    unless a capture is underway (module docstring). Nothing is delayed. Torch is as it was after
    the block, also when it raises."""
    captures = _Captures()
    with _counting_captures(captures), _AsyncCopies(captures, landing=True):
        yield


@contextmanager
def delayed_compute(
    cycles: int,
    hold_cycles: int = 0,
    held_stream: int | None = None,
    met: StreamsMet | None = None,
    inflight: InflightCopies | None = None,
) -> Iterator[None]:
    """Delay the block's computation: a sleep kernel on the current stream on entry (the eager
    kernels queued after it wait for it) and ahead of every `torch.cuda.CUDAGraph.replay` on the
    stream it replays on, as long as `delayed_streams`'s and on the same streams; copies and
    event records are not delayed, though a copy queued behind a sleep waits for it.
    `inflight`: as for `delayed_streams`. Torch is as it was after the block, also when it
    raises."""
    sleeps = _Sleeps("delayed_compute", cycles, hold_cycles, held_stream, met)
    sleeps.on(None)
    # None: the current stream, which the graph replays on.
    with (
        _counting_captures(sleeps.captures),
        _sleeping_before(torch.cuda.CUDAGraph, "replay", sleeps, lambda graph: None),
        _noting_replayed_copies(sleeps.captures, inflight),
        _AsyncCopies(sleeps.captures, inflight=inflight) if inflight is not None else nullcontext(),
    ):
        yield


class _Sleeps:
    """The sleeps of one delayed scope: `hold` cycles on a stream no earlier long sleep of the
    scope still holds back, `cycles` on one it does; with `held_stream`, none on any stream but
    the scope's `held_stream`-th."""

    def __init__(
        self,
        scope: str,
        cycles: int,
        hold_cycles: int,
        held_stream: int | None = None,
        met: StreamsMet | None = None,
    ) -> None:
        if cycles < 1:
            raise ValueError(f"{scope}(cycles={cycles}): cycles must be >= 1")
        if hold_cycles < 0:
            raise ValueError(f"{scope}(hold_cycles={hold_cycles}): hold_cycles must be >= 0")
        if held_stream is not None and held_stream < 0:
            raise ValueError(f"{scope}(held_stream={held_stream}): held_stream must be >= 0")
        self.cycles, self.hold = cycles, max(cycles, hold_cycles)
        self.met = StreamsMet() if met is None else met
        self.held_stream = self.met.held(held_stream)
        self._order: dict[Any, int] = {}  # stream -> its place among the scope's streams
        self._holding: dict[Any, Any] = {}  # stream -> an event past its last long sleep
        # Streams the block entered that no operation was queued on since (`entered_stream`).
        self.entered: set[Any] = set()
        self.captures = _Captures()
        self._busy = threading.local()  # set while `on` runs: its own stream switches

    def entered_stream(self, stream: Any) -> None:
        """The block made `stream` current (`with torch.cuda.stream(stream):`): the first
        operation queued on it sleeps first (`first_on_entered`). Not the scope's own switches."""
        if not getattr(self._busy, "on", False):
            self.entered.add(stream)

    def first_on_entered(self) -> None:
        """An operation is queued on the current stream: a sleep first, if the block entered that
        stream and queued nothing on it since."""
        stream = _resolved(None)
        if stream in self.entered:
            self.entered.discard(stream)
            self.on(stream)

    def on(self, stream: Any) -> None:
        """A sleep on `stream` (None: the current stream), if the scope holds that stream back."""
        self._busy.on = True
        try:
            self._sleep(stream)
        finally:
            self._busy.on = False

    def _sleep(self, stream: Any) -> None:
        if self.captures.underway(stream):
            # A sleep on the capturing stream would be recorded into the graph and replayed every
            # time, and asking whether an event has completed would end the capture with an error.
            return
        resolved = _resolved(stream)
        place = self._order.setdefault(resolved, len(self._order))
        self.met.most = max(self.met.most, place + 1)  # for later scopes: this one's is set
        if self.held_stream is not None and place != self.held_stream:
            return
        held = self._holding.get(resolved)
        if self.hold == self.cycles or (held is not None and not held.query()):
            _sleep_on(stream, self.cycles)
            return
        _sleep_on(stream, self.hold)
        self._holding[resolved] = _passed(resolved)


def _noting_entered_streams(sleeps: _Sleeps) -> AbstractContextManager[None]:
    """`torch.cuda.StreamContext.__enter__` replaced for the block by one that first tells
    `sleeps` which stream it enters (unless None or current already). The sleep waits for the
    first operation queued there: a stream entered to capture a graph (`torch.cuda.graph` enters
    its capture stream before the capture begins) then queues nothing outside the capture."""

    def note(context: Any) -> None:
        stream = context.stream
        if stream is not None and stream != _resolved(None):
            sleeps.entered_stream(stream)

    return _run_first(torch.cuda.StreamContext, "__enter__", note)


def _resolved(stream: Any) -> Any:
    return torch.cuda.current_stream() if stream is None else stream


def _passed(stream: Any) -> Any:
    """An event recorded on `stream` now, by the recording `torch.cuda.Event.record` wraps (the
    scope's own delayed one would sleep first)."""
    event = torch.cuda.Event()
    torch._C._CudaEventBase.record(event, stream)
    return event


@functools.cache
def sleep_cycles_per_second(device: int) -> float:
    """How many cycles of `torch.cuda._sleep` pass in a second on cuda device `device`, timed once
    per process (the sleep counts the SM clock, whose rate the driver may change: a delay sized
    with this is an estimate, which its callers pad)."""
    cycles = 20_000_000
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)  # the kernel loaded before the timing
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)


class _AsyncCopies(GuardedOnceCompiling):
    def __init__(
        self,
        captures: _Captures,
        sleeps: _Sleeps | None = None,
        *,
        landing: bool = False,
        inflight: InflightCopies | None = None,
    ) -> None:
        """`captures`: the scope's, while one is underway copies are left as they are;
        `sleeps`: the delays' sleeps ahead of the copies (None: none); `landing`: wait for each
        copy right after issuing it (`landed_copies`); `inflight`: told of each copy and each
        host operation (`delayed_streams`)."""
        super().__init__()
        self.captures = captures
        self.sleeps = sleeps
        self.landing = landing
        self.inflight = inflight

    def __enter__(self) -> _AsyncCopies:
        super().__enter__()
        # The runner's own threads hand their operations to this scope too (cuda_threads.py).
        self._followed = cuda_threads.scope_entered(self)
        self._followed.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._followed.__exit__(None, None, None)
        finally:
            super().__exit__(*exc)

    def dispatch(
        self, func: Any, types: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        with cuda_threads.judged_one_at_a_time():
            return self.run(func, args, kwargs)

    def run(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        sleeps = self.sleeps
        if sleeps is not None and sleeps.entered:
            sleeps.first_on_entered()
        device = async_copy_device(func, args, kwargs)
        inflight = self.inflight
        if device is None:
            if inflight is not None and inflight.pending:
                self._judge_host_access(inflight, func, args, kwargs)
            return func(*args, **kwargs)
        stream = _current_stream(device)
        if sleeps is not None:
            sleeps.on(stream)
        result = func(*args, **kwargs)
        if (self.landing or inflight is not None) and not self.captures.underway(stream):
            if self.landing:
                _wait_for(stream)
            if inflight is not None:
                host, upload = host_end(func, args, result)
                inflight.queued(host, stream, upload, str(func.overloadpacket))
        return result

    def _judge_host_access(
        self, inflight: InflightCopies, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        """Tell `inflight` of `func`, about to run: a host operation, or a blocking copy between
        host and device, which touches its host end as the host does, in its stream's order."""
        device = copy_device(func, args, kwargs, non_blocking=False)
        if device is None:
            inflight.host_operation(func, args, kwargs, lambda: self.captures.underway(None))
            return
        stream = _current_stream(device)
        if self.captures.underway(stream):
            return
        if func is torch.ops.aten._to_copy.default and args[0].device.type != "cpu":
            return  # a download into a tensor it makes: no bytes anything else holds
        host, upload = host_end(func, args, None)
        inflight.blocking_copy(host, upload, str(func.overloadpacket), stream_name(stream))


class _Captures:
    """The CUDA graph captures of one scope: how many it began (`_counting_captures`) and has not
    ended yet."""

    def __init__(self) -> None:
        self.begun = 0

    def underway(self, stream: Any) -> bool:
        """Whether a capture is underway: one the scope began, or one on `stream` (None: the
        current stream)."""
        return self.begun > 0 or _capturing(stream)


@contextmanager
def _counting_captures(captures: _Captures) -> Iterator[None]:
    """`torch.cuda.CUDAGraph.capture_begin` and `capture_end` replaced for the block by calls that
    count the captures underway in `captures` (a capture that failed to begin is not counted;
    one whose end fails still ends). Put back as `_run_first` puts back."""

    def begin(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            captures.begun += 1
            return result

        return counted

    def end(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                # not below 0: a capture begun before the scope may end inside it
                captures.begun = max(0, captures.begun - 1)

        return counted

    with (
        replacing(torch.cuda.CUDAGraph, "capture_begin", begin),
        replacing(torch.cuda.CUDAGraph, "capture_end", end),
    ):
        yield


def _noting_replayed_copies(
    captures: _Captures, inflight: InflightCopies | None
) -> AbstractContextManager[None]:
    """`torch.cuda.CUDAGraph.replay` replaced for the block by one that, once the graph is
    replayed, notes the copies of pinned memory it captured in `inflight` (cuda_captures.py), on
    the stream it replayed on; nothing while a capture is underway. Put back as `replacing`
    puts back; nothing replaced without `inflight`."""
    if inflight is None:
        return nullcontext()

    def wrap(replay: Callable[..., Any]) -> Callable[..., Any]:
        def replayed(graph: Any, *args: Any, **kwargs: Any) -> Any:
            result = replay(graph, *args, **kwargs)
            if cuda_captures.captured_copies(graph) and not captures.underway(None):
                with cuda_threads.judged_one_at_a_time():
                    cuda_captures.note_replayed(graph, inflight, torch.cuda.current_stream())
            return result

        return replayed

    return replacing(torch.cuda.CUDAGraph, "replay", wrap)


def _delayed_event_records(sleeps: _Sleeps) -> AbstractContextManager[None]:
    # The stream an event is recorded on: the one passed, or (None) the current stream.
    def stream(event: Any, stream: Any = None) -> Any:
        return stream

    return _sleeping_before(torch.cuda.Event, "record", sleeps, stream)


def _sleeping_before(
    owner: type, name: str, sleeps: _Sleeps, stream: Callable[..., Any]
) -> AbstractContextManager[None]:
    """`owner.name` replaced for the block by a call that first sleeps on `stream(*arguments)`
    (None: the current stream) (`_run_first`)."""
    return _run_first(owner, name, lambda *args, **kwargs: sleeps.on(stream(*args, **kwargs)))


def _run_first(
    owner: type, name: str, first: Callable[..., object]
) -> AbstractContextManager[None]:
    """`owner.name` replaced for the block by a call that first calls `first` with the same
    arguments (`replacing`)."""

    def then(original: Callable[..., Any]) -> Callable[..., Any]:
        def replaced(*args: Any, **kwargs: Any) -> Any:
            first(*args, **kwargs)
            return original(*args, **kwargs)

        return replaced

    return replacing(owner, name, then)


def _current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device)


def _capturing(stream: Any) -> bool:
    """Whether `stream` (None: the current stream) is capturing a CUDA graph."""
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


def _wait_for(stream: Any) -> None:
    """The host waits until everything queued on `stream` has run."""
    stream.synchronize()


def _sleep_on(stream: Any, cycles: int) -> None:
    """A sleep kernel on `stream` (None: the current stream), which the caller has found not
    capturing."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
