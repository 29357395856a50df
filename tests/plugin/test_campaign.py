"""`pytest --graphmode-fuzz` end to end on the toy target: summary, failures, report, exit codes.

Runs that execute campaigns happen in a fresh process: an in-process pytester run would drop the
torch modules a campaign imports, and torch cannot import them a second time. Each such run is
shared by the tests of one module-scoped fixture.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from pytest import LineMatcher

from tests.plugin.conftest import BROKEN_TOY, TOY, TOY_SOURCE

SMALL = ("--graphmode-backend=sim", "--graphmode-examples=2", "--graphmode-steps=3")
BUILTIN_CAMPAIGN_ONLY = ("--graphmode-seed=1", "-k", "test_campaign and not pinned")

OWN_TESTS = """
import pytest
from hypothesis import Phase, settings
from graphmode_toy import make_broken_target, make_target
from pytest_graphmode.fuzz import GraphmodeFailure


@pytest.mark.graphmode_fuzz
def test_with_options(graphmode_fuzz):
    stats = graphmode_fuzz(make_target, max_examples=3, max_steps=2, seed=7)
    assert stats.examples == 3


@pytest.mark.graphmode_fuzz
def test_hides_the_failure(graphmode_fuzz):
    quick = settings(max_examples=1, phases=[Phase.generate], deadline=None, database=None)
    with pytest.raises(GraphmodeFailure):
        graphmode_fuzz(make_broken_target, max_steps=1, settings=quick)
"""


# The graph twin's 11th step raises KeyboardInterrupt, as Ctrl-C would: each step of a campaign
# steps two graph-mode twins, so 5 steps have been counted by then.
INTERRUPTED_TESTS = """
import pytest
from graphmode_toy import make_target

graph_steps = [0]


def make_interrupted_target(mode, *, seed, backend):
    target = make_target(mode, seed=seed, backend=backend)
    if mode == "graph":
        step = target.step

        def interrupted(batch):
            graph_steps[0] += 1
            if graph_steps[0] > 12:
                raise KeyboardInterrupt
            return step(batch)

        target.step = interrupted
    return target


@pytest.mark.graphmode_fuzz
def test_interrupted(graphmode_fuzz):
    graphmode_fuzz(make_interrupted_target, max_examples=50, max_steps=3)
"""


@dataclass(frozen=True)
class Run:
    ret: int
    lines: list[str]
    path: Path
    text: str

    def fnmatch_lines(self, patterns: list[str]) -> None:
        LineMatcher(self.lines).fnmatch_lines(patterns)


def run_project(tmp_path_factory: pytest.TempPathFactory, files: dict[str, str], *args: str) -> Run:
    """`python -m pytest --graphmode-fuzz ARGS` in a fresh project holding the toy and `files`."""
    project = tmp_path_factory.mktemp("project")
    (project / "graphmode_toy.py").write_text(TOY_SOURCE)
    for name, text in files.items():
        (project / name).write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--graphmode-fuzz", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(project)},
    )
    text = done.stdout + done.stderr
    return Run(done.returncode, text.splitlines(), project, text)


@pytest.fixture(scope="module")
def passing_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_project(
        tmp_path_factory, {}, f"--graphmode-target={TOY}", *SMALL, *BUILTIN_CAMPAIGN_ONLY
    )


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Shrinking a failure takes a while, so the tests below share one failing campaign."""
    return run_project(
        tmp_path_factory,
        {},
        f"--graphmode-target={BROKEN_TOY}",
        *SMALL,
        *BUILTIN_CAMPAIGN_ONLY,
        "--graphmode-report=out/graphmode.json",
    )


@pytest.fixture(scope="module")
def own_tests_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_project(
        tmp_path_factory, {"test_own.py": OWN_TESTS}, f"--graphmode-target={TOY}", *SMALL
    )


def test_passing_campaign_exits_zero_with_the_summary(passing_run: Run) -> None:
    assert passing_run.ret == pytest.ExitCode.OK
    passing_run.fnmatch_lines(
        [
            "*= graphmode fuzz summary =*",
            "campaigns: 1  examples: 2  steps: *",
            "paths: full *  piecewise 0  eager *",
            "token buckets hit (*): 1: *",
            "fallback reasons: *",
            "checks run: *replay_matches_eager: *",
            "failures: 0",
        ]
    )


def test_a_campaign_leaves_no_hypothesis_directory_in_the_project(passing_run: Run) -> None:
    assert not (passing_run.path / ".hypothesis").exists()


def test_campaign_progress_into_a_log_is_plain_lines_with_the_total(passing_run: Run) -> None:
    # Not a terminal: each progress line is a line of its own, never redrawn with a carriage return.
    passing_run.fnmatch_lines(
        [
            "graphmode campaign: example 1 of 2, * steps, 0 failures",
            "graphmode campaign: example 2 of 2, * steps, 0 failures",
        ]
    )
    assert "\r" not in passing_run.text


