"""run_with_helpers: a time-budgeted campaign with helper campaigns in child processes beside it.
The helpers' counts join the campaign's, whichever process fails first is reported (a helper's
failure with its own seed), and no helper outlives the call."""

from __future__ import annotations

import multiprocessing
import time
import warnings
from functools import partial
from typing import Any

import pytest
import torch

from pytest_graphmode.fuzz import CampaignStats, GraphmodeFailure, run_campaign
from pytest_graphmode.fuzz.helpers import helper_seed, run_with_helpers
from pytest_graphmode.fuzz.isolation import NO_DEVICE_FAULT, run_isolated
from pytest_graphmode.runtime import target as runtime_target
from tests.fuzz import faulting_target, out_of_memory_target, toy
from tests.mutants import output_view

DRIFTING = partial(toy.ToyTarget, bugs=frozenset({"drift"}))
"""A toy whose graph twin is wrong at every step, importable by a child process."""


class _Idle:
    """A campaign that runs no example: it waits until `stop()` or its time budget, as a
    campaign that finds nothing would, so that only its helpers can find a failure."""

    def __init__(self) -> None:
        self.stopped = False
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self, factory: object, *, seconds: float, stop: Any = lambda: False, **arguments: Any
    ) -> Any:
        self.calls.append({"seconds": seconds, **arguments})
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if stop():
                self.stopped = True
                break
            time.sleep(0.05)
        return arguments["stats"]


class _Counted:
    """`campaign`, keeping the statistics object each call counts into (the campaign's own,
    without its helpers')."""

    def __init__(self, campaign: Any) -> None:
        self.campaign = campaign
        self.own: list[CampaignStats] = []

    def __call__(self, factory: Any, **arguments: Any) -> CampaignStats:
        self.own.append(arguments["stats"])
        counted: CampaignStats = self.campaign(factory, **arguments)
        return counted


def _helpers(**arguments: Any) -> dict[str, Any]:
    return {"backend": "sim", "max_examples": 10_000, "max_steps": 4, **arguments}


def test_the_helpers_examples_count_with_the_campaigns() -> None:
    counted = _Counted(run_campaign)
    stats = CampaignStats()
    returned = run_with_helpers(
        counted, toy.make_target, **_helpers(helpers=1, seconds=8.0, seed=5, stats=stats)
    )
    assert returned is stats
    assert not stats.failures
    [own] = counted.own
    assert 0 < own.examples < stats.examples  # the helper ran examples of its own
    assert own.steps < stats.steps
    assert stats.seconds >= 8.0  # wall-clock time, not the sum of the processes'
    assert not multiprocessing.active_children()


def test_a_helpers_failure_is_reported_with_its_seed_and_stops_the_campaign() -> None:
    idle = _Idle()
    stats = CampaignStats()
    with pytest.raises(GraphmodeFailure) as caught:
        run_with_helpers(
            idle,
            DRIFTING,
            **_helpers(helpers=2, seconds=120.0, seed=7, stats=stats, shrink_seconds=0),
        )
    failure = caught.value.failure
    assert str(caught.value) == failure.message  # what pytest shows holds the note below
    # The helper's shrink budget, or the note that a leading example is never shrunk.
    assert "budget of 0 s" in failure.message or "leading examples" in failure.message
    assert caught.value.stats is stats
    assert failure.check == "replay_matches_eager"
    assert idle.stopped  # ended by the helper's find, long before its 120 s
    helper = next(h for h in (1, 2) if f"helper campaign {h} of 2" in failure.message)
    # The helper's campaign seed, and the example's seed in its replay snippet.
    assert f"helper campaign {helper} of 2 (seed {helper_seed(7, helper)})" in failure.message
    assert f"seed={failure.seed}" in failure.replay_snippet
    assert stats.first_failure_check == "replay_matches_eager"
    assert stats.failures == [failure]
    assert stats.examples >= 1
    assert not multiprocessing.active_children()


def test_the_campaigns_own_failure_ends_the_helpers() -> None:
    stats = CampaignStats()
    with pytest.raises(GraphmodeFailure) as caught:
        # Found in this process's first examples, while the helper still imports torch.
        run_with_helpers(
            run_campaign,
            DRIFTING,
            **_helpers(helpers=1, seconds=120.0, seed=3, stats=stats, shrink_seconds=0),
        )
    assert caught.value.stats is stats
    assert "helper campaign" not in caught.value.failure.message
    assert caught.value.failure.seed is not None
    assert stats.first_failure_check == "replay_matches_eager"
    assert not multiprocessing.active_children()  # killed, not left running for 120 s


def test_a_helper_that_dies_is_a_device_fault() -> None:
    idle = _Idle()
    with pytest.raises(GraphmodeFailure) as caught:
        run_with_helpers(
            idle,
            faulting_target.make_aborting_target,
            **_helpers(helpers=1, seconds=120.0, seed=3),
        )
    failure = caught.value.failure
    assert failure.check == NO_DEVICE_FAULT
    assert "died (signal SIGABRT)" in failure.message
    assert "helper campaign 1 of 1" in failure.message
    assert idle.stopped


