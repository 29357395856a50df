"""Threads a runner starts, on cuda: the harness's delays see the operations they run too.

torch keeps its dispatch modes per thread, so the mode of a delayed scope (the harness's cuda
delays, strategies/stream_delays.py), pushed in the thread that runs the step, sees nothing a
runner's own thread does: a worker that uploads the next batch, or one that runs the whole forward
while the scheduler plans the next step (an overlap scheduler). Such a thread's copies would be
neither held back nor noted in flight (cuda_races.py), and its races would show only by luck.

While the cuda backend is active (`activate()`: the twins' life in a campaign), every thread
started gets a `_FollowerMode` for its whole life. It hands each operation of the thread to the
delayed scope underway at that moment (`scope_entered`), if any, and otherwise runs it as it is:
a pool's worker outlives the step that started it, and most of its operations come in unstressed
steps. A thread started before the backend was activated is not followed.

The bookkeeping of the scope (its sleeps, the copies in flight) is one state for all threads:
while a followed thread is alive, a scope's operations, from any thread, are judged one at a time
under one lock (`judged_one_at_a_time`). The threads' host sides count as one host, as on a GPU
only completion, not program order, says whether a copy was still in flight.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Scope(Protocol):
    """A delayed scope's dispatch mode, as a followed thread hands it an operation."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any: ...


class _Following:
    """Process-wide: how often the backend is active, the scopes underway, the threads alive."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.activations = 0
        self.alive = 0  # followed threads still running
        self.scopes: list[Scope] = []  # entered, innermost last
        self.restore: Callable[[], None] | None = None


_FOLLOWING = _Following()


def activate() -> None:
    """Follow the threads started from now on until the matching `deactivate()`; calls nest."""
    following = _FOLLOWING
    with following.lock:
        if following.activations == 0:
            following.restore = _follow_new_threads()
        following.activations += 1


def deactivate() -> None:
    """End an `activate()`: after the last one, threads started are no longer followed (those
    already started stay followed for their life)."""
    following = _FOLLOWING
    with following.lock:
        if following.activations == 0:
            raise RuntimeError("deactivate() without a matching activate()")
        following.activations -= 1
        if following.activations == 0 and following.restore is not None:
            following.restore()
            following.restore = None


@contextmanager
def scope_entered(scope: Scope) -> Iterator[None]:
    """`scope`, a delayed scope's mode, is underway for the block: followed threads hand it their
    operations (the innermost of nested scopes gets them)."""
    scopes = _FOLLOWING.scopes
    with _FOLLOWING.lock:
        scopes.append(scope)
    try:
        yield
    finally:
        with _FOLLOWING.lock:
            scopes.remove(scope)


def judged_one_at_a_time() -> AbstractContextManager[Any]:
    """What a scope holds while it judges an operation: the threads' lock while any followed
    thread is alive, nothing otherwise (a runner without threads pays nothing)."""
    return _FOLLOWING.lock if _FOLLOWING.alive else nullcontext()


def followed_threads() -> int:
    """How many followed threads are still running."""
    return _FOLLOWING.alive


def _follow_new_threads() -> Callable[[], None]:
    """`threading.Thread.start` replaced by one that runs the thread's target under a
    `_FollowerMode`; returns what puts the original back."""
    original = threading.Thread.start
    following = _FOLLOWING

    def start(self: threading.Thread) -> None:
        run = self.run

        def run_followed() -> None:
            try:
                with _FollowerMode():
                    run()
            finally:
                with following.lock:
                    following.alive -= 1

        with following.lock:
            following.alive += 1
        self.run = run_followed  # type: ignore[method-assign]
        try:
            original(self)
        except BaseException:
            self.run = run  # type: ignore[method-assign]
            with following.lock:
                following.alive -= 1
            raise

    threading.Thread.start = start  # type: ignore[method-assign]

    def restore() -> None:
        threading.Thread.start = original  # type: ignore[method-assign]

    return restore


class GuardedOnceCompiling(TorchDispatchMode):
    """A dispatch mode that leaves torch's compile guard to its `__torch_dispatch__`, which is to
    apply it only once the compiler stack is imported, and that Dynamo does not trace into."""

    # torch keeps torch.compile out of a mode's frames by wrapping `__torch_dispatch__` in a guard
    # whose first call imports its whole compiler stack (about a second, and some 300,000 objects
    # that every later full collection walks). Nothing can be compiling while that stack is not
    # imported, so the guard is needed only once it is: `__torch_dispatch__` checks, per call.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    # While Dynamo traces, a mode it does not ignore is traced into, and the guard above is a
    # graph break there: a runner's `torch.compile(fullgraph=True)` would fail under the mode.
    # Ignored, the mode is off while compiling and on again while the compiled code runs.
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class _FollowerMode(GuardedOnceCompiling):
    """A followed thread's mode: each operation to the scope underway, else as it is."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        try:
            scope = _FOLLOWING.scopes[-1]
        except IndexError:  # no scope underway
            if "torch._dynamo" in sys.modules:
                return _run_unseen_by_compiler(func, args, kwargs or {})
            return func(*args, **(kwargs or {}))
        return scope.__torch_dispatch__(func, types, args, kwargs)


def _run(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    return func(*args, **kwargs)


# torch's own guard, as it would have wrapped `__torch_dispatch__` (its import is lazy too).
_run_unseen_by_compiler = torch._disable_dynamo(_run, recursive=True)