def test_checks_without_anything_to_judge_are_not_applicable(passing_run: Run) -> None:
    # The toy target tracks no address views.
    passing_run.fnmatch_lines(
        [
            "not applicable (nothing to judge in this run): *address_views_disjoint, pool_within_bound*"
        ]
    )
    LineMatcher(passing_run.lines).no_fnmatch_line("checks run: *address_views_disjoint*")


def test_failed_check_fails_the_run(broken_run: Run) -> None:
    assert broken_run.ret == pytest.ExitCode.TESTS_FAILED


def test_failure_message_names_the_check_values_and_replay_snippet(broken_run: Run) -> None:
    broken_run.fnmatch_lines(
        [
            "*graphmode check 'replay_matches_eager' failed at step 0*",
            "*expected: *",
            "*actual: *",
            "*from graphmode_toy import make_broken_target*",
            "*replay(events, *factory=make_broken_target)*",
        ]
    )


def test_failure_report_shows_the_message_instead_of_the_engine_traceback(
    broken_run: Run,
) -> None:
    broken_run.fnmatch_lines(["*_ test_campaign _*", "graphmode check 'replay_matches_eager'*"])
    LineMatcher(broken_run.lines).no_fnmatch_line("*pytest_graphmode/fuzz/*.py*")


def test_the_first_failure_is_announced_before_it_is_shrunk(broken_run: Run) -> None:
    broken_run.fnmatch_lines(
        [
            "graphmode campaign: check 'replay_matches_eager' failed at example * after * s; "
            "not shrunk: it is the leading example first_pair, a fixed schedule",
            "*_ test_campaign _*",
        ]
    )


def test_summary_lists_the_failure(broken_run: Run) -> None:
    broken_run.fnmatch_lines(
        [
            "*= graphmode fuzz summary =*",
            "failures: 1",
            "  FAILED replay_matches_eager at step 0 (replay seed *): graphmode check*",
            "  (run a failure's replay snippet to reproduce it alone, or --graphmode-seed=1 to "
            "rerun every campaign; the replay seed is the one its snippet passes to `replay`)",
            "first failure: replay_matches_eager at example * of campaign after * s; not shrunk: "
            "it is the leading example first_pair",
            "what the checks prove:",
            "  replay_matches_eager: Graph logits match eager within tolerance*",
            "(-v explains every check)",
            "report: out/graphmode.json",
        ]
    )


def test_json_report_holds_the_run_and_its_results(broken_run: Run) -> None:
    report = json.loads((broken_run.path / "out" / "graphmode.json").read_text())
    assert report["run"] == {
        "target": BROKEN_TOY,
        "backend": "sim",
        "profile": "dev",
        "seed": 1,
        "examples_per_campaign": 2,
        "seconds_per_campaign": None,
        "steps_per_example": 3,
        "ranks": 1,
        "shrink_seconds": 20.0,
        "isolate": "auto",
        "cpu_threads": 1,
        "leading": True,
        "workers": 1,  # a count of examples runs in one process
    }
    assert report["campaigns"] == 1
    assert report["checks_run"]["replay_matches_eager"] >= 1
    [failure] = report["failures"]
    assert failure["check"] == "replay_matches_eager"
    assert "replay(events" in failure["replay_snippet"]


