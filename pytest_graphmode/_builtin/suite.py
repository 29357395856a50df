"""The built-in fuzz suite: the configured target against the stock campaign.

The plugin adds these items to a `--graphmode-fuzz` run that has no `graphmode_fuzz` tests of its
own. Every option (target, backend, profile, seed) comes from the command line or the ini file.
"""

from __future__ import annotations

import pytest

from pytest_graphmode.contract import TargetFactory
from pytest_graphmode.fixtures import GraphmodeFuzz, Twins, twins_checked_in_child
from pytest_graphmode.settings import settings_of

pytestmark = pytest.mark.graphmode_fuzz

# Fixed seeds for the sim backend's stream scheduler: the same interleavings on every run and every
# machine, so a failure here is a regression in the target, not an unlucky draw.
PINNED_SCHEDULER_SEEDS = (0, 1)


def _runs_in_child_processes(config: pytest.Config) -> bool:
    return twins_checked_in_child(settings_of(config))


# A condition evaluated before the test's fixtures start: on cuda, making the twins here would run
# the runner's code on the device in this process.
@pytest.mark.skipif(
    "_runs_in_child_processes(config)",
    reason="the campaign's child process checks the twins before it fuzzes them: made here, a "
    "runner that faults the device would end this process",
)
def test_target_follows_contract(graphmode_twins: Twins) -> None:
    assert graphmode_twins.graph.spec == graphmode_twins.eager.spec, (
        "a graph and an eager target made with the same seed must describe the same runner: "
        f"{graphmode_twins.graph.spec} != {graphmode_twins.eager.spec}"
    )


def test_campaign(graphmode_fuzz: GraphmodeFuzz, graphmode_target_factory: TargetFactory) -> None:
    stats = graphmode_fuzz(graphmode_target_factory)
    assert stats.steps > 0, "the campaign ran no steps: the target's spec allows no batch"


@pytest.mark.parametrize("scheduler_seed", PINNED_SCHEDULER_SEEDS)
def test_campaign_pinned_scheduler_seed(
    request: pytest.FixtureRequest,
    graphmode_fuzz: GraphmodeFuzz,
    graphmode_target_factory: TargetFactory,
    scheduler_seed: int,
) -> None:
    settings = settings_of(request.config)
    if settings.backend != "sim":
        pytest.skip("scheduler seeds exist only on the sim backend")
    if settings.seed == scheduler_seed:
        pytest.skip(
            f"--graphmode-seed={scheduler_seed} makes test_campaign this very campaign: not run "
            "twice"
        )
    stats = graphmode_fuzz(
        graphmode_target_factory, seed=scheduler_seed, label=f"pinned seed {scheduler_seed}"
    )
    assert stats.steps > 0, "the campaign ran no steps: the target's spec allows no batch"
