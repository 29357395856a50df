"""Every test that uses the fixture `be` carries the mark `graphmode_gpu_alone`.

`be`'s delays decide the test's outcome only on a GPU the test has to itself. The mark skips the
test beside other pytest workers and has `make test` run it again alone; a test without it would
run beside them and its race could come out the other way. The tests need a GPU, so without this
check a missing mark would show only there.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from types import FunctionType

import pytest


def _tests_using_be() -> list[FunctionType]:
    found = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        module = importlib.import_module(f"tests.fuzz.{path.stem}")
        for name, function in vars(module).items():
            is_test = name.startswith("test_") and inspect.isfunction(function)
            if is_test and "be" in inspect.signature(function).parameters:
                found.append(function)
    return found


def _marks(function: FunctionType) -> set[str]:
    return {mark.name for mark in getattr(function, "pytestmark", [])}


def test_the_tests_whose_outcome_a_delay_decides_are_found() -> None:
    assert len(_tests_using_be()) >= 10


@pytest.mark.parametrize("function", _tests_using_be(), ids=lambda f: f.__name__)
def test_a_test_using_be_is_marked_to_have_the_gpu_alone(function: FunctionType) -> None:
    assert "graphmode_gpu_alone" in _marks(function), (
        f"{function.__module__}.{function.__name__} uses `be`: mark it "
        "@pytest.mark.graphmode_gpu_alone"
    )