def test_fuzz_only_runs_the_fuzz_tests_and_deselects_the_projects_own(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    own = "def test_not_fuzzing():\n    raise AssertionError('must not run')\n"
    run = run_project(
        tmp_path_factory,
        {"test_own.py": OWN_TESTS, "test_plain.py": own},
        f"--graphmode-target={TOY}",
        *SMALL,
        "--graphmode-fuzz-only",
        "-k",
        "with_options or not_fuzzing",
    )
    assert run.ret == pytest.ExitCode.OK
    run.fnmatch_lines(["*= 1 passed, 2 deselected in *"])


def test_graphmode_fuzz_fixture_runs_a_campaign_with_options(own_tests_run: Run) -> None:
    own_tests_run.fnmatch_lines(["campaigns: 2  examples: *", "*= 2 passed in *"])


def test_a_swallowed_failure_still_fails_the_run(own_tests_run: Run) -> None:
    own_tests_run.fnmatch_lines(["failures: 1", "*= 2 passed in *"])
    assert own_tests_run.ret == pytest.ExitCode.TESTS_FAILED


def test_ctrl_c_keeps_every_step_counted_in_the_summary_and_the_report(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    run = run_project(
        tmp_path_factory,
        {"test_own.py": INTERRUPTED_TESTS},
        f"--graphmode-target={TOY}",
        "--graphmode-backend=sim",
        "--graphmode-report=graphmode.json",
    )
    assert run.ret == pytest.ExitCode.INTERRUPTED
    # The 13th step of a graph-mode twin (graph or clean) is the second leading example's first:
    # the first leading example's 6 steps took 12, each on the graph and the clean twin. Checked
    # before the interrupt: 6 steps.
    run.fnmatch_lines(["campaigns: 1  examples: 2  steps: 6  time: *"])
    report = json.loads((run.path / "graphmode.json").read_text())
    assert (report["campaigns"], report["steps"]) == (1, 6)
    assert report["checks_run"]["replay_matches_eager"] == 6


def test_twins_share_a_seed_and_are_closed_afterwards(toy_project: pytest.Pytester) -> None:
    toy_project.makepyfile(
        test_twins="""
        import torch
        import graphmode_toy

        closed = []

        class Recording(graphmode_toy.ToyTarget):
            def close(self):
                closed.append(self._mode)

        def make(mode, *, seed, backend):
            return Recording(mode, seed, logit_offset=0.0)

        def test_twins_have_the_same_weights(graphmode_twins):
            assert torch.equal(graphmode_twins.graph._table, graphmode_twins.eager._table)
            assert (graphmode_twins.graph._mode, graphmode_twins.eager._mode) == ("graph", "eager")

        def test_both_twins_were_closed():
            assert sorted(closed) == ["eager", "graph"]
        """
    )
    result = toy_project.runpytest("--graphmode-target=test_twins:make")
    result.assert_outcomes(passed=2)


def test_backend_fixture_is_the_configured_backend(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "def test_sim(graphmode_backend):\n    assert graphmode_backend.name == 'sim'\n"
    )
    pytester.runpytest("--graphmode-backend=sim").assert_outcomes(passed=1)


def test_the_builtin_suite_passes_from_the_repository_root_as_make_fuzz_runs_it() -> None:
    # The root conftest.py fails a test that leaves the sim routing torch: the suite's tests must
    # start every session fixture they use before they begin (the README's `make fuzz`).
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
            "--graphmode-fuzz-only", *SMALL, "--graphmode-seed=1", "-rs",
            "--pyargs", "pytest_graphmode._builtin.suite",
        ],
        cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == pytest.ExitCode.OK, done.stdout[-3000:] + done.stderr[-2000:]
    # seed 1 is a pinned seed's: that campaign would repeat test_campaign's, and is skipped
    assert "3 passed, 1 skipped" in done.stdout, done.stdout[-3000:]
    assert "--graphmode-seed=1 makes test_campaign this very campaign: not run twice" in (
        done.stdout
    )
    assert "campaigns: 2 " in done.stdout


def test_a_time_budgeted_campaign_runs_on_the_workers_asked(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # The helper starts a process of its own (torch imported again) and runs nothing once the
    # budget is spent: 6 s left it no step on a loaded 2-core machine.
    run = run_project(
        tmp_path_factory,
        {},
        f"--graphmode-target={TOY}",
        "--graphmode-backend=sim",
        "--graphmode-seconds=12",
        "--graphmode-steps=3",
        "--graphmode-workers=2",
        "--graphmode-report=out/graphmode.json",
        *BUILTIN_CAMPAIGN_ONLY,
    )
    assert run.ret == 0, run.text
    run.fnmatch_lines(["graphmode: * seconds=12 steps=3 workers=2", "failures: 0"])
    report = json.loads((run.path / "out" / "graphmode.json").read_text())
    assert report["run"]["workers"] == 2
    # The helper's steps are watched for device faults in its child process; this process's
    # own campaign runs in-process on sim, where no step is counted for that check.
    assert report["checks_run"]["no_device_fault"] >= 1
    assert report["checks_run"]["replay_matches_eager"] > report["checks_run"]["no_device_fault"]


HELPER_FINDS = """
import pytest
from hypothesis import HealthCheck, Phase, settings
from graphmode_toy import make_target_broken_in_children


@pytest.mark.graphmode_fuzz
def test_found_by_a_helper(graphmode_fuzz):
    # Drawn examples only (no leading ones, which are never shrunk), under a time budget.
    drawn = settings(
        max_examples=10_000,
        phases=[Phase.generate, Phase.shrink],
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    graphmode_fuzz(make_target_broken_in_children, max_steps=3, settings=drawn, seconds=120)
"""


def test_a_helpers_failure_is_reported_with_the_runs_shrink_budget(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    run = run_project(
        tmp_path_factory,
        {"test_own.py": HELPER_FINDS},
        f"--graphmode-target={TOY}",
        "--graphmode-backend=sim",
        "--graphmode-seed=1",
        "--graphmode-workers=2",
        "--graphmode-shrink-seconds=0",
        "--graphmode-fuzz-only",
    )
    assert run.ret == 1, run.text
    run.fnmatch_lines(
        [
            "*graphmode check 'replay_matches_eager' failed at step *",
            # The helper kept to the run's shrink budget, and the message names it.
            "*shrinking stopped at its budget of 0 s after *",
            "found by helper campaign 1 of 1 (seed *), a process fuzzing beside this one*",
            "failures: 1",
        ]
    )
