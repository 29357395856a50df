"""The harness fails every mutant of the zoo with the check its module names, within the default
budget, and passes the correct targets on every seed (no false positives).

The detection tests run campaigns with up to three seeds until one fails: every mutant is caught
on at least nine seeds of ten, so missing three in a row means the harness lost its grip.
`measure.py` runs ten seeds per mutant and records the spread in docs/mutants.md. The
no-false-positive tests run twenty seeds per correct target with a reduced budget per seed; the
full-budget figures are in the same document.
"""

from __future__ import annotations

import importlib

import pytest

from pytest_graphmode.fuzz import Failure, GraphmodeFailure, run_campaign
from pytest_graphmode.fuzz.race_check import NO_STREAM_RACES
from tests.mutants.budget import detection_settings
from tests.mutants.measure import CORRECT_TARGETS, correct_factory
from tests.mutants.zoo import MUTANTS, Mutant

DETECTION_SEEDS = (0, 1, 2)
NO_FALSE_POSITIVE_SEEDS = range(20)
CI_EXAMPLES, CI_STEPS = 3, 12  # per seed; measure.py runs the full 50 x 12


def test_the_zoo_covers_every_single_rank_bug_class() -> None:
    assert {mutant.bug_class for mutant in MUTANTS} == {*range(1, 11), 12}


def test_every_mutant_names_its_public_counterpart_in_its_docstring() -> None:
    for mutant in MUTANTS:
        assert mutant.summary.startswith(f"Class {mutant.bug_class}, "), mutant.name
        assert "\nMirrors " in (importlib.import_module(mutant.module).__doc__ or ""), mutant.name


@pytest.mark.parametrize("mutant", MUTANTS, ids=[mutant.name for mutant in MUTANTS])
def test_the_harness_fails_the_mutant_with_its_check(mutant: Mutant) -> None:
    failure = _first_failure(mutant)
    assert failure is not None, (
        f"{mutant.name} passed {len(DETECTION_SEEDS)} campaigns of the default budget"
    )
    assert failure.check in (mutant.check, *mutant.also), failure.message


def _first_failure(mutant: Mutant) -> Failure | None:
    for seed in DETECTION_SEEDS:
        try:
            run_campaign(mutant.factory, backend="sim", seed=seed, settings=detection_settings())
        except GraphmodeFailure as caught:
            return caught.failure
    return None


# Races that span two steps: only a pipelined pair of decode steps shows them, the first example
# of a campaign (`first_pair`). Each with the file of its racing lines: the mutant leaves out a
# wait, and both accesses are in the correct runner it derives from.
ACROSS_STEPS = {"upload_event_skipped": "tests/runners/overlapped.py:"}
RACE_MUTANTS = [m for m in MUTANTS if m.bug_class == 8]


def test_every_race_across_steps_is_in_the_zoo() -> None:
    # Else a renamed mutant would silently leave the pair assertion below with nothing to check.
    assert set(ACROSS_STEPS) <= {m.name for m in RACE_MUTANTS}


@pytest.mark.parametrize("mutant", RACE_MUTANTS, ids=[mutant.name for mutant in RACE_MUTANTS])
def test_a_race_mutant_is_caught_by_one_example_on_every_seed(mutant: Mutant) -> None:
    for seed in DETECTION_SEEDS:
        with pytest.raises(GraphmodeFailure) as caught:
            run_campaign(mutant.factory, backend="sim", seed=seed, settings=detection_settings(1))
        failure = caught.value.failure
        assert caught.value.stats.examples == 1
        assert failure.check == NO_STREAM_RACES, failure.message
        # Both sides: the access that was not waited for, the one that raced with it, and where.
        assert "is not ordered before" in failure.message
        assert "\n  read by " in failure.message and "\n  write by " in failure.message
        assert ACROSS_STEPS.get(mutant.name, f"{mutant.name}.py:") in failure.message
        if mutant.name in ACROSS_STEPS:
            assert "ran as a pipelined pair" in failure.message


@pytest.mark.parametrize("seed", NO_FALSE_POSITIVE_SEEDS)
@pytest.mark.parametrize("target", CORRECT_TARGETS)
def test_a_correct_target_passes_every_check(target: str, seed: int) -> None:
    stats = run_campaign(
        correct_factory(target),
        backend="sim",
        max_steps=CI_STEPS,
        seed=seed,
        settings=detection_settings(CI_EXAMPLES),
    )
    assert stats.failures == []
    assert stats.steps >= CI_EXAMPLES
