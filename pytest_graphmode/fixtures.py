"""Fixtures the plugin registers: the backend, the target factory, twins, and a campaign runner.

All of them follow the run's options (`--graphmode-backend`, `--graphmode-target`,
`--graphmode-seed`, `--graphmode-profile`, ...). torch and the fuzz engine are imported only when a
fixture is used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import GraphTarget, TargetFactory
from pytest_graphmode.failure import GraphmodeFailure
from pytest_graphmode.loader import TargetError, check_target
from pytest_graphmode.report import leading_unshrunk, progress_line
from pytest_graphmode.settings import (
    FAILED_CAMPAIGN_KEY,
    TWINS_CHECKED_KEY,
    GraphmodeSettings,
    hypothesis_settings,
    resolve_backend,
    settings_of,
    summary_of,
    workers_per_campaign,
)

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
    profile's entirely, as in `run_campaign`. The time budget `seconds` (see `run_campaign`) comes
    from the run's options too, unless `max_examples` or `settings` asks for a count.
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
        seconds: float | None = None,
        leading: bool | None = None,
    ) -> CampaignStats:
        from pytest_graphmode.fuzz import run_campaign
        from pytest_graphmode.fuzz.isolation import can_isolate, isolates, run_isolated

        earlier = self._config.stash.get(FAILED_CAMPAIGN_KEY, None)
        if earlier is not None:
            # One failure is what a run must report; more campaigns only delay the report.
            pytest.skip(f"graphmode: skipped after the failure of an earlier campaign: {earlier}")
        run = settings_of(self._config)
        examples = run.examples if max_examples is None else max_examples
        if seconds is None and max_examples is None and settings is None:
            seconds = run.seconds
        progress = progress_line(self._config, label, planned=None if seconds else examples)
        announce = self._failure_announcement(label, run.shrink_seconds)
        stats = CampaignStats()
        backend_name = resolve_backend(backend) if backend else run.backend
        isolate = isolates(run.isolate_option, backend_name, factory)
        campaign: Callable[..., CampaignStats] = run_isolated if isolate else run_campaign
        # The check `pytest_sessionstart` left to the first isolated campaign's child.
        check_first = isolate and factory is _configured_factory(run)
        check_first = check_first and twins_checked_in_child(run)
        check_first = check_first and not self._config.stash.get(TWINS_CHECKED_KEY, False)
        if check_first:
            campaign = functools.partial(campaign, check_twins_first=True)
        if run.ranks > 1:  # rank processes are children already
            from pytest_graphmode.fuzz.ranks import run_rank_campaign

            campaign = functools.partial(run_rank_campaign, ranks=run.ranks)
        workers = workers_per_campaign(run, seconds)
        if workers > 1 and (run.workers is not None or can_isolate(factory)):
            from pytest_graphmode.fuzz.helpers import run_with_helpers

            campaign = functools.partial(run_with_helpers, campaign, helpers=workers - 1)

        def on_progress(current: CampaignStats) -> None:
            announce(current)
            progress.update(current)

        try:
            campaign(
                factory,
                backend=backend_name,
                max_examples=examples,
                max_steps=run.steps if max_steps is None else max_steps,
                seed=run.seed if seed is None else seed,
                features=features,
                progress=on_progress,
                settings=settings or hypothesis_settings(examples),
                stats=stats,
                seconds=seconds,
                # Arguments of the call, not of a partial: helper campaigns get them too.
                shrink_seconds=run.shrink_seconds,
                cpu_threads=run.cpu_threads,
                leading=run.leading if leading is None else leading,
            )
        except BaseException as ended:
            if stats.first_failure_check is not None:
                stats.first_failure_campaign = label
            # What ran until the failure, an error or Ctrl-C belongs in the summary and report.
            summary_of(self._config).add_campaign(stats)
            if isinstance(ended, TargetError):  # found by an isolated campaign's child
                pytest.fail(f"--graphmode-target={run.target}: {ended}", pytrace=False)
            if stats.harness_error is not None:  # would end the next campaigns the same way
                self._config.stash[FAILED_CAMPAIGN_KEY] = f"{label} ended in a harness error"
            if isinstance(ended, GraphmodeFailure):
                failure = ended.failure
                seeded = "" if failure.seed is None else f" (seed {failure.seed})"
                self._config.stash[FAILED_CAMPAIGN_KEY] = (
                    f"{label} failed check {failure.check!r} {failure.where}{seeded}"
                )
            raise
        finally:
            progress.finish()
        if check_first:
            self._config.stash[TWINS_CHECKED_KEY] = True
        summary_of(self._config).add_campaign(stats)
        return stats

    def _failure_announcement(
        self, label: str, shrink_seconds: float
    ) -> Callable[[CampaignStats], None]:
        """A callback printing one line as soon as the campaign's first failure is found: shrinking
        it can take a while, and the person waiting should know what is coming."""
        from pytest_graphmode.fuzz.registry import NO_DEVICE_FAULT

        reporter = self._config.pluginmanager.get_plugin("terminalreporter")
        capture = self._config.pluginmanager.get_plugin("capturemanager")
        announced = False

        def announce(stats: CampaignStats) -> None:
            nonlocal announced
            if announced or stats.first_failure_check is None or reporter is None:
                return
            announced = True
            if stats.first_failure_check == NO_DEVICE_FAULT:
                then = "not shrunk: a faulted device fails every later input"
            elif stats.first_failure_leading is not None:
                then = f"{leading_unshrunk(stats.first_failure_leading)}, a fixed schedule"
            elif stats.shrinking and shrink_seconds > 0:
                then = f"shrinking for up to {shrink_seconds:g} s"
            else:
                then = "reporting it unshrunk"
            line = (
                f"graphmode {label}: check {stats.first_failure_check!r} failed at example "
                f"{stats.first_failure_example} after {stats.first_failure_seconds or 0.0:.1f} s; "
                f"{then}"
            )
            _live(capture, lambda: (reporter.line(""), reporter.line(line)))

        return announce


def _live(capture: Any, draw: Callable[[], object]) -> None:
    """Draw on the terminal now: output capture would swallow a line written during a test."""
    if capture is None:
        draw()
        return
    with capture.global_and_fixture_disabled():
        draw()


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
    pytestconfig: pytest.Config,
    graphmode_target_factory: TargetFactory,
    graphmode_backend: Backend,  # active while the twins live, as in a campaign
) -> Iterator[Twins]:
    """A graph and an eager target from the configured factory, same seed; closed afterwards.
    They live in the backend's target scope (on sim: plain `torch.cuda` resolves to the sim)."""
    from pytest_graphmode.runtime import backends

    settings = settings_of(pytestconfig)
    with backends.target_scope(settings.backend):
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


def twins_checked_in_child(run: GraphmodeSettings) -> bool:
    """Whether the configured target's twins are checked by the first campaign's child process
    rather than in this one (campaigns run in child processes, one rank): made here, a runner
    whose construction faults the device would end the pytest process. Raises `TargetError`
    where the target cannot be imported."""
    from pytest_graphmode.fuzz.isolation import isolates

    return run.ranks == 1 and isolates(run.isolate_option, run.backend, run.factory)


def _configured_factory(run: GraphmodeSettings) -> TargetFactory | None:
    """The configured target's factory, or None where it cannot be imported (a run that only
    fuzzes factories its tests pass)."""
    try:
        return run.factory
    except TargetError:
        return None
