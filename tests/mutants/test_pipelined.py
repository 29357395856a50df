"""Pipelined pairs catch what lockstep cannot: a runner that overlaps its steps and skips the wait
between two of them (`upload_event_skipped`) fails only when the harness submits a step before it
reads the one before it, and its failure replays alone, in the same mode, from its snippet.

On sim the race checker sees the host's rewrite of the staging buffer unordered after the copy
still queued out of it, whatever order the scheduler runs them in: the first example of a
campaign, the simplest schedule with a pipelined pair of decode steps (`first_pair`), catches it
on every seed, and twenty examples in lockstep never do.
"""

from __future__ import annotations

import dataclasses

import pytest

from pytest_graphmode.fuzz import Failure, GraphmodeFailure, replay, run_campaign
from pytest_graphmode.strategies.plans import Stress
from tests.mutants import upload_event_skipped
from tests.mutants.budget import detection_settings

SEEDS = (0, 1, 2)
EXAMPLES = 20  # per seed, in lockstep


def _caught(seed: int) -> Failure:
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(
            upload_event_skipped.make_target,
            backend="sim",
            seed=seed,
            settings=detection_settings(1),
        )
    assert caught.value.stats.examples == 1
    return caught.value.failure


@pytest.mark.parametrize("seed", SEEDS)
def test_a_skipped_wait_between_steps_fails_in_a_pipelined_pair(seed: int) -> None:
    failure = _caught(seed)
    assert failure.check == upload_event_skipped.EXPECTED_CHECK, failure.message
    assert f"steps {failure.step} and {failure.step + 1} ran as a pipelined pair" in (
        failure.message
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_a_skipped_wait_between_steps_passes_in_lockstep(seed: int) -> None:
    stats = run_campaign(
        upload_event_skipped.make_target,
        backend="sim",
        seed=seed,
        settings=detection_settings(EXAMPLES),
        pipelined=False,
    )
    assert stats.failures == [] and stats.pipelined_steps == 0


def test_a_pipelined_failure_replays_alone_and_passes_with_the_pair_unpipelined() -> None:
    failure = _caught(SEEDS[0])
    namespace: dict[str, object] = {}
    with pytest.raises(GraphmodeFailure) as replayed:
        exec(failure.replay_snippet, namespace)
    assert (replayed.value.failure.check, replayed.value.failure.step) == (
        failure.check,
        failure.step,
    )
    events = namespace["events"]
    assert isinstance(events, list)
    lockstep = [
        dataclasses.replace(e, pipelined=False) if isinstance(e, Stress) else e for e in events
    ]
    stats = replay(
        lockstep, factory=upload_event_skipped.make_target, backend="sim", seed=failure.seed
    )
    assert stats.failures == [] and stats.pipelined_steps == 0
