"""What a user sees before any campaign runs: help, skips, usage errors, the header."""

import os

import pytest
import torch

from pytest_graphmode.settings import MAX_AUTO_WORKERS
from tests.plugin.conftest import TOY

OPTIONS = (
    "fuzz",
    "fuzz-only",
    "target",
    "backend",
    "examples",
    "steps",
    "seed",
    "report",
    "profile",
    "shrink-seconds",
    "isolate",
    "seconds",
    "workers",
    "leading",
)


def test_help_lists_every_graphmode_option(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    for name in OPTIONS:
        result.stdout.fnmatch_lines([f"*--graphmode-{name}*"])
    result.stdout.fnmatch_lines(["*graphmode_target (string)*", "*graphmode_profile (string)*"])


def test_help_says_what_each_profile_means(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    text = " ".join(result.stdout.str().split())
    assert (
        "dev = examples for 20 s of up to 8 steps, ci = 50 examples of up to 12 steps, nightly = "
        "500 examples of up to 24 steps" in text
    )
    assert "default dev: the built-in suite takes about a minute on sim" in text


def test_fuzz_only_collects_just_the_builtin_suite(toy_project: pytest.Pytester) -> None:
    toy_project.makepyfile(test_plain="def test_not_fuzzing():\n    pass\n")
    result = toy_project.runpytest(
        "--graphmode-fuzz-only",
        f"--graphmode-target={TOY}",
        "--graphmode-backend=sim",
        "--collect-only",
        "-q",
    )
    result.stdout.fnmatch_lines(
        ["*suite.py::test_campaign", "*4/5 tests collected (1 deselected)*"]
    )
    result.stdout.no_fnmatch_line("*test_not_fuzzing*")


def test_a_run_without_fuzzing_imports_no_torch(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "import sys\ndef test_torch_absent():\n    assert 'torch' not in sys.modules\n"
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_fuzz_marked_test_is_skipped_with_a_reason_without_the_flag(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.mark.graphmode_fuzz\n"
        "def test_campaign():\n"
        "    raise AssertionError('must not run')\n"
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*graph-mode fuzz test: run with --graphmode-fuzz*"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without GPU")
def test_cuda_marked_test_is_skipped_with_a_reason_without_a_gpu(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.mark.graphmode_cuda\n"
        "def test_on_gpu():\n"
        "    raise AssertionError('must not run')\n"
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs a CUDA GPU: torch.cuda.is_available() is False*"])


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--graphmode-backend=tpu", "*--graphmode-backend / graphmode_backend: 'tpu' is not one*"),
        ("--graphmode-profile=weekly", "*graphmode_profile: 'weekly' is not one of*"),
        ("--graphmode-examples=many", "*graphmode_examples: 'many' is not an integer >= 1*"),
        ("--graphmode-seed=-3", "*graphmode_seed: '-3' is not an integer >= 0*"),
        ("--graphmode-seconds=soon", "*graphmode_seconds: 'soon' is not a number of seconds >= 0*"),
        ("--graphmode-cpu-threads=-1", "*graphmode_cpu_threads: '-1' is not an integer >= 0*"),
        ("--graphmode-workers=0", "*graphmode_workers: '0' is not an integer >= 1*"),
        ("--graphmode-workers=many", "*graphmode_workers: 'many' is not an integer >= 1*"),
        ("--graphmode-leading=no", "*graphmode_leading: 'no' is not one of ('on', 'off')*"),
    ],
)
def test_bad_option_value_is_a_usage_error(
    pytester: pytest.Pytester, option: str, message: str
) -> None:
    result = pytester.runpytest(option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_unimportable_target_is_a_usage_error_naming_the_option(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest("--graphmode-fuzz", "--graphmode-target=nowhere_abc:make")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--graphmode-target / graphmode_target: cannot import module 'nowhere_abc'*"]
    )


def test_target_without_factory_is_a_usage_error(toy_project: pytest.Pytester) -> None:
    result = toy_project.runpytest("--graphmode-fuzz", "--graphmode-target=graphmode_toy")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*'graphmode_toy' is not of the form 'module:factory'*"])


def test_header_names_backend_target_and_given_seed(toy_project: pytest.Pytester) -> None:
    result = toy_project.runpytest(
        "--graphmode-fuzz",
        f"--graphmode-target={TOY}",
        "--graphmode-backend=sim",
        "--graphmode-seed=41",
        "--collect-only",
    )
    result.stdout.fnmatch_lines(
        [
            f"graphmode: backend=sim target={TOY} seed=41 (given) profile=dev "
            "examples<=10000 seconds=20 steps=8 workers=*"
        ]
    )


def test_header_says_when_the_leading_examples_are_left_out(toy_project: pytest.Pytester) -> None:
    common = ["--graphmode-fuzz", f"--graphmode-target={TOY}", "--collect-only"]
    left_out = toy_project.runpytest(*common, "--graphmode-leading=off")
    left_out.stdout.fnmatch_lines(["graphmode: * steps=8 leading=off*"])
    default = toy_project.runpytest(*common)
    default.stdout.no_fnmatch_line("graphmode: *leading=*")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--graphmode-examples=5"], "*2 processes need a time budget*"),
        (["--graphmode-profile=ci"], "*2 processes need a time budget*"),
        (["--graphmode-ranks=2"], "*cannot be combined with --graphmode-ranks above 1*"),
    ],
)
def test_workers_where_a_campaign_cannot_use_them_are_a_usage_error(
    toy_project: pytest.Pytester, options: list[str], message: str
) -> None:
    result = toy_project.runpytest(
        "--graphmode-fuzz", f"--graphmode-target={TOY}", "--graphmode-workers=2", *options
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_auto_workers_use_the_cpus_unless_xdist_spreads_the_campaigns(
    toy_project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this run's own xdist, if any
    cpus = min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0)))
    alone = toy_project.runpytest("--graphmode-fuzz", f"--graphmode-target={TOY}", "--collect-only")
    alone.stdout.fnmatch_lines([f"graphmode: * seconds=20 steps=8 workers={cpus}"])
    spread = toy_project.runpytest_subprocess(
        "--graphmode-fuzz", f"--graphmode-target={TOY}", "-n", "2", "--collect-only"
    )
    spread.stdout.fnmatch_lines(["graphmode: * seconds=20 steps=8 workers=1"])


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        # A count runs in one process: no workers shown.
        (["--graphmode-examples=7"], "profile=dev examples=7 steps=8"),
        (["--graphmode-seconds=5"], "profile=dev examples<=10000 seconds=5 steps=8 workers=*"),
        (["--graphmode-examples=7", "--graphmode-seconds=5"], "examples<=7 seconds=5 steps=8 *"),
        (["--graphmode-profile=ci", "--graphmode-seconds=0.5"], "examples<=50 seconds=0.5 *"),
        (["--graphmode-seconds=0"], "profile=dev examples=10000 steps=8"),
        (["--graphmode-workers=3"], "seconds=20 steps=8 workers=3"),
        (["--graphmode-workers=1", "--graphmode-seconds=5"], "seconds=5 steps=8 workers=1"),
    ],
)
def test_an_example_count_or_time_budget_given_replaces_the_profiles(
    toy_project: pytest.Pytester, options: list[str], shown: str
) -> None:
    result = toy_project.runpytest(
        "--graphmode-fuzz", f"--graphmode-target={TOY}", *options, "--collect-only"
    )
    result.stdout.fnmatch_lines([f"graphmode: *{shown}"])


