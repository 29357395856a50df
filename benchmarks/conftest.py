"""The benchmark suite's backend, configuration and shared decoder.

The backend comes from `--graphmode-backend`, else the `GRAPHMODE_BACKEND` environment variable,
else `auto` (cuda where a GPU is present). `--graph-memory-json PATH` writes the graph-memory
table (items 5 and 6) where `benchmarks/plot.py` reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from graph_workloads import SUITES, Suite, backend_name

from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.model import Decoder


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--graph-memory-json",
        default=None,
        metavar="PATH",
        help="write the graph-memory table of the capture sweeps to PATH (read by plot.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--graph-memory-json")
    if path is not None:
        Path(path).unlink(missing_ok=True)  # the sweeps of this run append to a fresh file


@pytest.fixture(scope="session")
def graphmode_backend(pytestconfig: pytest.Config) -> Iterator[Any]:
    """The benchmarks' backend (overrides the plugin's fixture to honour `GRAPHMODE_BACKEND`),
    active for the session."""
    with backends.get(backend_name(pytestconfig)).active() as backend:
        yield backend


@pytest.fixture(scope="session")
def suite(graphmode_backend: Any) -> Suite:
    return SUITES[graphmode_backend.name]


@pytest.fixture(scope="session")
def decoder(graphmode_backend: Any, suite: Suite) -> Decoder:
    return Decoder(suite.config, seed=0, device=graphmode_backend.device)


@pytest.fixture(scope="session")
def memory_json(pytestconfig: pytest.Config) -> Path | None:
    path = pytestconfig.getoption("--graph-memory-json")
    return None if path is None else Path(path)


@pytest.fixture(autouse=True)
def _settled(graphmode_backend: Any) -> Iterator[None]:
    """Each benchmark starts with an idle device, so it does not time its predecessor's tail."""
    graphmode_backend.synchronize()
    yield
    graphmode_backend.synchronize()
