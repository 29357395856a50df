"""Fixtures for the runtime core tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pytest_graphmode.runtime import backends


@pytest.fixture(scope="module", autouse=True)
def _sim_active() -> Iterator[object]:
    """Every runtime test may build sim executors (some in module fixtures): the sim is active
    for each module's life, and torch is plain again between modules."""
    with backends.get("sim").active() as backend:
        yield backend


@pytest.fixture(autouse=True)
def _plain_torch_for_cuda(request: pytest.FixtureRequest, _sim_active: Any) -> Iterator[None]:
    """A test of the cuda backend (marked `graphmode_cuda`, or parametrized with "cuda") runs on
    plain torch: under the sim's modes its operations would be the sim's queued work, and a real
    CUDA capture would record an empty graph."""
    callspec = getattr(request.node, "callspec", None)
    on_cuda = callspec is not None and "cuda" in callspec.params.values()
    if not on_cuda and request.node.get_closest_marker("graphmode_cuda") is None:
        yield
        return
    suspended = 0
    while _sim_active.is_active:
        _sim_active.deactivate()
        suspended += 1
    try:
        yield
    finally:
        for _ in range(suspended):
            _sim_active.activate()


@pytest.fixture(scope="module")
def sim(_sim_active: object) -> object:
    return _sim_active


@pytest.fixture
def closing() -> Iterator[list[object]]:
    """Collects targets/executors and closes them after the test."""
    opened: list[object] = []
    yield opened
    for thing in opened:
        thing.close()  # type: ignore[attr-defined]
