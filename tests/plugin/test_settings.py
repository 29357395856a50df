"""One source of Hypothesis settings, whichever way a campaign starts."""

import pytest
from hypothesis import Phase

from pytest_graphmode.settings import hypothesis_settings

SPY_ON_THE_ENGINE = """
import pytest_graphmode.fuzz as fuzz
from pytest_graphmode.fuzz import CampaignStats

def test_campaign_settings(graphmode_fuzz, monkeypatch):
    seen = {}

    def run_campaign(factory, **options):
        seen.update(options)
        return CampaignStats()

    monkeypatch.setattr(fuzz, "run_campaign", run_campaign)
    graphmode_fuzz(object, backend="sim", max_examples=4)
    settings = seen["settings"]
    print("phases", ",".join(sorted(phase.name for phase in settings.phases)))
    print("database", settings.database, "examples", settings.max_examples)
    print("cpu_threads", seen["cpu_threads"])
    print("leading", seen["leading"])
"""


def test_campaign_settings_leave_out_the_explain_phase_and_the_database() -> None:
    settings = hypothesis_settings(7)
    assert Phase.explain not in settings.phases
    assert Phase.shrink in settings.phases
    assert (settings.database, settings.deadline, settings.max_examples) == (None, None, 7)


def test_the_fixture_runs_campaigns_with_the_engine_settings(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SPY_ON_THE_ENGINE)
    result = pytester.runpytest("-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*phases explicit,generate,reuse,shrink,target",
            "database None examples 4",
            "cpu_threads 1",
            "leading True",
        ]
    )


@pytest.mark.parametrize(
    ("option", "threads"), [("--graphmode-cpu-threads=3", 3), ("--graphmode-cpu-threads=0", None)]
)
def test_the_fixture_passes_the_cpu_threads_asked(
    pytester: pytest.Pytester, option: str, threads: int | None
) -> None:
    pytester.makepyfile(SPY_ON_THE_ENGINE)
    result = pytester.runpytest("-s", option)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"cpu_threads {threads}"])


def test_the_fixture_leaves_out_the_leading_examples_when_asked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SPY_ON_THE_ENGINE)
    result = pytester.runpytest("-s", "--graphmode-leading=off")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["leading False"])
