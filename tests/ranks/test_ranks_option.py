"""`--graphmode-ranks`: validated like every option, shown in the header, and a run with it fuzzes
the configured target over that many data-parallel rank processes."""

from __future__ import annotations

import pytest


def test_ranks_below_one_are_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--graphmode-ranks=0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*graphmode_ranks: '0' is not an integer >= 1*"])


def test_the_header_names_the_ranks(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "--graphmode-fuzz", "--graphmode-backend=sim", "--graphmode-ranks=2", "--collect-only"
    )
    result.stdout.fnmatch_lines(["graphmode: backend=sim * steps=8 ranks=2"])


def test_a_run_with_two_ranks_fuzzes_every_rank(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(
        "--graphmode-fuzz",
        "--graphmode-backend=sim",
        "--graphmode-ranks=2",
        "--graphmode-seed=3",
        "--graphmode-examples=1",
        "--graphmode-steps=2",
        "--graphmode-report=report.json",
        "-k",
        "test_campaign and not pinned",
        "-p",
        "no:xdist",
    )
    result.assert_outcomes(passed=1)
    report = (pytester.path / "report.json").read_text()
    assert '"ranks": 2' in report
    assert '"ranks_agree"' in report
