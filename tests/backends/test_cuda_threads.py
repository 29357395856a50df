"""Threads a runner starts while the cuda backend is active hand their operations to the delayed
scope underway (runtime/backends/cuda_threads.py), judged on the CPU: the scope is a recording
stand-in, or the delays' own mode with a copy in flight noted by hand."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import pytest
import torch

from pytest_graphmode.runtime.backends import cuda_threads
from pytest_graphmode.runtime.backends.cuda_races import InflightCopies
from pytest_graphmode.strategies import stream_delays
from tests.backends.test_inflight_copies import _Completion

aten = torch.ops.aten


class _Recording:
    """A delayed scope's stand-in: runs each operation handed to it, noting it and its thread."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, str]] = []

    def dispatch(
        self, func: Any, types: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        self.seen.append((func, threading.current_thread().name))
        return func(*args, **kwargs)


@pytest.fixture
def following() -> Iterator[None]:
    cuda_threads.activate()
    try:
        yield
    finally:
        cuda_threads.deactivate()


def _in_a_thread(work: Callable[[], object], name: str = "runner-thread") -> None:
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # handed to the test's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def test_a_thread_started_while_active_hands_its_operations_to_the_scope_underway(following):
    scope = _Recording()
    with cuda_threads.scope_entered(scope):
        _in_a_thread(lambda: torch.ones(3).add_(1))
    assert (aten.add_.Tensor, "runner-thread") in scope.seen


def test_outside_a_scope_a_followed_threads_operations_run_as_they_are(following):
    scope = _Recording()
    result: list[torch.Tensor] = []
    _in_a_thread(lambda: result.append(torch.ones(3).add_(1)))
    assert result[0].tolist() == [2.0, 2.0, 2.0]
    assert scope.seen == []


def test_a_pool_worker_started_in_one_scope_hands_a_later_scope_its_operations(following):
    ready, go, done = threading.Event(), threading.Event(), threading.Event()

    def worker() -> None:
        ready.set()
        go.wait(5)
        torch.ones(2).mul_(3)
        done.set()

    first, later = _Recording(), _Recording()
    with cuda_threads.scope_entered(first):
        thread = threading.Thread(target=worker, name="pool-worker")
        thread.start()
        ready.wait(5)
    with cuda_threads.scope_entered(later):
        go.set()
        assert done.wait(5)
    thread.join()
    assert (aten.mul_.Tensor, "pool-worker") in later.seen
    assert all(func is not aten.mul_.Tensor for func, _ in first.seen)


def test_a_thread_started_before_the_backend_was_active_is_not_followed():
    go, done = threading.Event(), threading.Event()

    def worker() -> None:
        go.wait(5)
        torch.ones(2).mul_(3)
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    scope = _Recording()
    cuda_threads.activate()
    try:
        with cuda_threads.scope_entered(scope):
            go.set()
            assert done.wait(5)
    finally:
        cuda_threads.deactivate()
    thread.join()
    assert scope.seen == []


def test_activations_nest_and_the_last_one_puts_thread_start_and_the_capture_calls_back():
    graph = torch.cuda.CUDAGraph
    original = (threading.Thread.start, graph.capture_begin, graph.capture_end)
    cuda_threads.activate()
    cuda_threads.activate()
    cuda_threads.deactivate()
    active = (threading.Thread.start, graph.capture_begin, graph.capture_end)
    assert all(now is not before for now, before in zip(active, original, strict=True))
    cuda_threads.deactivate()
    assert (threading.Thread.start, graph.capture_begin, graph.capture_end) == original
    with pytest.raises(RuntimeError, match="without a matching activate"):
        cuda_threads.deactivate()


def test_operations_are_judged_under_one_lock_only_while_a_followed_thread_is_alive(following):
    go = threading.Event()
    thread = threading.Thread(target=lambda: go.wait(5))
    assert isinstance(cuda_threads.judged_one_at_a_time(), nullcontext)
    thread.start()
    assert cuda_threads.followed_threads() == 1
    assert not isinstance(cuda_threads.judged_one_at_a_time(), nullcontext)
    go.set()
    thread.join()
    assert cuda_threads.followed_threads() == 0
    assert isinstance(cuda_threads.judged_one_at_a_time(), nullcontext)


def test_a_followed_threads_write_into_an_upload_in_flight_is_a_race_naming_its_line(
    following, monkeypatch
):
    # The delays' own mode, with an upload noted by hand in place of a GPU's copy.
    monkeypatch.setattr(stream_delays, "_capturing", lambda stream: False)
    inflight, host = InflightCopies(), torch.zeros(8)
    inflight.note(host[:4], True, _Completion(), "aten.copy_ (non-blocking)", "stream #3")
    copies = stream_delays._AsyncCopies(stream_delays._Captures(), inflight=inflight)
    with copies:
        _in_a_thread(lambda: host[2:6].fill_(1.0))  # the thread's write
    (race,) = inflight.take()
    assert (race.later.op, race.later.access) == ("aten.fill_", "write")
    assert race.later.line.startswith("tests/backends/test_cuda_threads.py:")
