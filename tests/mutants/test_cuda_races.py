"""On a GPU, the stream delays make the host-staging races of the zoo fail at the ci profile, and
the correct targets still pass.

Campaigns run as `--graphmode-profile=ci` runs them on cuda: its budget, in a child process (a
racing runner may read another field's values as indices, and an out-of-bounds index is a
device-side assert, reported as `no_device_fault`). Up to three seeds each, as the sim detection
tests do.
"""

from __future__ import annotations

import pytest
import torch

from pytest_graphmode.fuzz import Failure, GraphmodeFailure
from pytest_graphmode.fuzz.isolation import run_isolated
from pytest_graphmode.fuzz.race_check import NO_STREAM_RACES
from pytest_graphmode.fuzz.registry import NO_DEVICE_FAULT
from pytest_graphmode.settings import PROFILES
from tests.mutants.budget import detection_settings
from tests.mutants.measure import correct_factory
from tests.mutants.zoo import Mutant, load

pytestmark = pytest.mark.graphmode_cuda

CI_EXAMPLES, CI_STEPS = PROFILES["ci"].examples, PROFILES["ci"].steps
DETECTION_SEEDS = (0, 1, 2)
RACES = ("staging_buffer_reused", "copy_stream_not_awaited")
# On cuda the delayed steps report a host write into staging whose upload is still in flight
# (runtime/backends/cuda_races.py); a race they do not see shows as whatever the graph twin (the
# only one delayed) computed or wrote from stale metadata, judged against the eager twin, the
# unpoisoned clean twin, or the KV slots the step may write; an index out of range faults the
# device.
SYMPTOMS_ON_CUDA = (
    NO_STREAM_RACES,
    "replay_matches_eager",
    "padding_inert",
    "kv_writes_confined",
    "states_match",
    NO_DEVICE_FAULT,
)


@pytest.fixture(autouse=True)
def _gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.parametrize("name", RACES)
def test_the_harness_fails_a_staging_race_on_cuda_at_the_ci_profile(name: str) -> None:
    mutant = load(name)
    failure = _first_failure(mutant)
    assert failure is not None, f"{name} passed {len(DETECTION_SEEDS)} ci-profile campaigns on cuda"
    assert failure.check in SYMPTOMS_ON_CUDA, failure.message


@pytest.mark.parametrize("target", ["runtime", "minimal"])
def test_a_correct_target_passes_the_ci_profile_on_cuda_with_delays(target: str) -> None:
    stats = run_isolated(
        correct_factory(target),
        backend="cuda",
        max_steps=CI_STEPS,
        seed=0,
        settings=detection_settings(CI_EXAMPLES),
    )
    assert stats.failures == []


def _first_failure(mutant: Mutant) -> Failure | None:
    for seed in DETECTION_SEEDS:
        try:
            run_isolated(
                mutant.factory,
                backend="cuda",
                max_steps=CI_STEPS,
                seed=seed,
                settings=detection_settings(CI_EXAMPLES),
            )
        except GraphmodeFailure as caught:
            return caught.failure
    return None
