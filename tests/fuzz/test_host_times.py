"""The host time a delayed step's sleep must outlast on cuda (`host_times.py`)."""

from __future__ import annotations

import time

import pytest
import torch

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.fuzz import host_times
from pytest_graphmode.fuzz.host_times import HOLD_FACTOR, MAX_HOLD_SECONDS, HostTimes

PREFILL = Batch(requests=(Request(req_id=0, tokens=(1, 2), context_len=0, block_ids=(1,)),))
DECODE = Batch(requests=(Request(req_id=0, tokens=(3,), context_len=2, block_ids=(1,)),))
CUDA = torch.device("cuda", 0)


@pytest.fixture
def gigahertz(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sleep clock of 1e9 cycles a second, without a GPU."""
    monkeypatch.setattr(host_times, "sleep_cycles_per_second", lambda device: 1e9)


def _noted(times: HostTimes, twin: str, batch: Batch, seconds: float) -> None:
    times.timed(twin, batch, lambda: time.sleep(seconds))


def test_a_step_is_estimated_from_the_slowest_twin_latest_step_of_its_phase():
    times = HostTimes()
    _noted(times, "eager", PREFILL, 0.02)
    _noted(times, "graph", PREFILL, 0.0)
    _noted(times, "graph", DECODE, 0.0)
    assert 0.02 <= times.estimate(PREFILL) < 0.04
    assert times.estimate(DECODE) < 0.01
    _noted(times, "eager", PREFILL, 0.0)  # the latest replaces the one before
    assert times.estimate(PREFILL) < 0.01


def test_a_step_that_raises_is_timed_too():
    times = HostTimes()

    def raises() -> None:
        time.sleep(0.01)
        raise KeyError("the runner failed")

    with pytest.raises(KeyError):
        times.timed("graph", DECODE, raises)
    assert times.estimate(DECODE) >= 0.01


def test_the_hold_outlasts_the_steps_it_covers_by_the_hold_factor(gigahertz):
    times = HostTimes()
    assert times.hold_cycles(CUDA, [PREFILL, DECODE]) == 0  # nothing measured yet
    _noted(times, "eager", PREFILL, 0.01)
    _noted(times, "eager", DECODE, 0.005)
    both = times.estimate(PREFILL) + times.estimate(DECODE)
    assert times.hold_cycles(CUDA, [PREFILL, DECODE]) == pytest.approx(
        HOLD_FACTOR * both * 1e9, rel=1e-6
    )
    assert times.hold_cycles(CUDA, [DECODE]) < times.hold_cycles(CUDA, [PREFILL, DECODE])


def test_the_hold_is_bounded(gigahertz):
    times = HostTimes()
    _noted(times, "eager", PREFILL, MAX_HOLD_SECONDS + 0.01)
    assert times.hold_cycles(CUDA, [PREFILL]) == pytest.approx(HOLD_FACTOR * MAX_HOLD_SECONDS * 1e9)


def test_times_that_do_not_measure_run_the_step_and_note_nothing():
    times = HostTimes(measure=False)
    assert times.timed("eager", PREFILL, lambda: time.sleep(0.01) or "stepped") == "stepped"
    assert times.estimate(PREFILL) == 0.0
