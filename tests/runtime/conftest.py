"""Fixtures for the runtime core tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pytest_graphmode.runtime import backends


@pytest.fixture(scope="module", autouse=True)
def _sim_active() -> Iterator[object]:
    """Every runtime test may build sim executors (some in module fixtures): the sim is active
    for each module's life, and torch is plain again between modules."""
    with backends.get("sim").active() as backend:
        yield backend


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
