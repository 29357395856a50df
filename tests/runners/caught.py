"""The campaign each runner's tests run against one of its bugs, and what they assert of it."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from pytest_graphmode.contract import TargetFactory
from pytest_graphmode.failure import MADE_TWINS, Failure
from pytest_graphmode.fuzz import GraphmodeFailure, run_campaign


def failure_of(factory: TargetFactory, backend: str, seed: int = 0, examples: int = 300) -> Failure:
    """The failure that a campaign of `factory` (`examples` examples of up to 8 steps, reported
    as found) raises; the test fails if it passes."""
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(
            factory,
            backend=backend,
            max_examples=examples,
            max_steps=8,
            seed=seed,
            shrink_seconds=0,
        )
    return caught.value.failure


def assert_caught(failure: Failure, checks: str | Collection[str], *, at_start_up: bool) -> None:
    """`failure` is of `checks` (one name, or any of several), found while the twins were made
    or in a step, as `at_start_up` says."""
    expected = {checks} if isinstance(checks, str) else set(checks)
    assert failure.check in expected, failure.message
    assert (failure.step == MADE_TWINS) == at_start_up, failure.message
