"""What a run rejects before any campaign starts: a broken target, an unwritable report path.

Each case ends in one usage error naming what to fix, with no test run and no summary.
"""

import pytest

from tests.plugin.conftest import TOY


def run_with(pytester: pytest.Pytester, *options: str) -> pytest.RunResult:
    return pytester.runpytest("--graphmode-fuzz", "--graphmode-backend=sim", *options)


def assert_one_usage_error(result: pytest.RunResult, message: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --graphmode-*{message}*"])
    errors = [line for line in result.stderr.lines if line.startswith("ERROR")]
    assert len(errors) == 1, result.stderr.str()
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    result.stdout.no_fnmatch_line("*graphmode fuzz summary*")
    result.stdout.no_fnmatch_line("*passed*")


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("make_target_without_step", "does not follow the target contract*method step() missing"),
        (
            "make_target_with_too_many_blocks",
            "the graph twin's state() disagrees with its spec*no state() tensor has "
            "spec.num_blocks * spec.block_size = 32 * 4 = 128 rows, one per KV slot "
            "(state()[[]'kv'[]] has 64 rows)*",
        ),
        (
            "make_raising_target",
            "factory('graph', seed=*, backend='sim') raised RuntimeError: cannot open the model "
            "weights (*graphmode_toy.py:*)",
        ),
        (
            "make_target_without_eager_twin",
            "factory('eager', seed=*, backend='sim') raised NotImplementedError: eager mode*",
        ),
    ],
)
def test_a_broken_target_is_one_usage_error_before_any_campaign(
    toy_project: pytest.Pytester, factory: str, message: str
) -> None:
    result = run_with(toy_project, f"--graphmode-target=graphmode_toy:{factory}")
    assert_one_usage_error(result, message)


def test_the_target_is_checked_once_also_where_the_project_has_fuzz_tests(
    toy_project: pytest.Pytester,
) -> None:
    toy_project.makepyfile(
        test_own="import pytest\n@pytest.mark.graphmode_fuzz\ndef test_mine():\n"
        "    raise AssertionError('must not run')\n"
    )
    result = run_with(toy_project, "--graphmode-target=graphmode_toy:make_raising_target")
    assert_one_usage_error(result, "raised RuntimeError: cannot open the model weights")


def test_an_unwritable_report_path_is_a_usage_error_before_any_campaign(
    toy_project: pytest.Pytester,
) -> None:
    blocker = toy_project.path / "not-a-folder"
    blocker.write_text("")
    result = run_with(
        toy_project, f"--graphmode-target={TOY}", f"--graphmode-report={blocker}/report.json"
    )
    assert_one_usage_error(result, f"report*cannot create the folder {blocker}*")


def test_a_report_path_that_is_a_folder_is_a_usage_error(toy_project: pytest.Pytester) -> None:
    result = run_with(
        toy_project, f"--graphmode-target={TOY}", f"--graphmode-report={toy_project.path}"
    )
    assert_one_usage_error(result, "report*is a directory; give a file name*")


def test_a_graph_twin_that_raises_beside_a_working_eager_twin_is_a_failed_check(
    toy_project: pytest.Pytester,
) -> None:
    # A capture that fails is a graph-mode bug, not a target of the wrong shape: the campaign
    # reports it as a check with a replay snippet.
    result = run_with(
        toy_project,
        "--graphmode-target=graphmode_toy:make_target_failing_capture",
        "--graphmode-seed=0",
        "--graphmode-examples=2",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*graphmode check 'replay_matches_eager' failed*",
            "*RuntimeError: the captured forward read a host tensor*",
            "*replay(events, backend='sim'*",
        ]
    )
    assert "ERROR: --graphmode" not in result.stderr.str()
