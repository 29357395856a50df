"""Threads a runner starts, on the sim: they see the sim as the thread that activated it does.

torch keeps its dispatch and function modes per thread, so a thread started by a runner (a worker
that prepares the next batch, a thread that waits for a step's download) would see none of the
sim: its operations on device tensors would run as plain CPU work, with no queues, no capture and
no race checks, and a `device="cuda"` factory would ask the host's missing GPU. While the sim is
active, `threading.Thread.start` gives every new thread the sim's two modes for its whole life;
they pass every call through while the sim is not active (a pool's worker outlives the block that
started it).

As on CUDA, the current stream is per thread, and a new thread starts on the default stream. The
sim's bookkeeping is one state shared by all threads: while a thread it started is alive, every
entry into the sim holds one lock, so two threads' operations are judged one after the other
(their host sides count as one host for the race checker).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from pytest_graphmode.runtime.backends.new_threads import run_new_threads_in

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.backend import SimBackend
    from pytest_graphmode.runtime.backends.sim.streams import SimStream

F = TypeVar("F", bound=Callable[..., Any])


class ThreadStreams(threading.local):
    """Each thread's current stream; None: the default stream."""

    current: SimStream | None = None


def serialized(method: F) -> F:
    """A backend method that holds the threads' lock while a thread the sim started is alive."""

    @functools.wraps(method)
    def call(self: SimBackend, *args: Any, **kwargs: Any) -> Any:
        if self.threads.alive:
            with self.threads.lock:
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


def follow_new_threads(backend: SimBackend) -> Callable[[], None]:
    """Make threads started from now on see `backend`'s modes; returns what puts torch's
    `Thread.start` back."""
    return run_new_threads_in(lambda: _follower_modes(backend), backend.threads)


@contextmanager
def _follower_modes(backend: SimBackend) -> Iterator[None]:
    from pytest_graphmode.runtime.backends.sim.backend import FollowerSimMode
    from pytest_graphmode.runtime.backends.sim.device_mode import FollowerDeviceMode

    device_mode = FollowerDeviceMode(backend)
    with device_mode, FollowerSimMode(backend, device_mode):
        yield
