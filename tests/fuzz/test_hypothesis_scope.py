"""A campaign's draws follow from its seed alone, whatever modules the process has loaded."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import hypothesis
import pytest
from hypothesis import strategies as st

from pytest_graphmode.fuzz import run_campaign
from pytest_graphmode.fuzz.hypothesis_scope import draws_from_the_seed_alone
from tests.runners import minimal

# Large enough for Hypothesis to keep (it drops integers within 100 of zero, which it favours
# anyway) and within every wide integer range a campaign draws from.
PROBE_CONSTANTS = ", ".join(str(1_000 + 7 * n) for n in range(100))


@pytest.fixture
def load_a_module_with_constants(tmp_path: Path) -> Iterator[Callable[[], None]]:
    """Makes a loader that imports a module of the project (outside site-packages, the standard
    library and any test folder) holding 100 integer literals, and removes it afterwards."""
    name = "graphmode_constants_probe"
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / f"{name}.py").write_text(f"VALUES = ({PROBE_CONSTANTS})\n")
    sys.path.insert(0, str(folder))
    loaded: list[str] = []

    def load() -> None:
        importlib.import_module(name)
        loaded.append(name)

    try:
        yield load
    finally:
        sys.path.remove(str(folder))
        for module in loaded:
            sys.modules.pop(module, None)


def _draws(scope: AbstractContextManager[None]) -> list[int]:
    """300 integers a seeded Hypothesis test draws from a wide range, inside `scope`."""
    seen: list[int] = []

    @hypothesis.seed(11)
    @hypothesis.settings(max_examples=300, database=None, phases=[hypothesis.Phase.generate])
    @hypothesis.given(st.integers(1_000, 2**31 - 1))
    def draw(value: int) -> None:
        seen.append(value)

    with scope:
        draw()
    return seen


@pytest.mark.parametrize("scoped", [True, False], ids=["seed alone", "hypothesis as is"])
def test_a_loaded_modules_constants_move_a_seeds_draws_only_outside_the_scope(
    load_a_module_with_constants, scoped
):
    scope = draws_from_the_seed_alone if scoped else nullcontext
    before = _draws(scope())
    load_a_module_with_constants()
    after = _draws(scope())
    if scoped:
        assert after == before
    else:
        # Hypothesis as it is: the loaded module's constants come into the draws, which is what
        # the scope is for (were this to pass, Hypothesis would no longer draw them)
        assert after != before
        assert {1_000 + 7 * n for n in range(100)} & set(after)


def test_a_campaign_draws_none_of_the_loaded_modules_constants(load_a_module_with_constants):
    from hypothesis.internal.conjecture import providers

    load_a_module_with_constants()
    assert len(providers._get_local_constants()) >= 100
    offered: list[int] = []
    run_campaign(
        minimal.make_target,
        max_examples=3,
        max_steps=2,
        seed=3,
        on_example=lambda seed, events: offered.append(len(providers._get_local_constants())),
    )
    assert offered == [0, 0, 0]
    assert len(providers._get_local_constants()) >= 100  # the user's own tests draw them again


def test_the_scope_offers_no_constants_and_the_last_to_leave_puts_hypothesis_back():
    from hypothesis.internal.conjecture import providers

    scan = providers._get_local_constants
    with draws_from_the_seed_alone():
        patched = providers._get_local_constants
        assert patched is not scan
        assert len(patched()) == 0
        with draws_from_the_seed_alone():
            assert providers._get_local_constants is patched
        assert providers._get_local_constants is patched  # the outer campaign still runs
    assert providers._get_local_constants is scan
