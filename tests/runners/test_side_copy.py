"""The side-copy runner (`side_copy.py`): a design of its own (a side copy stream ordered by events,
pinned downloads, graphs captured at start-up and per speculative query length). Correct, it
passes the harness; each of its bugs, modelled on ones public engines shipped, is caught by the
check that names it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pytest_graphmode.fuzz import run_campaign
from pytest_graphmode.runtime.backends.sim import drop_in
from tests.runners import side_copy_target
from tests.runners.caught import assert_caught, failure_of
from tests.runners.side_copy import BUGS

# bug -> (the check that names it, whether it is found before step 0, when the twins are made)
CAUGHT_BY = {
    "padding_slot_zero": ("states_match", True),  # the start-up capture wrote block 0
    "upload_over_live_inputs": ("no_stream_races", True),  # the first upload vs the allocation
    "padding_slot_zero_in_steps": ("kv_writes_confined", False),
    "key_without_query_len": ("kv_writes_land", False),  # the draft tokens' K/V never written
    "temperature_baked": ("replay_matches_eager", False),
    "tokens_read_before_download": ("no_stream_races", False),
    "replay_without_upload_wait": ("no_stream_races", False),
}
# Found on a GPU too, whatever the timing: no race among them.
ON_CUDA = ("padding_slot_zero", "padding_slot_zero_in_steps", "key_without_query_len")


def _factory(bug: str) -> Callable[..., side_copy_target.SideCopyTarget]:
    return getattr(side_copy_target, bug)  # type: ignore[no-any-return]


def test_every_bug_has_a_factory_and_an_expected_check() -> None:
    assert set(CAUGHT_BY) == BUGS
    with drop_in():  # the runner's torch.cuda is the sim's
        for bug in BUGS:
            target = _factory(bug)("eager", seed=0, backend="sim")
            assert target.runner.bug == bug
            target.close()


def test_an_unknown_bug_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown bug 'slow'"):
        side_copy_target.SideCopyTarget("eager", seed=0, backend="sim", bug="slow")


def test_the_correct_runner_passes_the_harness_on_sim() -> None:
    stats = run_campaign(side_copy_target.make_target, max_examples=40, max_steps=8, seed=0)
    assert stats.failures == []
    assert stats.paths["full"] > 0
    assert stats.checks_run["no_stream_races"] > 0


@pytest.mark.parametrize("bug", sorted(CAUGHT_BY))
def test_each_bug_is_caught_on_sim(bug: str) -> None:
    _assert_caught(bug, "sim")


@pytest.mark.graphmode_cuda
def test_the_correct_runner_passes_the_harness_on_a_gpu() -> None:
    _need_a_gpu()
    stats = run_campaign(
        side_copy_target.make_target, backend="cuda", max_examples=40, max_steps=8, seed=0
    )
    assert stats.failures == []
    assert stats.paths["full"] > 0


@pytest.mark.graphmode_cuda
@pytest.mark.parametrize("bug", ON_CUDA)
def test_each_timing_free_bug_is_caught_on_a_gpu(bug: str) -> None:
    _need_a_gpu()
    _assert_caught(bug, "cuda")


def _assert_caught(bug: str, backend: str) -> None:
    check, when_made = CAUGHT_BY[bug]
    assert_caught(failure_of(_factory(bug), backend), check, at_start_up=when_made)


def _need_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
