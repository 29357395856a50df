"""Delays on every stream a runner uses (cuda): asynchronous copies and event records land late,
or a step's computation does.

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

So a copy out of a pinned staging buffer reads it only after the host has moved on, a download into
pinned memory is not there yet when the host reads it without waiting, and an event completes late:
host-staging races and missing waits show as wrong values. Correct code (an event recorded after
the copy and waited on before the buffer is written again or the result is read) stays correct,
only slower.

Nothing is delayed inside a CUDA graph capture: a sleep issued on a capturing stream would be
recorded into the graph and replayed on every later replay, long after the stressed step. Captured
copies and records are left as they are (their timing is the replay's).

A race has two orders, and copies landing late show only one: work that needs a copy runs before
it. The other (a copy that overwrites what earlier work still reads: the next step's upload into
the static buffers a replay or an eager forward has not read yet) shows only when that work is late
instead. `delayed_compute(cycles)` enqueues the sleep kernel on the current stream as the step
begins, so the eager kernels the step queues there run late, and again ahead of every
`torch.cuda.CUDAGraph.replay`, on the stream it replays on, so a replay is late even after the
host has waited for that stream or on a stream of its own; copies and event records are left
undelayed. The replay's class attribute is replaced and put back as `Event.record` is. Eager
kernels queued after the host waited for the current stream inside the step (an `.item()`, a
blocking download) are not delayed, nor are eager kernels on side streams.

Scope: the copies are seen by a `TorchDispatchMode` pushed on entry and popped on exit, so modes
the runner enters inside the scope see the operations before it, as usual. `torch.cuda.Event.record`
is replaced on the class for the scope and the exact attribute it had is put back on exit, also
when the step raises; since it is a class attribute, other threads recording events during the
scope are delayed too. Not covered: `torch.Event` / `torch.Stream` (the device-generic classes,
recorded in C++ without a Python hook), device-to-device copies, kernels on side streams not
followed by a copy or an event record, and copies issued by C++ code that bypasses the dispatcher.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def async_copy_device(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> torch.device | None:
    """The cuda device whose current stream runs `func(*args, **kwargs)`, when that is a
    non-blocking copy between host memory and a cuda device; None for anything else."""
    if func is torch.ops.aten.copy_.default:
        destination, source = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        ends = (destination.device, source.device)
    elif func is torch.ops.aten._to_copy.default:
        source = args[0]
        non_blocking = kwargs.get("non_blocking", False)
        target = kwargs.get("device")
        ends = (source.device, source.device if target is None else torch.device(target))
    else:
        return None
    return crossing_device(*ends) if non_blocking else None


def crossing_device(one: torch.device, other: torch.device) -> torch.device | None:
    """The cuda end of a copy between host memory and a cuda device; None for any other pair."""
    kinds = {one.type, other.type}
    if kinds != {"cpu", "cuda"}:
        return None
    return one if one.type == "cuda" else other


@contextmanager
def delayed_streams(cycles: int) -> Iterator[None]:
    """Delay every asynchronous host copy and event record by a `cycles`-long sleep kernel on its
    own stream while the block runs; torch is as it was after the block, also when it raises."""
    if cycles < 1:
        raise ValueError(f"delayed_streams(cycles={cycles}): cycles must be >= 1")
    with _delayed_event_records(cycles), _DelayedCopies(cycles):
        yield


@contextmanager
def delayed_compute(cycles: int) -> Iterator[None]:
    """Delay the block's computation: a `cycles`-long sleep kernel on the current stream on entry
    (the eager kernels queued after it wait for it) and ahead of every
    `torch.cuda.CUDAGraph.replay` on the stream it replays on; copies and event records are not
    delayed. Torch is as it was after the block, also when it raises."""
    if cycles < 1:
        raise ValueError(f"delayed_compute(cycles={cycles}): cycles must be >= 1")
    _sleep_on(None, cycles)
    # None: the current stream, which the graph replays on.
    with _sleeping_before(torch.cuda.CUDAGraph, "replay", cycles, lambda graph: None):
        yield


class _DelayedCopies(TorchDispatchMode):
    # torch keeps torch.compile out of a mode's frames by wrapping `__torch_dispatch__` in a guard
    # whose first call imports its whole compiler stack (about a second, and some 300,000 objects
    # that every later full collection walks). Nothing can be compiling while that stack is not
    # imported, so the guard is needed only once it is: `__torch_dispatch__` checks, per call.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if "torch._dynamo" in sys.modules:
            return _delay_unseen_by_compiler(self, func, args, kwargs or {})
        return self.delay_then_run(func, args, kwargs or {})

    def delay_then_run(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        device = async_copy_device(func, args, kwargs)
        if device is not None:
            _sleep_on(_current_stream(device), self.cycles)
        return func(*args, **kwargs)


# torch's own guard, as it would have wrapped `__torch_dispatch__` (its import is lazy too).
_delay_unseen_by_compiler = torch._disable_dynamo(_DelayedCopies.delay_then_run, recursive=True)


def _delayed_event_records(cycles: int) -> AbstractContextManager[None]:
    # The stream an event is recorded on: the one passed, or (None) the current stream.
    def stream(event: Any, stream: Any = None) -> Any:
        return stream

    return _sleeping_before(torch.cuda.Event, "record", cycles, stream)


@contextmanager
def _sleeping_before(
    owner: type, name: str, cycles: int, stream: Callable[..., Any]
) -> Iterator[None]:
    """`owner.name` replaced for the block by a call that first sleeps `cycles` on
    `stream(*arguments)` (None: the current stream); on exit, also when the block raises, the
    exact attribute `owner` had is put back (or removed, where it inherited it)."""
    owned = name in vars(owner)
    before = vars(owner).get(name)
    original = getattr(owner, name)  # what an instance resolves today, inherited or not

    def delayed(*args: Any, **kwargs: Any) -> Any:
        _sleep_on(stream(*args, **kwargs), cycles)
        return original(*args, **kwargs)

    setattr(owner, name, delayed)
    try:
        yield
    finally:
        if owned:
            setattr(owner, name, before)
        else:
            delattr(owner, name)


def _current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device)


def _sleep_on(stream: Any, cycles: int) -> None:
    """A sleep kernel on `stream` (None: the current stream), unless that stream is capturing."""
    with torch.cuda.stream(stream):
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda._sleep(cycles)
