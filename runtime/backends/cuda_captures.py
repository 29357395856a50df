"""Copies between pinned host memory and the device that a CUDA graph captured (cuda).

A graph that captured `static.copy_(pinned, non_blocking=True)` reads `pinned` at every replay,
when the replay runs on the device, not when it is issued: the host may write those bytes again
only once the replay has completed (an event recorded after it, its stream, the device), and may
read the bytes a captured download writes only then. On a GPU such a race shows only as a value,
when the bytes differ. So while the cuda backend is active, every capture is watched
(`watch_captures`): a dispatch mode pushed in the capturing thread from `capture_begin` to
`capture_end` keeps, for the graph, each copy between pinned host memory and a cuda device it
captured (a weak reference to the host tensor: the graph does not keep it alive either). Under
the harness's delays each replay of such a graph notes them in flight (`note_replayed`), with an
event recorded right after the replay on its stream: a host access to their bytes before that
event completed is a race, as for a copy issued eagerly (cuda_races.py).

A runner that records an event of its own after the replay and waits for it before it touches
the bytes is never reported. Unseen: captures begun before the backend was active, or by C++
code, and copies a compiled region makes without the dispatcher.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from pytest_graphmode.runtime.backends import footprint
from pytest_graphmode.runtime.backends.cuda_races import InflightCopies, stream_name
from pytest_graphmode.runtime.backends.guarded_mode import GuardedOnceCompiling
from pytest_graphmode.runtime.backends.host_copies import copy_device, host_end
from pytest_graphmode.runtime.backends.replacing import replacing


@dataclass(frozen=True)
class CapturedCopy:
    """A copy between pinned host memory and a cuda device that a graph captured."""

    host: weakref.ref[torch.Tensor]  # the host end: read by an upload, written by a download
    upload: bool
    op: str  # the operation and where it was captured, as a race report names them


# graph -> the copies it captured; a graph reset or recaptured starts again
_CAPTURED: weakref.WeakKeyDictionary[Any, list[CapturedCopy]] = weakref.WeakKeyDictionary()


def captured_copies(graph: Any) -> Sequence[CapturedCopy]:
    """The copies `graph` captured while captures were watched (none where unwatched, or where
    its class takes no weak references)."""
    try:
        return _CAPTURED.get(graph, ())
    except TypeError:
        return ()


def note_replayed(graph: Any, inflight: InflightCopies, stream: Any) -> None:
    """`graph` was just replayed on `stream`: its captured copies whose host tensors are still
    alive, in pinned memory, are noted in `inflight` until an event recorded now on `stream`
    completes. Pinned memory is asked of here, outside the capture, where the CUDA call that
    tells it cannot upset the capture."""
    copies = [(copy, copy.host()) for copy in captured_copies(graph)]
    alive = [(copy, host) for copy, host in copies if host is not None and host.is_pinned()]
    if not alive:
        return
    done = torch.cuda.Event()
    # The class's own record: the delays replace `torch.cuda.Event.record` with one that sleeps
    # first, and this event must mark the replay's end, not a sleep after it.
    torch._C._CudaEventBase.record(done, stream)
    for copy, host in alive:
        inflight.note(host, copy.upload, done, copy.op, stream_name(stream))


def watch_captures() -> Callable[[], None]:
    """Until the returned call, every `torch.cuda.CUDAGraph` capture keeps the copies between host
    memory and a cuda device it captures (`captured_copies`); `reset()` forgets them, and ends
    the watch of a capture never ended."""
    graph_class = torch.cuda.CUDAGraph
    watching: dict[int, _CaptureCopies] = {}  # id(graph) -> its capture's mode

    def began(begin: Callable[..., Any]) -> Callable[..., Any]:
        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
            result = begin(graph, *args, **kwargs)
            mode = _CaptureCopies()
            mode.__enter__()
            watching[id(graph)] = mode
            return result

        return capture_begin

    def ended(end: Callable[..., Any]) -> Callable[..., Any]:
        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            mode = watching.pop(id(graph), None)
            if mode is not None:
                mode.__exit__(None, None, None)
                # A graph class without weak references (a runner's own, with `__slots__`) is
                # not watched: the capture must end whatever the watching can do.
                with contextlib.suppress(TypeError):
                    _CAPTURED[graph] = mode.copies
            return end(graph, *args, **kwargs)

        return capture_end

    def was_reset(reset: Callable[..., Any]) -> Callable[..., Any]:
        def reset_graph(graph: Any, *args: Any, **kwargs: Any) -> Any:
            # A runner may give up on a failed raw capture with `reset()` alone: the capture's
            # mode is popped here, where it is still the innermost one of this thread (one
            # pushed after it is the runner's, and popping past it would take that one too).
            mode = watching.pop(id(graph), None)
            if mode is not None and _get_current_dispatch_mode() is mode:
                mode.__exit__(None, None, None)
            with contextlib.suppress(TypeError):
                _CAPTURED.pop(graph, None)
            return reset(graph, *args, **kwargs)

        return reset_graph

    watch = contextlib.ExitStack()
    watch.enter_context(replacing(graph_class, "capture_begin", began))
    watch.enter_context(replacing(graph_class, "capture_end", ended))
    watch.enter_context(replacing(graph_class, "reset", was_reset))
    return watch.close


class _CaptureCopies(GuardedOnceCompiling):
    """Keeps the copies between pinned host memory and a cuda device seen during one capture."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[CapturedCopy] = []

    def dispatch(
        self, func: Any, types: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        result = func(*args, **kwargs)
        ends = _host_end(func, args, kwargs, result)
        if ends is not None:
            host, upload = ends
            direction = "host to device" if upload else "device to host"
            where = footprint.format_line(footprint.source_line())
            op = f"{func.overloadpacket} ({direction}, captured at {where}, replayed)"
            self.copies.append(CapturedCopy(weakref.ref(host), upload, op))
        return result


def _host_end(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], result: Any
) -> tuple[torch.Tensor, bool] | None:
    """The host end of `func(*args, **kwargs)` (which returned `result`) and whether it is an
    upload, when that is a copy between host memory and a cuda device; None otherwise."""
    if copy_device(func, args, kwargs, non_blocking=None) is None:
        return None
    return host_end(func, args, result)