def test_a_helper_out_of_device_memory_stops_with_a_warning_and_the_campaign_goes_on() -> None:
    counted = _Counted(run_campaign)
    stats = CampaignStats()
    # 12 s: helpers import torch in processes of their own, and on a loaded 2-core machine 6 s
    # ended the campaign before either had made its target (no warning)
    with pytest.warns(RuntimeWarning) as warned:
        run_with_helpers(
            counted,
            out_of_memory_target.in_helpers,
            **_helpers(helpers=2, seconds=12.0, seed=5, stats=stats),
        )
    messages = sorted(str(w.message) for w in warned if "device memory" in str(w.message))
    assert len(messages) == 2, messages  # one per helper, each once
    for helper, message in enumerate(messages, start=1):
        assert f"helper campaign {helper} of 2 (seed {helper_seed(5, helper)})" in message
        assert "stopped after 0 examples" in message
        assert "--graphmode-workers" in message
        assert out_of_memory_target.MESSAGE in message
    [own] = counted.own
    assert not stats.failures and stats.first_failure_check is None
    assert stats.examples == own.examples > 0  # the campaign's own examples, nothing lost
    assert not multiprocessing.active_children()


def test_the_campaigns_own_out_of_memory_error_says_that_helpers_shared_the_device() -> None:
    stats = CampaignStats()
    with (
        warnings.catch_warnings(record=True) as warned,
        pytest.raises(torch.OutOfMemoryError) as caught,
    ):
        warnings.simplefilter("always")
        run_with_helpers(
            run_campaign,
            out_of_memory_target.graph_twins_in_this_process,
            **_helpers(helpers=1, seconds=30.0, seed=2, stats=stats),
        )
    assert out_of_memory_target.MESSAGE in str(caught.value)
    notes = getattr(caught.value, "__notes__", [])
    assert any("1 helper campaign shared the device" in note for note in notes), notes
    assert not [w for w in warned if "device memory" in str(w.message)]  # the helper fitted
    assert not stats.failures
    assert not multiprocessing.active_children()


def test_no_helpers_is_the_campaign_alone() -> None:
    idle = _Idle()
    run_with_helpers(idle, toy.make_target, **_helpers(helpers=0, seconds=0.2, seed=1))
    assert len(idle.calls) == 1
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"helpers": -1, "seconds": 5.0}, ValueError, "helpers=-1"),
        ({"helpers": True, "seconds": 5.0}, ValueError, "helpers=True"),
        ({"helpers": 1, "seconds": None}, ValueError, "need a time budget"),
        ({"helpers": 1, "seconds": 0.0}, ValueError, "need a time budget"),
        ({"helpers": 1, "seconds": 5.0, "cpu_threads": 0}, ValueError, "cpu_threads=0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    arguments: dict[str, Any], error: type[Exception], match: str
) -> None:
    idle = _Idle()
    with pytest.raises(error, match=match):
        run_with_helpers(idle, toy.make_target, **_helpers(seed=1, **arguments))
    assert not idle.calls
    assert not multiprocessing.active_children()


def test_a_factory_no_child_can_import_is_refused() -> None:
    idle = _Idle()
    with pytest.raises(TypeError, match="cannot be sent to a helper process"):
        run_with_helpers(idle, toy.factory(["drift"]), **_helpers(helpers=1, seconds=5.0, seed=1))
    assert not idle.calls


@pytest.mark.graphmode_cuda
def test_helpers_share_the_gpu_with_an_isolated_campaign() -> None:
    counted = _Counted(run_isolated)
    stats = CampaignStats()
    run_with_helpers(
        counted,
        runtime_target.make_target,
        **_helpers(backend="cuda", helpers=2, seconds=15.0, seed=5, stats=stats),
    )
    assert not stats.failures
    [own] = counted.own
    assert 0 < own.examples < stats.examples
    assert not multiprocessing.active_children()


@pytest.mark.graphmode_cuda
def test_a_helpers_failure_on_cuda_is_reported() -> None:
    idle = _Idle()
    with pytest.raises(GraphmodeFailure) as caught:
        run_with_helpers(
            idle,
            output_view.make_target,  # returns a view of a static buffer: fails in a few examples
            **_helpers(backend="cuda", helpers=1, seconds=120.0, seed=7, shrink_seconds=5),
        )
    assert caught.value.failure.check == "results_stay_valid"
    assert f"helper campaign 1 of 1 (seed {helper_seed(7, 1)})" in caught.value.failure.message
    assert idle.stopped


@pytest.mark.graphmode_cuda
def test_a_helper_out_of_gpu_memory_stops_and_the_isolated_campaign_goes_on() -> None:
    counted = _Counted(run_isolated)
    stats = CampaignStats()
    with pytest.warns(RuntimeWarning, match="helper campaign 1 of 1 .* out of device memory"):
        run_with_helpers(
            counted,
            out_of_memory_target.more_than_the_gpu_in_helpers,
            **_helpers(backend="cuda", helpers=1, seconds=15.0, seed=5, stats=stats),
        )
    [own] = counted.own
    assert not stats.failures
    assert stats.examples == own.examples > 0
    assert not multiprocessing.active_children()
