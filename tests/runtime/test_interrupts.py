"""An interrupt anywhere in `step()` leaves the runtime as if the step never started, also in a
step coordinated with other data-parallel ranks (interrupted in one of its collectives too).

A KeyboardInterrupt is raised instead of the k-th ATen operation of a step that captures its
graph (staging, warm-up, capture, replay, sampling), for k spread over the whole step. After each
one the target holds no new graph, pool view, failed key or count, and no device work is left
unordered on a side stream; the retried step then gives what a target that was never interrupted
gives, bit for bit, with the same KV cache, static buffers and graphs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from runtime_helpers import make_batch
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_graphmode import Batch
from pytest_graphmode.runtime.data_parallel import DataParallel, joined
from pytest_graphmode.runtime.target import RuntimeTarget, make_target

STRIDE = 41  # every op would take minutes on the sim; a prime stride lands in every phase
HISTORY = make_batch([1], context=2, first_block=40)


class _InterruptAt(TorchDispatchMode):
    """Raises KeyboardInterrupt instead of running the `at`-th operation (never when 0); counts
    the operations it sees in `seen`."""

    def __init__(self, at: int = 0) -> None:
        super().__init__()
        self.at = at
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt(f"injected at operation {self.seen} ({func})")
        return func(*args, **(kwargs or {}))


class _Mirrored(DataParallel):
    """Rank 0 of two whose peer contributes whatever rank 0 does: coordination, no processes.
    Raises KeyboardInterrupt instead of its `interrupt_at`-th collective (never when 0)."""

    interrupt_at = 0
    gathers = 0

    def all_gather(self, row: list[int]) -> list[list[int]]:
        self.gathers += 1
        if self.gathers == self.interrupt_at:
            raise KeyboardInterrupt(f"injected in collective {self.gathers}")
        return [list(row) for _ in range(self.world_size)]


def _make(piecewise: bool, member: DataParallel | None) -> RuntimeTarget:
    if member is None:
        return make_target("graph", seed=1, backend="sim", piecewise=piecewise)
    with joined(member):
        return make_target("graph", seed=1, backend="sim", piecewise=piecewise)


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


def _assert_nothing_left_queued(target: RuntimeTarget) -> None:
    backend = target.executor.backend
    backend.default_stream().synchronize()  # runs what the default stream waits for, no more
    assert not backend.scheduler.pending(), "work left on a side stream the step never joined"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("piecewise", "batch", "ranks"),
    [
        pytest.param(False, make_batch([1, 1], context=3), 1, id="full-graph"),
        pytest.param(True, make_batch([3, 1], context=2), 1, id="piecewise-graph"),
        pytest.param(False, make_batch([1, 1], context=3), 2, id="full-graph-data-parallel"),
    ],
)
def test_an_interrupt_at_any_operation_of_a_capturing_step_leaves_it_retryable(
    piecewise: bool, batch: Batch, ranks: int
) -> None:
    interrupted, reference = (
        _make(piecewise, _Mirrored(0, ranks) if ranks > 1 else None) for _ in range(2)
    )
    assert (interrupted.executor.coordinator is not None) == (ranks > 1)
    for target in (interrupted, reference):
        target.step(HISTORY)
    expected = reference.step(batch)
    assert expected.graph_key is not None
    assert expected.graph_key not in interrupted.executor.graphs
    before = _bookkeeping(interrupted)

    # Interrupt at operation 1, 1 + STRIDE, ... until the step runs past the interrupt: that run
    # is the retry. (Its operation count is not the reference's: a pool keeps physical memory
    # a discarded view had mapped, and the sim poisons memory only when it is first mapped.)
    at = 1
    while True:
        interrupt = _InterruptAt(at)
        try:
            with interrupt:
                got = interrupted.step(batch)
        except KeyboardInterrupt:
            assert _bookkeeping(interrupted) == before, f"interrupted at operation {at}"
            _assert_nothing_left_queued(interrupted)
            at += STRIDE
            continue
        break
    assert at > 1, "the step never got interrupted"

    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.next_tokens, expected.next_tokens)
    assert _bookkeeping(interrupted) == _bookkeeping(reference)
    for name, tensor in {**reference.state(), **reference.static_buffers()}.items():
        mine = {**interrupted.state(), **interrupted.static_buffers()}[name]
        assert torch.equal(mine.view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize("collective", [1, 2], ids=["coordination", "capture-outcome"])
def test_an_interrupt_in_a_collective_of_a_capturing_step_leaves_it_retryable(
    collective: int,
) -> None:
    member, reference_member = _Mirrored(0, 2), _Mirrored(0, 2)
    interrupted, reference = _make(False, member), _make(False, reference_member)
    batch = make_batch([1, 1], context=3)
    for target in (interrupted, reference):
        target.step(HISTORY)
    expected = reference.step(batch)
    before = _bookkeeping(interrupted)

    # A capturing step gathers twice: the coordination, then every rank's capture outcome.
    member.interrupt_at = member.gathers + collective
    with pytest.raises(KeyboardInterrupt):
        interrupted.step(batch)
    assert _bookkeeping(interrupted) == before
    _assert_nothing_left_queued(interrupted)

    got = interrupted.step(batch)
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.next_tokens, expected.next_tokens)
    assert _bookkeeping(interrupted) == _bookkeeping(reference)
