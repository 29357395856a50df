"""`run_campaign`: Hypothesis draws schedules, the lockstep driver checks them, shrinking finds
the smallest failing one.

Why `@given` over drawn schedules rather than a `RuleBasedStateMachine`: a schedule here is a pure
value (a list of step plans) that a deterministic scheduler compiles into legal batches, and any
sub-list compiles to legal batches too. Hypothesis therefore shrinks it by deleting and
simplifying steps with no preconditions to re-check, the shrunk schedule *is* the replay snippet,
and a failing example re-runs through exactly the code path `replay` uses.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import hypothesis
from hypothesis import strategies as st

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import TargetFactory, TargetSpec
from pytest_graphmode.failure import GraphmodeFailure
from pytest_graphmode.fuzz.lockstep import Lockstep
from pytest_graphmode.settings import hypothesis_settings
from pytest_graphmode.strategies.plans import StepPlan
from pytest_graphmode.strategies.scheduler import compile_schedule
from pytest_graphmode.strategies.schedules import schedules


def target_spec(factory: TargetFactory, backend: str) -> TargetSpec:
    """The spec of the factory's targets (one eager target is made and closed to read it)."""
    probe = factory("eager", seed=0, backend=backend)
    try:
        return probe.spec
    finally:
        probe.close()


def campaign_spec(
    factory: TargetFactory, backend: str, features: frozenset[str] | None
) -> TargetSpec:
    """The spec a campaign's schedules draw from: the target's, its features restricted to
    `features` (None: all of them); asking for a feature the target lacks is a ValueError."""
    spec = target_spec(factory, backend)
    if features is None:
        return spec
    missing = set(features) - spec.features
    if missing:
        raise ValueError(
            f"the target does not support features {sorted(missing)}; it offers "
            f"{sorted(spec.features)}"
        )
    return dataclasses.replace(spec, features=frozenset(features))


@contextmanager
def storage_outside_the_project() -> Iterator[None]:
    """Point Hypothesis's storage directory at a temporary one for the campaign.

    Database or not, Hypothesis caches the constants of every module of the working directory in
    its storage directory (`.hypothesis/constants/` by default), so a campaign would leave a
    `.hypothesis/` in the user's project. The user's own setting is put back afterwards: their
    Hypothesis tests keep their storage.
    """
    from hypothesis import configuration

    # None: not chosen yet; Hypothesis then chooses again (environment, working directory).
    previous = vars(configuration).get("__hypothesis_home_directory")
    with tempfile.TemporaryDirectory(prefix="graphmode-hypothesis-") as home:
        configuration.set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(previous)


def run_campaign(
    factory: TargetFactory,
    *,
    backend: str = "sim",
    max_examples: int = 50,
    max_steps: int = 12,
    seed: int | None = None,
    features: frozenset[str] | None = None,
    progress: Callable[[CampaignStats], None] | None = None,
    settings: hypothesis.settings | None = None,
    stats: CampaignStats | None = None,
) -> CampaignStats:
    """Fuzz `factory`'s targets; return the statistics, or raise `GraphmodeFailure` (carrying
    them as `.stats`) for the first failure, shrunk to its smallest schedule.

    `features` restricts what the schedules use to a subset of the target's features. `settings`,
    when given, replaces the default Hypothesis settings entirely (`max_examples` is then
    ignored). `seed` makes the campaign reproducible. `stats`, when given, is counted into as the
    campaign runs, so a caller still holds every count when something else ends the campaign
    (Ctrl-C: `KeyboardInterrupt` passes through unchanged).
    """
    spec = campaign_spec(factory, backend, features)
    stats = CampaignStats() if stats is None else stats
    started = time.perf_counter()

    @hypothesis.given(plans=schedules(spec, max_steps), example_seed=st.integers(0, 2**31 - 1))
    def example(plans: list[StepPlan], example_seed: int) -> None:
        events = compile_schedule(spec, plans, seed=example_seed)
        stats.examples += 1
        lockstep = Lockstep(factory, backend=backend, seed=example_seed, stats=stats)
        try:
            lockstep.run(events)
        finally:
            lockstep.close()
            if progress is not None:
                progress(stats)

    example = (settings or hypothesis_settings(max_examples))(example)
    if seed is not None:
        example = hypothesis.seed(seed)(example)
    try:
        with storage_outside_the_project():
            example()
    except GraphmodeFailure as failed:
        stats.failures.append(failed.failure)
        failed.stats = stats
        raise
    finally:
        stats.seconds += time.perf_counter() - started
    return stats
