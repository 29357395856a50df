"""The private parts of pytest-benchmark that `graphmode_benchmark` relies on, all in one place.

pytest-benchmark's public API is one `benchmark` fixture per test, timed with the timer chosen at
start-up. `graphmode_benchmark` needs one entry per candidate in a single test and a device clock
instead of a host timer; pytest-benchmark offers neither, so this module reaches for:

- `config._benchmarksession`: the session that collects entries and holds the options;
- `pytest_benchmark.fixture.BenchmarkFixture`: made here the way its `benchmark` fixture makes one;
- `BenchmarkFixture._timer`: the timer read before and after each round.

`tests/benchmarks/test_benchmark_private.py` fails when a pytest-benchmark release changes any of
them, and each use here raises an error naming the installed version instead of an AttributeError.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import pytest

FIXTURE_ARGUMENTS = ("node", "add_stats", "logger", "warner", "disabled")
"""The `BenchmarkFixture` constructor arguments (besides the session's options) passed here."""


class PytestBenchmarkChanged(RuntimeError):
    """The installed pytest-benchmark lacks a private name `graphmode_benchmark` relies on."""


def _changed(what: str) -> PytestBenchmarkChanged:
    return PytestBenchmarkChanged(
        f"pytest-benchmark {version('pytest-benchmark')} has no {what}, which graphmode_benchmark "
        "relies on; install a pytest-benchmark release this pytest-graphmode supports "
        "(pip install 'pytest-graphmode[bench]')"
    )


def benchmark_session(config: pytest.Config) -> Any:
    """pytest-benchmark's session of this run."""
    session = getattr(config, "_benchmarksession", None)
    if session is None:
        raise _changed("config._benchmarksession")
    return session


def fixture_class() -> type:
    """`BenchmarkFixture`, checked for the constructor arguments `sibling_fixture` passes."""
    try:
        from pytest_benchmark.fixture import BenchmarkFixture
    except ImportError as exc:
        raise _changed("pytest_benchmark.fixture.BenchmarkFixture") from exc
    parameters = inspect.signature(BenchmarkFixture).parameters
    missing = [name for name in FIXTURE_ARGUMENTS if name not in parameters]
    if missing:
        raise _changed(f"BenchmarkFixture argument(s) {missing}")
    return BenchmarkFixture


def sibling_fixture(node: pytest.Item, extra_info: dict[str, Any]) -> Any:
    """Another entry of `node`'s test, made the way pytest-benchmark makes its fixture, sharing
    `extra_info` with the test's own entry."""
    session = benchmark_session(node.config)
    marker = node.get_closest_marker("benchmark")
    # The marker's timer is replaced by the device clock anyway; its other options apply.
    marked = {k: v for k, v in (marker.kwargs if marker else {}).items() if k != "timer"}
    sibling = fixture_class()(
        node,
        add_stats=session.benchmarks.append,
        logger=session.logger,
        warner=node.warn,
        disabled=session.disabled,
        **{**session.options, **marked},
    )
    sibling.extra_info = extra_info
    return sibling


def use_timer(fixture: Any, clock: Callable[[], float]) -> None:
    """Time `fixture`'s rounds with `clock`: pytest-benchmark fixes its timer when it makes the
    fixture (from --benchmark-timer), and offers no way to change it afterwards."""
    if not hasattr(fixture, "_timer"):
        raise _changed("BenchmarkFixture._timer")
    fixture._timer = clock
