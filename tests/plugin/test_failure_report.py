"""`pytest --graphmode-fuzz` on runners that fail: the first failure stops the suite's other
campaigns, the summary and the report keep every count up to it, and a device fault in an isolated
campaign is a named failure with a summary rather than a dead session.

Each run is a fresh `python -m pytest` in an empty project that imports the repository's mutants
and toy targets.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from pytest import LineMatcher

from tests.mutants import buffer_rebound

REPOSITORY = Path(__file__).parents[2]
EARLIER_FAILED = "*: graphmode: skipped after the failure of an earlier campaign: "


@dataclass(frozen=True)
class Run:
    ret: int
    lines: LineMatcher
    report: dict[str, object]


def run_suite(tmp_path_factory: pytest.TempPathFactory, target: str, *args: str) -> Run:
    project = tmp_path_factory.mktemp("project")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "-rs",
            "--graphmode-fuzz",
            "--graphmode-backend=sim",
            f"--graphmode-target={target}",
            "--graphmode-report=report.json",
            *args,
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPOSITORY)},
    )
    lines = LineMatcher((done.stdout + done.stderr).splitlines())
    return Run(done.returncode, lines, json.loads((project / "report.json").read_text()))


@pytest.fixture(scope="module")
def mutant_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_suite(
        tmp_path_factory,
        "tests.mutants.buffer_rebound:make_target",
        "--graphmode-seed=2",  # neither pinned seed: three campaigns
        "--graphmode-examples=40",
        "--graphmode-steps=12",
        "--graphmode-shrink-seconds=5",
    )


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_suite(
        tmp_path_factory,
        "tests.fuzz.faulting_target:make_aborting_target",
        "--graphmode-isolate=on",
        "--graphmode-seed=3",
        "--graphmode-examples=30",
        "--graphmode-steps=4",
    )


@pytest.fixture(scope="module")
def fault_when_made_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_suite(
        tmp_path_factory,
        "tests.fuzz.faulting_target:make_aborting_when_made",
        "--graphmode-isolate=on",
        "--graphmode-seed=3",
        "--graphmode-examples=5",
        "--graphmode-steps=4",
    )


def test_the_mutants_failure_is_announced_reported_and_summarised(mutant_run: Run) -> None:
    assert mutant_run.ret == pytest.ExitCode.TESTS_FAILED
    check = buffer_rebound.EXPECTED_CHECK
    mutant_run.lines.fnmatch_lines(
        [
            f"graphmode campaign: check '{check}' failed at example * after * s; "
            "not shrunk: it is the leading example *, a fixed schedule",
            f"graphmode check '{check}' failed at step *",
            "first failing example: * (the leading example *), at its step *, found after * s; "
            "shrinking skipped*",
        ]
    )
    # Never "examples: 0, steps: 0": every count up to the failure is kept.
    mutant_run.lines.re_match_lines(
        [
            r"campaigns: 1  examples: [1-9]\d*  steps: [1-9]\d*  time: .*",
            rf"checks run: .*{check}: [1-9]\d*.*",
            r"failures: 1",
            rf"  FAILED {check} at step \d+ .*",
            rf"first failure: {check} at example [1-9]\d* of campaign after .* s; not shrunk: it "
            r"is the leading example \w+",
        ]
    )


def test_the_suites_later_campaigns_are_skipped_naming_the_failure(mutant_run: Run) -> None:
    # Both campaigns pinned to a scheduler seed, with one reason: -rs counts them as [2].
    mutant_run.lines.fnmatch_lines(
        [
            f"SKIPPED [[]2[]] {EARLIER_FAILED}campaign failed check "
            f"'{buffer_rebound.EXPECTED_CHECK}' at step *",
            "*= 1 failed, 1 passed, 2 skipped in *",
        ]
    )
    # the summary says which of pytest's skips are campaigns, and why
    mutant_run.lines.fnmatch_lines(
        [
            "campaigns skipped: 2 (pytest counts each as a skipped test)",
            "  test_campaign_pinned_scheduler_seed[[]0[]], test_campaign_pinned_scheduler_seed[[]1[]]: "
            f"{EARLIER_FAILED.removeprefix('*: ')}campaign failed check "
            f"'{buffer_rebound.EXPECTED_CHECK}' at step *",
        ]
    )
    skipped = mutant_run.report["skipped_campaigns"]
    assert isinstance(skipped, dict) and sorted(k.rpartition("::")[2] for k in skipped) == [
        "test_campaign_pinned_scheduler_seed[0]",
        "test_campaign_pinned_scheduler_seed[1]",
    ]


def test_the_report_keeps_the_counts_and_the_first_failure(mutant_run: Run) -> None:
    report = mutant_run.report
    assert report["first_failure_check"] == buffer_rebound.EXPECTED_CHECK
    assert report["first_failure_campaign"] == "campaign"  # the suite's first, not a pinned one
    first = report["first_failure_example"]
    assert isinstance(first, int) and 1 <= first <= report["examples"]  # type: ignore[operator]
    assert report["steps"] and report["checks_run"]
    assert (report["shrink_budget_seconds"], report["planned_examples"]) == (5.0, 40)
    assert report["shrinking"] is False
    assert isinstance(report["failures"], list) and len(report["failures"]) == 1


def test_an_aborting_runner_is_a_named_failure_and_the_session_goes_on(fault_run: Run) -> None:
    assert fault_run.ret == pytest.ExitCode.TESTS_FAILED
    fault_run.lines.fnmatch_lines(
        [
            "graphmode check 'no_device_fault' failed at step * (seed *): *",
            "the campaign's child process died (signal SIGABRT)",
            "*replay it in a fresh process with:",
            "*from tests.fuzz.faulting_target import make_aborting_target",
        ]
    )
    fault_run.lines.re_match_lines(
        [
            r"campaigns: 1  examples: [1-9]\d*  steps: [1-9]\d*  time: .*",
            r"failures: 1",
            r"  FAILED no_device_fault at step \d+ .*",
        ]
    )
    fault_run.lines.fnmatch_lines([f"{EARLIER_FAILED}campaign failed check 'no_device_fault'*"])
    [failure] = fault_run.report["failures"]  # type: ignore[misc]
    assert failure["check"] == "no_device_fault"
    assert fault_run.report["first_failure_check"] == "no_device_fault"


def test_twins_that_abort_while_made_are_made_in_a_child_only(
    fault_when_made_run: Run,
) -> None:
    # Made in this process (the check before the first campaign, the contract test), they would
    # end the session: on a GPU a capture that faults poisons the process's context. The
    # campaign's child checks them first, and dies.
    assert fault_when_made_run.ret == pytest.ExitCode.TESTS_FAILED
    fault_when_made_run.lines.fnmatch_lines(
        [
            "graphmode check 'no_device_fault' failed before the first example (making the "
            "targets that check the runner)",
            "the campaign's child process died (signal SIGABRT)",
        ]
    )
    fault_when_made_run.lines.fnmatch_lines(
        [
            "graphmode campaign: check 'no_device_fault' failed at example 0 after * s; not "
            "shrunk: a faulted device fails every later input",
        ]
    )
    fault_when_made_run.lines.fnmatch_lines(
        [
            # no replay seed: no example had started
            "  FAILED no_device_fault before step 0 (when the twins were made): graphmode check*",
            "first failure: no_device_fault at example 0 of campaign after *",
            "  no_device_fault: The device never faulted and the campaign's process never died*",
        ]
    )
    fault_when_made_run.lines.fnmatch_lines(
        ["SKIPPED * the campaign's child process checks the twins before it fuzzes them*"]
    )
    [failure] = fault_when_made_run.report["failures"]  # type: ignore[misc]
    assert failure["check"] == "no_device_fault"