def test_header_shows_a_random_seed_and_how_to_rerun_it(toy_project: pytest.Pytester) -> None:
    result = toy_project.runpytest(
        "--graphmode-fuzz",
        f"--graphmode-target={TOY}",
        "--graphmode-backend=sim",
        "--collect-only",
    )
    result.stdout.fnmatch_lines(["graphmode: *seed=* (random; rerun with --graphmode-seed)*"])


def test_ini_options_configure_the_run_and_the_command_line_wins(
    toy_project: pytest.Pytester,
) -> None:
    toy_project.makeini(
        f"[pytest]\ngraphmode_target = {TOY}\ngraphmode_backend = sim\n"
        "graphmode_profile = ci\ngraphmode_seed = 5\n"
    )
    result = toy_project.runpytest("--graphmode-fuzz", "--graphmode-seed=6", "--collect-only")
    result.stdout.fnmatch_lines(
        [f"graphmode: backend=sim target={TOY} seed=6 (given) profile=ci examples=50 steps=12"]
    )


def test_builtin_suite_is_collected_where_the_project_has_no_fuzz_tests(
    toy_project: pytest.Pytester,
) -> None:
    result = toy_project.runpytest(
        "--graphmode-fuzz",
        f"--graphmode-target={TOY}",
        "--graphmode-backend=sim",
        "--collect-only",
        "-q",
    )
    result.stdout.fnmatch_lines(
        [
            "*suite.py::test_target_follows_contract",
            "*suite.py::test_campaign",
            "*suite.py::test_campaign_pinned_scheduler_seed[[]0[]]",
        ]
    )


def test_builtin_suite_stays_out_where_the_project_has_fuzz_tests(
    toy_project: pytest.Pytester,
) -> None:
    toy_project.makepyfile(
        test_own="import pytest\n@pytest.mark.graphmode_fuzz\ndef test_mine():\n    pass\n"
    )
    result = toy_project.runpytest(
        "--graphmode-fuzz", f"--graphmode-target={TOY}", "--collect-only", "-q"
    )
    result.stdout.fnmatch_lines(["test_own.py::test_mine", "1 test collected*"])
    result.stdout.no_fnmatch_line("*suite.py*")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without GPU")
def test_cuda_backend_without_a_gpu_is_a_usage_error(toy_project: pytest.Pytester) -> None:
    result = toy_project.runpytest(
        "--graphmode-fuzz", f"--graphmode-target={TOY}", "--graphmode-backend=cuda"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--graphmode-backend=cuda but torch.cuda.is_available() is False*sim*"]
    )
