"""Threads started while a backend is active run their whole life inside the backend's context.

torch keeps its dispatch modes per thread, so a backend whose modes must see a runner's own
threads (the sim's, sim/threads.py; the cuda delays', cuda_threads.py) has each thread started
meanwhile enter them itself, around its `run`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


class LiveThreads:
    """How many threads started under `run_new_threads_in` are still running, and a lock for
    what they share with the thread that started them."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.alive = 0

    def started(self) -> None:
        with self.lock:
            self.alive += 1

    def ended(self) -> None:
        with self.lock:
            self.alive -= 1


def run_new_threads_in(
    context: Callable[[], AbstractContextManager[Any]], threads: LiveThreads
) -> Callable[[], None]:
    """Until the returned call, `threading.Thread.start` runs each new thread's `run` inside
    `context()`, counted in `threads` from its start until it ended (or failed to start).
    Returns what puts the original `Thread.start` back."""
    original = threading.Thread.start
    started, ended = threads.started, threads.ended

    def start(self: threading.Thread) -> None:
        run = self.run

        def run_inside() -> None:
            try:
                with context():
                    run()
            finally:
                ended()

        started()
        self.run = run_inside  # type: ignore[method-assign]
        try:
            original(self)
        except BaseException:
            self.run = run  # type: ignore[method-assign]
            ended()
            raise

    threading.Thread.start = start  # type: ignore[method-assign]

    def restore() -> None:
        threading.Thread.start = original  # type: ignore[method-assign]

    return restore
