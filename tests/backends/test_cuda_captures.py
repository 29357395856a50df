"""The capture watch of the cuda backend (runtime/backends/cuda_captures.py), judged on the CPU
with stand-ins for `torch.cuda.CUDAGraph`: the mode pushed at `capture_begin` is popped at
`capture_end`, and a graph keeps what its capture saw. The copies themselves need a GPU
(tests/fuzz/test_inflight_copies_cuda.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pytest_graphmode.runtime.backends import cuda_captures


class _Calls:
    """The capture calls of a stand-in graph, noted (no `__dict__`, no weak references)."""

    __slots__ = ()
    calls: list[str]

    def __init__(self) -> None:
        self.calls = []

    def capture_begin(self, *args: object, **kwargs: object) -> None:
        self.calls.append("begin")

    def capture_end(self) -> None:
        self.calls.append("end")

    def reset(self) -> None:
        self.calls.append("reset")


class _Graph(_Calls):
    """As `torch.cuda.CUDAGraph`: takes weak references."""


class _SlottedGraph(_Calls):
    """A runner's own graph class that takes no weak references."""

    __slots__ = ("calls",)


def _modes() -> int:
    return torch._C._len_torch_dispatch_stack()


def _watched(monkeypatch: pytest.MonkeyPatch, graph_class: type) -> Iterator[None]:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph_class)
    restore = cuda_captures.watch_captures()
    yield
    restore()


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield from _watched(monkeypatch, _Graph)


@pytest.fixture
def watched_slotted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield from _watched(monkeypatch, _SlottedGraph)


def test_a_capture_is_watched_from_its_begin_to_its_end_and_the_graph_keeps_what_it_saw(
    watched, monkeypatch
):
    # Without a GPU a host-to-host copy stands in for an upload: the copies' own ends need one.
    def upload_from_source(func, args, kwargs, result):
        return (args[1], True) if func is torch.ops.aten.copy_.default else None

    monkeypatch.setattr(cuda_captures, "_host_end", upload_from_source)
    graph, before = _Graph(), _modes()
    staging, static = torch.ones(4), torch.zeros(4)
    graph.capture_begin(capture_error_mode="global")
    assert _modes() == before + 1
    torch.ones(2).add_(1)  # no copy: nothing kept
    static.copy_(staging)
    graph.capture_end()
    assert _modes() == before
    assert graph.calls == ["begin", "end"]
    (copy,) = cuda_captures.captured_copies(graph)
    assert copy.host() is staging and copy.upload
    assert copy.op.startswith("aten.copy_ (host to device, captured at tests/backends/")
    assert copy.op.endswith(", replayed)")


def test_a_reset_ends_the_watch_of_a_capture_never_ended_and_forgets_what_the_graph_kept(
    watched, monkeypatch
):
    monkeypatch.setattr(cuda_captures, "_host_end", lambda func, args, kwargs, result: None)
    graph, before = _Graph(), _modes()
    graph.capture_begin()  # a raw capture the runner gives up on with reset() alone
    graph.reset()
    assert _modes() == before and graph.calls == ["begin", "reset"]
    kept = cuda_captures.CapturedCopy(lambda: None, True, "a copy")  # type: ignore[arg-type]
    cuda_captures._CAPTURED[graph] = [kept]
    graph.reset()
    assert list(cuda_captures.captured_copies(graph)) == []


def test_a_reset_leaves_a_mode_pushed_after_the_capture_where_it_is(watched):
    graph, before = _Graph(), _modes()
    graph.capture_begin()
    try:
        with torch.utils._python_dispatch.TorchDispatchMode():
            graph.reset()  # the runner's mode is innermost: popping the capture's would pop it
            assert _modes() == before + 2
        assert _modes() == before + 1
    finally:  # what the capture left pushed, cleaned up for the next test, pass or fail
        while _modes() > before:
            torch.utils._python_dispatch._pop_mode()


def test_a_graph_without_weak_references_still_ends_its_capture(watched_slotted):
    graph, before = _SlottedGraph(), _modes()
    graph.capture_begin()
    graph.capture_end()
    assert graph.calls == ["begin", "end"] and _modes() == before
    assert list(cuda_captures.captured_copies(graph)) == []  # unwatched, not an error


def test_the_watch_puts_the_capture_calls_back(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    calls = ("capture_begin", "capture_end", "reset")
    before = [getattr(_Graph, name) for name in calls]
    restore = cuda_captures.watch_captures()
    assert all(getattr(_Graph, name) is not was for name, was in zip(calls, before, strict=True))
    restore()
    assert [getattr(_Graph, name) for name in calls] == before
