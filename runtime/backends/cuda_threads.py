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
steps. A thread started before the backend was activated is not followed. The same activation
has captures watched for the copies of pinned memory a graph replays (cuda_captures.py).

The bookkeeping of the scope (its sleeps, the copies in flight) is one state for all threads:
while a followed thread is alive, a scope's operations, from any thread, are judged one at a time
under one lock (`judged_one_at_a_time`). The threads' host sides count as one host, as on a GPU
only completion, not program order, says whether a copy was still in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

from pytest_graphmode.runtime.backends import cuda_captures
from pytest_graphmode.runtime.backends.guarded_mode import GuardedOnceCompiling
from pytest_graphmode.runtime.backends.new_threads import LiveThreads, run_new_threads_in


class Scope(Protocol):
    """A delayed scope's dispatch mode, as a followed thread hands it an operation (its
    `GuardedOnceCompiling.dispatch`: the follower applied the compile guard already)."""

    def dispatch(
        self, func: Any, types: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any: ...


class _Following(LiveThreads):
    """Process-wide: how often the backend is active, the scopes underway, the followed threads
    still running (`alive`)."""

    def __init__(self) -> None:
        super().__init__()
        self.activations = 0
        self.scopes: list[Scope] = []  # entered, innermost last
        self.restore: Callable[[], None] | None = None


_FOLLOWING = _Following()
_UNLOCKED = nullcontext()  # reusable: asked for on every operation of a delayed scope


def activate() -> None:
    """Follow the threads started from now on, and watch the captures for copies of host memory
    (cuda_captures.py), until the matching `deactivate()`; calls nest."""
    following = _FOLLOWING
    with following.lock:
        if following.activations == 0:
            unfollow, unwatch = _follow_new_threads(), cuda_captures.watch_captures()

            def restore() -> None:
                unwatch()
                unfollow()

            following.restore = restore
        following.activations += 1


def deactivate() -> None:
    """End an `activate()`: after the last one, threads started are no longer followed (those
    already started stay followed for their life) and captures no longer watched."""
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
    return _FOLLOWING.lock if _FOLLOWING.alive else _UNLOCKED


def followed_threads() -> int:
    """How many followed threads are still running."""
    return _FOLLOWING.alive


def _follow_new_threads() -> Callable[[], None]:
    """`threading.Thread.start` replaced by one that runs the thread under a `_FollowerMode`,
    counted alive meanwhile; returns what puts the original back."""
    return run_new_threads_in(_FollowerMode, _FOLLOWING)


class _FollowerMode(GuardedOnceCompiling):
    """A followed thread's mode: each operation to the scope underway, else as it is."""

    def dispatch(
        self, func: Any, types: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        try:
            scope = _FOLLOWING.scopes[-1]
        except IndexError:  # no scope underway
            return func(*args, **kwargs)
        return scope.dispatch(func, types, args, kwargs)
