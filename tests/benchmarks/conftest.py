"""Shared set-up of the fixture's tests: inner pytest runs of small benchmark files.

Inner runs are in-process; torch and the sim backend (a process-wide dispatch mode) must not be
imported twice, so they are imported once here, before any run.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pytest_graphmode.runtime.backends import sim

PRELOADED = (sim,)


@pytest.fixture(autouse=True)
def _not_an_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest-benchmark switches itself off in any process that looks like an xdist worker; the
    inner runs must time things even when this suite runs under `-n auto`."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


def run_benchmarks(
    pytester: pytest.Pytester, source: str, *args: str, write_json: bool = True
) -> pytest.RunResult:
    """Run `source` as a test file on the sim backend, writing bench.json unless told not to
    (a run that records nothing would warn about the empty file)."""
    pytester.makepyfile(test_inner=source)
    json_args = ["--benchmark-json=bench.json"] if write_json else []
    return pytester.runpytest_inprocess(
        "-p", "no:randomly", "-p", "no:cacheprovider", "--graphmode-backend=sim", *json_args, *args
    )


def entries(pytester: pytest.Pytester) -> dict[str, dict[str, Any]]:
    """The entries of the inner run's bench.json by name."""
    data = json.loads((pytester.path / "bench.json").read_text())
    return {entry["name"]: entry for entry in data["benchmarks"]}
