"""pytest entry point (`pytest11: graphmode`).

Imports neither torch nor CUDA at module level: pytest loads this plugin for every run, also in
projects that never fuzz anything.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphmode", "graph-mode fuzzing (pytest-graphmode)")
    group.addoption(
        "--graphmode-fuzz",
        action="store_true",
        default=False,
        help="run the graph-mode fuzz campaign against the configured target",
    )
