"""Fixtures the plugin registers: the backend, the target factory, twins, and a campaign runner.

All of them follow the run's options (`--graphmode-backend`, `--graphmode-target`,
`--graphmode-seed`, `--graphmode-profile`, ...). torch and the fuzz engine are imported only when a
fixture is used.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import pytest

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import GraphTarget, TargetFactory
from pytest_graphmode.loader import TargetError, check_target
from pytest_graphmode.report import progress_line
from pytest_graphmode.settings import hypothesis_settings, resolve_backend, settings_of, summary_of

if TYPE_CHECKING:
    from hypothesis import settings as HypothesisSettings

    from pytest_graphmode.runtime.backends import Backend


class Twins(NamedTuple):
    """A graph-mode and an eager target made with the same seed: same weights, same state."""

    graph: GraphTarget
    eager: GraphTarget


class GraphmodeFuzz:
    """The value of the `graphmode_fuzz` fixture: `graphmode_fuzz(factory, **options)` runs the
    stock campaign, adds it to the session summary and raises `GraphmodeFailure` on a failed check.

    Options left out come from the run's options; `settings` (Hypothesis settings) replaces the
    profile's entirely, as in `run_campaign`.
    """

    def __init__(self, config: pytest.Config) -> None:
        self._config = config

    def __call__(
        self,
        factory: TargetFactory,
        *,
        backend: str | None = None,
        max_examples: int | None = None,
        max_steps: int | None = None,
        seed: int | None = None,
        features: frozenset[str] | None = None,
        settings: HypothesisSettings | None = None,
        label: str = "campaign",
    ) -> CampaignStats:
        from pytest_graphmode.fuzz import GraphmodeFailure, run_campaign

        run = settings_of(self._config)
        examples = run.examples if max_examples is None else max_examples
        progress = progress_line(self._config, label, planned=examples)
        stats = CampaignStats()
        campaign = run_campaign
        if run.ranks > 1:
            from pytest_graphmode.fuzz.ranks import run_rank_campaign

            campaign = functools.partial(run_rank_campaign, ranks=run.ranks)
        try:
            campaign(
                factory,
                backend=resolve_backend(backend) if backend else run.backend,
                max_examples=examples,
                max_steps=run.steps if max_steps is None else max_steps,
                seed=run.seed if seed is None else seed,
                features=features,
                progress=progress.update,
                settings=settings or hypothesis_settings(examples),
                stats=stats,
            )
        except (GraphmodeFailure, KeyboardInterrupt):
            # What ran until the failure or Ctrl-C belongs in the summary and the report.
            summary_of(self._config).add_campaign(stats)
            raise
        finally:
            progress.finish()
        summary_of(self._config).add_campaign(stats)
        return stats


@pytest.fixture(scope="session")
def graphmode_backend(pytestconfig: pytest.Config) -> Iterator[Backend]:
    """The backend object (`sim` or `cuda`) of `--graphmode-backend`, active (on sim: torch routed
    through it) from the first test that requests it to the end of the session."""
    from pytest_graphmode.runtime import backends

    with backends.get(settings_of(pytestconfig).backend).active() as backend:
        yield backend


@pytest.fixture(scope="session")
def graphmode_target_factory(pytestconfig: pytest.Config) -> TargetFactory:
    """The factory named by `--graphmode-target` (or ini `graphmode_target`)."""
    try:
        return settings_of(pytestconfig).factory
    except TargetError as exc:
        raise pytest.UsageError(f"--graphmode-target / graphmode_target: {exc}") from exc


@pytest.fixture
def graphmode_twins(
    pytestconfig: pytest.Config, graphmode_target_factory: TargetFactory
) -> Iterator[Twins]:
    """A graph and an eager target from the configured factory, same seed; closed afterwards."""
    settings = settings_of(pytestconfig)
    graph = graphmode_target_factory("graph", seed=settings.seed, backend=settings.backend)
    try:
        eager = graphmode_target_factory("eager", seed=settings.seed, backend=settings.backend)
    except BaseException:
        graph.close()
        raise
    try:
        check_target(graph)
        check_target(eager)
        yield Twins(graph, eager)
    finally:
        try:
            graph.close()
        finally:
            eager.close()


@pytest.fixture
def graphmode_fuzz(pytestconfig: pytest.Config) -> GraphmodeFuzz:
    """Run the stock campaign against a factory you pass: `graphmode_fuzz(make_target)`."""
    return GraphmodeFuzz(pytestconfig)
