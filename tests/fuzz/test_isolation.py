"""run_isolated: a campaign in a child process; a child that dies or whose device faults is a
named failure with its step and replay snippet, and the calling process goes on."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from pytest_graphmode.contract import Batch, TargetFactory
from pytest_graphmode.failure import MADE_TWINS
from pytest_graphmode.fuzz import CampaignStats, GraphmodeFailure, run_campaign
from pytest_graphmode.fuzz.isolation import (
    NO_DEVICE_FAULT,
    CampaignOutOfMemory,
    IsolatedCampaignError,
    can_isolate,
    run_isolated,
)
from pytest_graphmode.loader import TargetError
from tests.fuzz import faulting_target, out_of_memory_target, toy


def _fault(factory: object) -> tuple[GraphmodeFailure, list[CampaignStats]]:
    heard: list[CampaignStats] = []
    stats = CampaignStats()
    with pytest.raises(GraphmodeFailure) as caught:
        run_isolated(
            factory,  # type: ignore[arg-type]
            max_examples=30,
            max_steps=4,
            seed=3,
            stats=stats,
            progress=heard.append,
        )
    assert caught.value.stats is stats
    return caught.value, heard


def _events_of(snippet: str) -> list[object]:
    namespace: dict[str, object] = {}
    exec(snippet.split("replay(events")[0], namespace)
    events = namespace["events"]
    assert isinstance(events, list)
    return events


@pytest.mark.parametrize(
    ("factory", "cause"),
    [
        (faulting_target.make_aborting_target, "died (signal SIGABRT)"),
        (faulting_target.make_accelerator_error_target, "the device faulted:"),
    ],
    ids=["abort", "accelerator_error"],
)
def test_a_device_fault_is_a_named_failure_at_its_step(factory: object, cause: str) -> None:
    raised, heard = _fault(factory)
    failure = raised.failure
    assert failure.check == NO_DEVICE_FAULT
    assert cause in failure.message
    assert f"failed at step {failure.step} (seed {failure.seed})" in failure.message
    batches = [event for event in _events_of(failure.replay_snippet) if isinstance(event, Batch)]
    # The snippet ends with the step that faulted, the first one with enough requests.
    assert len(batches) == failure.step + 1
    assert batches[-1].num_reqs >= faulting_target.FAULT_REQUESTS
    assert all(b.num_reqs < faulting_target.FAULT_REQUESTS for b in batches[:-1])
    assert "from tests.fuzz.faulting_target import make_" in failure.replay_snippet
    stats = raised.stats
    assert stats is not None and stats.failures == [failure]
    # What the child counted before it died came back, step by step.
    assert stats.examples >= 1 and stats.checks_run[NO_DEVICE_FAULT] >= 1
    assert (stats.first_failure_check, stats.first_failure_example) == (
        NO_DEVICE_FAULT,
        stats.examples,
    )
    assert heard and heard[-1].first_failure_check == NO_DEVICE_FAULT


def test_an_isolated_campaign_returns_the_childs_statistics() -> None:
    seen: list[int] = []
    stats = run_isolated(
        toy.make_target,
        max_examples=3,
        max_steps=3,
        seed=2,
        progress=lambda s: seen.append(s.examples),
    )
    assert stats.examples == 3 and seen == [1, 2, 3]
    assert stats.failures == [] and stats.steps >= 3
    assert stats.checks_run[NO_DEVICE_FAULT] == stats.steps


def test_a_failed_check_in_the_child_is_raised_as_it_is() -> None:
    with pytest.raises(GraphmodeFailure) as caught:
        drifting = partial(toy.ToyTarget, bugs=frozenset({"drift"}))
        run_isolated(drifting, max_examples=10, max_steps=3, seed=1, shrink_seconds=0)
    assert caught.value.failure.check == "replay_matches_eager"
    assert caught.value.stats is not None
    assert caught.value.stats.failures == [caught.value.failure]


@pytest.mark.parametrize("leading", [True, False])
def test_the_child_runs_the_leading_examples_as_asked(leading: bool) -> None:
    drifting = partial(toy.ToyTarget, bugs=frozenset({"drift"}))
    with pytest.raises(GraphmodeFailure) as caught:
        run_isolated(
            drifting, max_examples=10, max_steps=3, seed=1, shrink_seconds=0, leading=leading
        )
    assert caught.value.stats is not None
    assert caught.value.stats.first_failure_leading == ("first_pair" if leading else None)


def test_running_out_of_device_memory_in_the_child_is_raised_as_such() -> None:
    with pytest.raises(CampaignOutOfMemory, match="ran out of device memory") as caught:
        run_isolated(out_of_memory_target.graph_twins, max_examples=10, max_steps=3, seed=1)
    assert isinstance(caught.value, IsolatedCampaignError)  # what callers caught before
    assert out_of_memory_target.MESSAGE in str(caught.value)  # the child's traceback


def test_a_factory_that_cannot_reach_a_child_is_refused_with_the_way_out() -> None:
    local = toy.factory(["drift"])
    assert not can_isolate(local)
    with pytest.raises(TypeError, match="--graphmode-isolate=off"):
        run_isolated(local)


def test_a_fault_surfacing_outside_a_step_is_announced_as_no_device_fault() -> None:
    seen: list[str | None] = []
    with pytest.raises(torch.AcceleratorError):
        run_campaign(
            faulting_target.make_late_fault_target,
            max_examples=20,
            max_steps=4,
            seed=1,
            shrink_seconds=0,
            progress=lambda stats: seen.append(stats.first_failure_check),
        )
    assert seen[-1] == NO_DEVICE_FAULT


def _spec_claims_more_blocks(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
    target = toy.make_target(mode, seed=seed, backend=backend)
    target.spec = dataclasses.replace(target.spec, num_blocks=2 * target.spec.num_blocks)
    return target


def test_the_child_checks_the_twins_first_and_raises_the_contract_problem() -> None:
    # No state() tensor has a row per slot of the spec's blocks.
    with pytest.raises(TargetError, match="state\\(\\) disagrees with its spec"):
        run_isolated(_spec_claims_more_blocks, max_examples=2, seed=0, check_twins_first=True)


@pytest.mark.parametrize(
    ("factory", "cause"),
    [
        (faulting_target.make_aborting_when_made, "child process died (signal SIGABRT)"),
        (faulting_target.make_faulting_when_made, "the device faulted"),
    ],
)
def test_twins_that_fault_while_made_end_the_child_not_this_process(
    factory: TargetFactory, cause: str
) -> None:
    with pytest.raises(GraphmodeFailure) as caught:
        run_isolated(factory, max_examples=2, seed=0, check_twins_first=True)
    failure = caught.value.failure
    assert (failure.check, failure.step) == (NO_DEVICE_FAULT, MADE_TWINS)
    assert cause in failure.message and "before the first example" in failure.message
