"""An interrupt anywhere in `step()` leaves the runtime as if the step never started.

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
    ("piecewise", "batch"),
    [
        pytest.param(False, make_batch([1, 1], context=3), id="full-graph"),
        pytest.param(True, make_batch([3, 1], context=2), id="piecewise-graph"),
    ],
)
def test_an_interrupt_at_any_operation_of_a_capturing_step_leaves_it_retryable(
    piecewise: bool, batch: Batch
) -> None:
    interrupted, reference = (
        make_target("graph", seed=1, backend="sim", piecewise=piecewise) for _ in range(2)
    )
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
