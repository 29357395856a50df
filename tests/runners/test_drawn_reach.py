"""drawn_reach: a runner's bug in a campaign of drawn examples only."""

from __future__ import annotations

import pytest

from tests.runners.drawn_reach import main, reach


def test_a_bug_drawn_schedules_reach_is_caught_by_the_check_its_tests_name() -> None:
    # the capture step's state advanced twice: any drawn decode step that captures shows it
    found = reach("capture_step_state_advanced_twice", seed=0, examples=5, steps=8)
    assert found.example is not None and 1 <= found.example <= 5
    assert (found.check, found.expected) == ("replay_matches_eager", True)


def test_an_unknown_runner_is_refused_before_any_campaign(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--only", "no_such_runner"])
    assert (
        "not runners of tests/runners/test_from_docs.py: no_such_runner" in capsys.readouterr().err
    )
