"""Data-parallel campaigns with two ranks (gloo on sim, NCCL on cuda with one GPU a rank): the
harness fails every class-11 mutant with its check, passes the correct runtime, and reports a
hanging rank instead of hanging.

Like the single-rank mutant tests, detection tries up to three seeds: a seed alone does not pin
what Hypothesis draws across processes.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from pytest_graphmode.contract import TargetFactory
from pytest_graphmode.fuzz import CHECKS, Failure, GraphmodeFailure
from pytest_graphmode.fuzz.campaign import target_spec
from pytest_graphmode.fuzz.ranks import replay_ranks, run_rank_campaign
from pytest_graphmode.runtime.target import make_target
from pytest_graphmode.strategies.plans import Arrival, StepPlan
from pytest_graphmode.strategies.rank_schedules import (
    RankEvent,
    RankFault,
    RankStep,
    compile_rank_schedule,
)
from tests.mutants.budget import detection_settings
from tests.ranks import hanging

RANKS = 2
MUTANTS = ("uncoordinated", "padded_to_sum", "path_not_agreed")
DETECTION_SEEDS = (0, 1, 2)
DETECTION_EXAMPLES = 20
# Seconds without progress of any rank before a run counts as hung: far above a step of the
# tiny decoder on a loaded CI machine, far below a CI job's limit.
TIMEOUT = 30.0


def _needs_ranks(backend: str) -> None:
    if backend == "cuda" and torch.cuda.device_count() < RANKS:
        pytest.skip(f"{RANKS} ranks on cuda need {RANKS} GPUs, one a rank")


BACKENDS = ["sim", pytest.param("cuda", marks=pytest.mark.graphmode_cuda)]


def _first_failure(factory: TargetFactory, backend: str) -> Failure | None:
    for seed in DETECTION_SEEDS:
        try:
            run_rank_campaign(
                factory,
                ranks=RANKS,
                backend=backend,
                seed=seed,
                settings=detection_settings(DETECTION_EXAMPLES),
                timeout=TIMEOUT,
            )
        except GraphmodeFailure as caught:
            return caught.failure
    return None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MUTANTS)
def test_the_harness_fails_the_rank_mutant_with_its_check(name: str, backend: str) -> None:
    _needs_ranks(backend)
    module = importlib.import_module(f"tests.ranks.{name}")
    failure = _first_failure(module.make_target, backend)
    assert failure is not None, f"{name} passed {len(DETECTION_SEEDS)} two-rank campaigns"
    assert failure.check in (module.EXPECTED_CHECK, *getattr(module, "ALSO_SEEN_BY", ())), (
        failure.message
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_default_target_passes_a_two_rank_campaign(backend: str) -> None:
    _needs_ranks(backend)
    stats = run_rank_campaign(
        make_target, ranks=RANKS, backend=backend, seed=0, settings=detection_settings(3)
    )
    assert stats.failures == []
    assert stats.checks_run["ranks_agree"] == stats.checks_run["ranks_arrive"] == stats.steps > 0
    assert set(stats.checks_run) <= set(CHECKS)


def _decode_schedule(steps: int, backend: str) -> list[list[RankEvent | RankFault]]:
    plan = StepPlan("decode", rows=2, arrivals=(Arrival(prompt_len=1),))
    step = RankStep((plan,) * RANKS, (RankFault(),) * RANKS)
    return compile_rank_schedule(target_spec(make_target, backend), [step] * steps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hanging_rank_is_reported_with_its_rank_and_step_and_the_run_ends(backend: str) -> None:
    _needs_ranks(backend)
    events = _decode_schedule(hanging.HANGING_STEP + 2, backend)
    with pytest.raises(GraphmodeFailure) as caught:
        replay_ranks(events, factory=hanging.make_target, backend=backend, timeout=TIMEOUT)
    failure = caught.value.failure
    assert (failure.check, failure.step) == ("ranks_arrive", hanging.HANGING_STEP)
    assert (
        f"ranks [{hanging.HANGING_RANK}] did not arrive at the graph twins' coordination"
        in failure.message
    ), failure.message
    assert "every rank process was killed" in failure.message


def test_a_zero_shrink_budget_reports_a_rank_failure_as_found() -> None:
    module = importlib.import_module("tests.ranks.uncoordinated")
    for seed in DETECTION_SEEDS:
        try:
            run_rank_campaign(
                module.make_target,
                ranks=RANKS,
                seed=seed,
                max_examples=DETECTION_EXAMPLES,
                timeout=TIMEOUT,
                shrink_seconds=0,
            )
        except GraphmodeFailure as caught:
            stats, failure = caught.stats, caught.failure
            break
    else:
        pytest.fail(f"uncoordinated passed {len(DETECTION_SEEDS)} two-rank campaigns")
    assert stats is not None and stats.failures == [failure]
    # No input ran after the first failing one: shrinking stopped at once.
    assert stats.examples == stats.first_failure_example
    assert stats.first_failure_check == failure.check
    assert stats.shrink_stopped_by_budget and not stats.shrinking
    assert "shrinking stopped at its budget of 0 s" in failure.message
