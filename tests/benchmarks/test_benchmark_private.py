"""pytest-benchmark's private names that `graphmode_benchmark` relies on are still there.

If one of these fails after a pytest-benchmark upgrade, `pytest_graphmode/_benchmark_private.py`
is the one module to adapt.
"""

from __future__ import annotations

import pytest

from pytest_graphmode._benchmark_private import PytestBenchmarkChanged, fixture_class, use_timer

from .conftest import run_benchmarks

SIBLING_ON_A_STEP_CLOCK = """
from pytest_graphmode._benchmark_private import benchmark_session, sibling_fixture, use_timer

def test_sibling(benchmark, request):
    session = benchmark_session(request.config)
    before = len(session.benchmarks)
    readings = iter(range(100))
    sibling = sibling_fixture(request.node, benchmark.extra_info)
    use_timer(sibling, lambda: float(next(readings)))
    sibling.pedantic(lambda: None, rounds=3, iterations=1, warmup_rounds=0)
    assert sibling.extra_info is benchmark.extra_info
    assert len(session.benchmarks) == before + 1
    assert sibling.stats.stats.median == 1.0  # one clock step per round: the timer was used
    benchmark.pedantic(lambda: None, rounds=1)
"""


def test_benchmark_fixture_is_where_it_was_and_takes_the_arguments_passed_to_it() -> None:
    from pytest_benchmark.fixture import BenchmarkFixture

    assert fixture_class() is BenchmarkFixture


def test_a_missing_private_name_is_an_error_naming_the_installed_version() -> None:
    with pytest.raises(PytestBenchmarkChanged, match=r"pytest-benchmark \S+ has no Benchmark"):
        use_timer(object(), lambda: 0.0)


def test_a_sibling_entry_records_rounds_with_the_timer_it_is_given(
    pytester: pytest.Pytester,
) -> None:
    run_benchmarks(pytester, SIBLING_ON_A_STEP_CLOCK).assert_outcomes(passed=1)
