"""The suite's guard (the root conftest): a test that leaves the sim routing torch fails, naming
what it left, so that no later test of its process runs through the sim unknowingly."""

from pathlib import Path

import pytest

ROOT_CONFTEST = Path(__file__).parents[2] / "conftest.py"


def test_a_test_that_leaves_the_drop_in_active_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makepyfile(
        test_leaks="""
from pytest_graphmode.runtime.backends.sim import drop_in

LEFT_OPEN = drop_in()  # held: a scope dropped unreferenced is closed by the collector

def test_leaves_it_active():
    LEFT_OPEN.__enter__()

def test_enters_and_leaves():
    with drop_in():
        pass
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaves_it_active*",
            "*left the sim as (drop-in active, dispatch active) = (True, True), not (False, False)*",
        ]
    )
