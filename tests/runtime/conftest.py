"""Fixtures for the runtime core tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pytest_graphmode.runtime import backends


@pytest.fixture(scope="session")
def sim() -> object:
    return backends.get("sim")


@pytest.fixture
def closing() -> Iterator[list[object]]:
    """Collects targets/executors and closes them after the test."""
    opened: list[object] = []
    yield opened
    for thing in opened:
        thing.close()  # type: ignore[attr-defined]
