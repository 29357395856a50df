"""The `graphmode_benchmark` fixture: entries, extra_info, timing, and its error messages."""

from __future__ import annotations

import time

import pytest

from pytest_graphmode.benchmark import Comparison, Timing, event_clock
from pytest_graphmode.runtime import backends

from .conftest import entries, run_benchmarks

SLOW_EAGER = """
import time

def test_step(graphmode_benchmark):
    graphmode_benchmark(eager=lambda: time.sleep(0.004), replay=lambda: time.sleep(0.001))
"""

PARAMETRIZED = """
import pytest

@pytest.mark.parametrize("bs", [1, 8])
def test_step(graphmode_benchmark, bs):
    graphmode_benchmark.extra_info["batch_size"] = bs
    graphmode_benchmark(eager=lambda: None, replay=lambda: None)
"""


def test_eager_and_replay_are_two_entries_of_one_group(pytester: pytest.Pytester) -> None:
    run_benchmarks(pytester, SLOW_EAGER).assert_outcomes(passed=1)
    found = entries(pytester)
    assert set(found) == {"test_step[eager]", "test_step[replay]"}
    assert {entry["group"] for entry in found.values()} == {"test_step"}


def test_table_shows_both_entries_under_one_header(pytester: pytest.Pytester) -> None:
    result = run_benchmarks(pytester, SLOW_EAGER)
    result.stdout.fnmatch_lines(
        ["*benchmark 'test_step': 2 tests*", "test_step[[]replay[]]*", "test_step[[]eager[]]*"]
    )


def test_extra_info_holds_both_medians_and_their_ratio(pytester: pytest.Pytester) -> None:
    run_benchmarks(pytester, SLOW_EAGER)
    found = entries(pytester)
    info = found["test_step[eager]"]["extra_info"]
    assert info == found["test_step[replay]"]["extra_info"]
    assert info["eager_median_s"] == found["test_step[eager]"]["stats"]["median"]
    assert info["replay_median_s"] == found["test_step[replay]"]["stats"]["median"]
    assert info["speedup"] == pytest.approx(info["eager_median_s"] / info["replay_median_s"])


def test_speedup_reflects_the_slower_eager_step(pytester: pytest.Pytester) -> None:
    run_benchmarks(pytester, SLOW_EAGER)
    info = entries(pytester)["test_step[eager]"]["extra_info"]
    assert info["eager_median_s"] >= 0.004
    assert 0.001 <= info["replay_median_s"] < info["eager_median_s"]
    assert info["speedup"] > 2


def test_entries_keep_the_test_parameters(pytester: pytest.Pytester) -> None:
    run_benchmarks(pytester, PARAMETRIZED).assert_outcomes(passed=2)
    entry = entries(pytester)["test_step[8-replay]"]
    assert entry["params"] == {"bs": 8, "candidate": "replay"}
    assert entry["param"] == "8-replay"
    assert entry["group"] == "test_step[8]"
    assert entry["extra_info"]["batch_size"] == 8


def test_rounds_use_the_device_event_clock(pytester: pytest.Pytester) -> None:
    run_benchmarks(pytester, PARAMETRIZED)
    entry = entries(pytester)["test_step[1-eager]"]
    assert entry["options"]["timer"] == "device_event_clock"
    assert entry["extra_info"]["timer"] == "sim events"


def test_explicit_timing_sets_rounds_and_iterations(pytester: pytest.Pytester) -> None:
    source = """
from pytest_graphmode.benchmark import Timing

def test_step(graphmode_benchmark):
    timing = Timing(rounds=4, iterations=3, warmup_rounds=0)
    graphmode_benchmark(eager=lambda: None, replay=lambda: None, timing=timing)
"""
    run_benchmarks(pytester, source).assert_outcomes(passed=1)
    stats = entries(pytester)["test_step[eager]"]["stats"]
    assert (stats["rounds"], stats["iterations"]) == (4, 3)


def test_compare_names_one_entry_per_candidate(pytester: pytest.Pytester) -> None:
    source = """
def test_step(graphmode_benchmark):
    medians = graphmode_benchmark.compare({"a": lambda: None, "b": lambda: None, "c": lambda: None},
                                      group="peers")
    assert sorted(medians) == ["a", "b", "c"]
"""
    run_benchmarks(pytester, source).assert_outcomes(passed=1)
    found = entries(pytester)
    assert sorted(found) == ["test_step[a]", "test_step[b]", "test_step[c]"]
    assert {entry["group"] for entry in found.values()} == {"peers"}


def test_disabled_benchmarks_run_each_candidate_once_and_still_return_a_comparison(
    pytester: pytest.Pytester,
) -> None:
    source = """
import time

calls = []

def test_step(graphmode_benchmark):
    def eager():
        calls.append("eager")
        time.sleep(0.002)

    result = graphmode_benchmark(eager=eager, replay=lambda: calls.append("replay"))
    assert not graphmode_benchmark.enabled
    assert calls == ["eager", "replay"]
    assert result.eager_median_s >= 0.002 and result.replay_median_s > 0
    assert result.speedup == result.eager_median_s / result.replay_median_s
"""
    result = run_benchmarks(pytester, source, "--benchmark-disable", write_json=False)
    result.assert_outcomes(passed=1)


def test_benchmark_only_runs_graphmode_benchmark_tests(pytester: pytest.Pytester) -> None:
    source = SLOW_EAGER + "\n\ndef test_plain():\n    pass\n"
    run_benchmarks(pytester, source, "--benchmark-only").assert_outcomes(passed=1, skipped=1)


def test_a_second_use_in_one_test_is_refused(pytester: pytest.Pytester) -> None:
    source = """
def test_step(graphmode_benchmark):
    graphmode_benchmark(eager=lambda: None, replay=lambda: None)
    graphmode_benchmark(eager=lambda: None, replay=lambda: None)
"""
    result = run_benchmarks(pytester, source, write_json=False)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*graphmode_benchmark was already used in this test*"])


@pytest.mark.parametrize("name", ["", "a[1]"])
def test_candidate_names_that_break_entry_names_are_refused(
    pytester: pytest.Pytester, name: str
) -> None:
    source = f"""
def test_step(graphmode_benchmark):
    graphmode_benchmark.compare({{{name!r}: lambda: None}})
"""
    result = run_benchmarks(pytester, source, write_json=False)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*must be non-empty and free of*"])


@pytest.mark.parametrize(
    ("rounds", "iterations", "warmup_rounds"), [(0, 1, 0), (1, 0, 0), (1, 1, -1)]
)
def test_timing_refuses_empty_rounds(rounds: int, iterations: int, warmup_rounds: int) -> None:
    with pytest.raises(ValueError, match="Timing needs rounds >= 1"):
        Timing(rounds, iterations, warmup_rounds)


def test_speedup_is_eager_over_replay() -> None:
    assert Comparison(eager_median_s=0.008, replay_median_s=0.002).speedup == 4.0


def test_event_clock_reads_seconds_that_include_host_waits() -> None:
    clock = event_clock(backends.get("sim"))
    start = clock()
    time.sleep(0.02)
    elapsed = clock() - start
    assert 0.02 <= elapsed < 1.0
