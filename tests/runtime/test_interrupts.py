"""An interrupt anywhere in `step()` leaves the runtime as if the step never started, also in a
step coordinated with other data-parallel ranks.

A KeyboardInterrupt is raised at the k-th interruption point of a step that captures its graph
(staging, warm-up, capture, replay, sampling), for every k from the step's first point to its
last. The points are every ATen operation the runtime issues, and the moments before and after
each call it makes into the device (streams, events, capture, replay), into graph memory (views)
and into the collectives of a data-parallel step: a Ctrl-C that arrives while the host waits in
such a call surfaces when it returns. The sim's own operations (queued device work, its checks)
are no points: on a GPU that is device work, which an interrupt of the host never stops half way.

After each interrupt the target holds no new graph, pool view, failed key or count, and no device
work is left unordered on a side stream; the retried step then gives what a target that was never
interrupted gives, bit for bit, with the same KV cache, static buffers and graphs, and so does a
replay of the graph it kept.

Attempt k reruns the step up to point k, so a step of n points costs about n**2 / 2 points. To keep
that affordable the decoder has one layer (every kind of operation, a third fewer points than two),
each case's reference runs once per process, and each case's points are split into parts of equal
cost that pytest-xdist can run side by side.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from runtime_helpers import make_batch

from pytest_graphmode import Batch, StepResult
from pytest_graphmode.runtime.data_parallel import DataParallel, joined
from pytest_graphmode.runtime.model import DecoderConfig
from pytest_graphmode.runtime.target import RuntimeTarget, make_target

CONFIG = replace(DecoderConfig.tiny(), layers=1)
HISTORY = make_batch([1], context=2, first_block=40, config=CONFIG)
PARTS = 2  # per case: enough for two workers to share the three cases evenly


@dataclass(frozen=True)
class Case:
    piecewise: bool
    batch: Batch
    ranks: int


CASES = {
    "full-graph": Case(False, make_batch([1, 1], context=3, config=CONFIG), 1),
    "piecewise-graph": Case(True, make_batch([3, 1], context=2, config=CONFIG), 1),
    "full-graph-data-parallel": Case(False, make_batch([1, 1], context=3, config=CONFIG), 2),
}

# The sim backend's entry points for device work: every stream, event, capture and replay call of
# the runtime ends in one of them.
_DEVICE_CALLS = (
    "synchronize",
    "stream_synchronize",
    "stream_wait_event",
    "stream_query",
    "event_record",
    "event_query",
    "event_synchronize",
    "host_read",
    "_begin_capture",
    "_end_capture",
    "_launch",
)
_MEMORY_CALLS = ("pool_for", "captured", "discard")


class _Interrupter:
    """Numbers the interruption points of a step and raises KeyboardInterrupt at point `at`
    (never when 0); `labels`, when a list, collects what each point was."""

    def __init__(self) -> None:
        self.at = 0
        self.seen = 0
        self.labels: list[str] | None = None

    def arm(self, at: int) -> None:
        self.at, self.seen = at, 0

    def point(self, label: object) -> None:
        """One point; `label` (a string, or an ATen operation) says which."""
        self.seen += 1
        if self.labels is not None:
            self.labels.append(str(label))
        if self.seen == self.at:
            raise KeyboardInterrupt(f"injected at point {self.seen}: {label}")


class _Mirrored(DataParallel):
    """Rank 0 of two whose peer contributes whatever rank 0 does: coordination, no processes.
    Each collective is a point of `interrupter`, when one is set."""

    interrupter: _Interrupter | None = None

    def all_gather(self, row: list[int]) -> list[list[int]]:
        if self.interrupter is not None:
            self.interrupter.point("before all_gather")
        rows = [list(row) for _ in range(self.world_size)]
        if self.interrupter is not None:
            self.interrupter.point("after all_gather")
        return rows


def _around(interrupter: _Interrupter, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def with_points(*args: Any, **kwargs: Any) -> Any:
        interrupter.point(f"before {name}")
        result = call(*args, **kwargs)
        interrupter.point(f"after {name}")
        return result

    return with_points


@contextmanager
def _points(
    target: RuntimeTarget, interrupter: _Interrupter, member: DataParallel | None
) -> Iterator[None]:
    """Route `target`'s operations, device calls, memory calls and collectives through
    `interrupter` (instance attributes shadow the methods, and go when the block ends)."""
    backend: Any = target.executor.backend
    memory: Any = target.executor._memory
    dispatch = backend._dispatch

    def operation(func: Any, args: Any, kwargs: Any, mode: Any) -> Any:
        if not backend._passthrough:  # the sim's own work, not the runtime's
            interrupter.point(func)
        return dispatch(func, args, kwargs, mode)

    patched: list[tuple[object, str]] = []
    try:
        backend._dispatch = operation
        patched.append((backend, "_dispatch"))
        for owner, names in ((backend, _DEVICE_CALLS), (memory, _MEMORY_CALLS)):
            for name in names:
                setattr(owner, name, _around(interrupter, name, getattr(owner, name)))
                patched.append((owner, name))
        if isinstance(member, _Mirrored):
            member.interrupter = interrupter
        yield
    finally:
        for owner, name in patched:
            delattr(owner, name)
        if isinstance(member, _Mirrored):
            member.interrupter = None


def _make(case: Case, member: DataParallel | None) -> RuntimeTarget:
    def make() -> RuntimeTarget:
        return make_target(
            "graph",
            seed=1,
            backend="sim",
            config=CONFIG,
            capture_sizes=[1, 2],
            max_num_reqs=4,
            max_num_tokens=8,
            piecewise=case.piecewise,
        )

    if member is None:
        return make()
    with joined(member):
        return make()


def _member(case: Case) -> DataParallel | None:
    return _Mirrored(0, case.ranks) if case.ranks > 1 else None


def _bookkeeping(target: RuntimeTarget) -> dict[str, Any]:
    executor = target.executor
    stats = executor.stats()
    return {
        "graphs": executor.graphs,
        "failed": executor.failed,
        "views": [(v.graph_key, v.size) for v in target.address_views()],
        "steps": dict(stats.steps),
        "counts": (stats.hits, stats.captures, stats.failed_captures, dict(stats.replays)),
        "dispatched": (dict(executor.dispatcher.by_key), dict(executor.dispatcher.by_cause)),
    }


def _tensors(target: RuntimeTarget) -> dict[str, torch.Tensor]:
    """KV cache and static buffers as bytes, so NaN payloads compare too."""
    found = {**target.state(), **target.static_buffers()}
    return {name: t.view(torch.uint8).clone() for name, t in found.items()}


def _assert_nothing_left_queued(target: RuntimeTarget) -> None:
    backend: Any = target.executor.backend
    backend.default_stream().synchronize()  # runs what the default stream waits for, no more
    assert not backend.scheduler.pending(), "work left on a side stream the step never joined"


def _assert_same_result(got: StepResult, expected: StepResult) -> None:
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.next_tokens, expected.next_tokens)
    assert (got.path, got.graph_key) == (expected.path, expected.graph_key)


@dataclass(frozen=True)
class _Reference:
    """What a target that was never interrupted gives: the capturing step, and a replay after it."""

    result: StepResult
    bookkeeping: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    replay: StepResult
    labels: tuple[str, ...]  # the capturing step's points, in order


@functools.cache
def _reference(name: str) -> _Reference:
    case = CASES[name]
    member = _member(case)
    target = _make(case, member)
    try:
        target.step(HISTORY)
        graphs = target.executor.graphs
        interrupter = _Interrupter()
        interrupter.labels = []
        with _points(target, interrupter, member):
            result = target.step(case.batch)
        assert result.graph_key is not None and result.graph_key not in graphs, "no capture"
        bookkeeping, tensors = _bookkeeping(target), _tensors(target)
        replay = target.step(case.batch)
        assert replay.graph_key == result.graph_key
        return _Reference(result, bookkeeping, tensors, replay, tuple(interrupter.labels))
    finally:
        target.close()


def _part(points: int, part: int) -> tuple[int, int | None]:
    """The first and last point of `part` (None: to the end of the step). Attempt k costs about k
    points, so part i of PARTS ends at points * sqrt((i + 1) / PARTS)."""
    first = 1 + math.floor(points * math.sqrt(part / PARTS))
    last = None if part == PARTS - 1 else math.floor(points * math.sqrt((part + 1) / PARTS))
    return first, last


@pytest.mark.parametrize("part", range(PARTS), ids=lambda p: f"part{p + 1}of{PARTS}")
@pytest.mark.parametrize("name", CASES)
def test_an_interrupt_at_any_point_of_a_capturing_step_leaves_it_retryable(
    name: str, part: int
) -> None:
    case, reference = CASES[name], _reference(name)
    first, last = _part(len(reference.labels), part)
    member = _member(case)
    interrupted = _make(case, member)
    try:
        assert (interrupted.executor.coordinator is not None) == (case.ranks > 1)
        interrupted.step(HISTORY)
        before = _bookkeeping(interrupted)
        interrupter = _Interrupter()
        with _points(interrupted, interrupter, member):
            at = first
            got: StepResult | None = None
            while got is None and (last is None or at <= last):
                interrupter.arm(at)
                try:
                    got = interrupted.step(case.batch)  # ran past point `at`: the retry
                except KeyboardInterrupt as interrupt:
                    interrupter.arm(0)
                    assert _bookkeeping(interrupted) == before, str(interrupt)
                    _assert_nothing_left_queued(interrupted)
                    at += 1
            interrupter.arm(0)
            assert at > first, f"the step has {first - 1} points or fewer: nothing interrupted"
            if got is None:
                got = interrupted.step(case.batch)

        _assert_same_result(got, reference.result)
        assert _bookkeeping(interrupted) == reference.bookkeeping
        tensors = _tensors(interrupted)
        for tensor_name, expected in reference.tensors.items():
            assert torch.equal(tensors[tensor_name], expected), tensor_name
        _assert_same_result(interrupted.step(case.batch), reference.replay)
    finally:
        interrupted.close()


@pytest.mark.parametrize("name", CASES)
def test_the_points_of_a_capturing_step_include_every_kind_of_call(name: str) -> None:
    labels = _reference(name).labels
    assert any(label.startswith("aten.") for label in labels)
    for call in ("pool_for", "captured", "_begin_capture", "_end_capture", "_launch"):
        assert {f"before {call}", f"after {call}"} <= set(labels), call
    assert {"before _launch", "after _launch"} <= set(labels)
    gathers = labels.count("before all_gather")
    assert gathers == (2 if CASES[name].ranks > 1 else 0)  # coordination, capture outcome
