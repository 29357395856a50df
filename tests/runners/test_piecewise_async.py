"""The piecewise/async runner (`piecewise_async.py`): vLLM V1-style FULL_AND_PIECEWISE graphs over a
persistent batch, with pinned staging and steps that may overlap. Correct, it passes the harness;
each of its bugs, modelled on ones public engines shipped, is caught by the check that names it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from pytest_graphmode.fuzz import run_campaign
from pytest_graphmode.runtime.backends.sim import drop_in
from tests.runners import piecewise_async_target
from tests.runners.caught import assert_caught, failure_of
from tests.runners.piecewise_async import BUGS

# bug -> the check that names it on seed 0
CAUGHT_BY = {
    # the host rewrites the pinned persistent batch under the last step's queued copies
    "batch_updated_before_prep_wait": "no_stream_races",
    # a mixed batch replays a decode graph: first in the ninth leading example, where a preempted
    # request's four tokens come back beside two decodes, and the recomputed keys land outside the
    # batch's blocks (seeds 0-2 at example 9; before that example, 38, 88 and 12, when the sim
    # refused an index the graph computed out of bounds)
    "uniform_decode_by_token_total": "kv_writes_confined",
    "piecewise_pad_slots_stale": "kv_writes_confined",
    # a request moved into a hole appends its next block at the wrong column, so the token that
    # starts that block writes elsewhere: a departure from a lower row, then a block boundary of
    # the moved request, which the fourth leading example holds
    "block_count_not_moved_on_condense": "kv_writes_land",
    # the padding request reads a departed request's table row: out of bounds on the sim
    "decode_table_uploaded_unpadded": "replay_matches_eager",
}
# Found on a GPU without a device fault: the two whose indices run out of bounds would fault on
# a GPU, which only a campaign in a process of its own (the plugin's) can report and outlive. The
# race shows on a GPU in the first pipelined pair (delayed): the first step's upload carries the
# second step's inputs, so a token's keys and values land in another step's slot, or its logits
# are another row's, whichever a check sees first.
ON_CUDA: dict[str, str | set[str]] = {
    "piecewise_pad_slots_stale": "kv_writes_confined",
    "block_count_not_moved_on_condense": "kv_writes_land",
    "batch_updated_before_prep_wait": {"kv_writes_land", "replay_matches_eager"},
}


def _factory(bug: str) -> Callable[..., piecewise_async_target.PiecewiseAsyncTarget]:
    return getattr(piecewise_async_target, bug)  # type: ignore[no-any-return]


def test_every_bug_has_a_factory_and_an_expected_outcome() -> None:
    assert set(CAUGHT_BY) == BUGS
    with drop_in():  # the runner's torch.cuda is the sim's
        for bug in BUGS:
            target = _factory(bug)("eager", seed=0, backend="sim")
            assert target.runner.bug == bug
            target.close()


def test_an_unknown_bug_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown bug 'slow'"):
        piecewise_async_target.PiecewiseAsyncTarget("eager", seed=0, backend="sim", bug="slow")


def test_the_correct_runner_passes_the_harness_on_sim() -> None:
    stats = run_campaign(piecewise_async_target.make_target, max_examples=40, max_steps=8, seed=0)
    assert stats.failures == []
    assert stats.paths["full"] > 0
    assert stats.paths["piecewise"] > 0


@pytest.mark.parametrize("bug", sorted(CAUGHT_BY))
def test_each_bug_is_caught_on_sim(bug: str) -> None:
    _assert_caught(bug, "sim")


@pytest.mark.graphmode_cuda
def test_the_correct_runner_passes_the_harness_on_a_gpu() -> None:
    stats = run_campaign(
        piecewise_async_target.make_target, backend="cuda", max_examples=40, max_steps=8, seed=0
    )
    assert stats.failures == []
    assert stats.paths["full"] > 0
    assert stats.paths["piecewise"] > 0


@pytest.mark.graphmode_cuda
@pytest.mark.parametrize("bug", sorted(ON_CUDA))
def test_each_bug_is_caught_on_a_gpu(bug: str) -> None:
    _assert_caught(bug, "cuda")


@pytest.mark.parametrize(("block_size", "num_blocks"), [(4, 48), (16, 24)])
def test_a_block_count_left_behind_by_a_condense_is_found_by_a_leading_example(
    monkeypatch: pytest.MonkeyPatch, block_size: int, num_blocks: int
) -> None:
    # The fourth leading example empties the first row, then has the request moved into it start
    # a new block. Without it: 14-141 examples on seeds 0-4 with 4-slot blocks, none in 300 with
    # 16-slot ones.
    config = piecewise_async_target.CONFIG
    model = dataclasses.replace(config.model, block_size=block_size, num_blocks=num_blocks)
    monkeypatch.setattr(piecewise_async_target, "CONFIG", dataclasses.replace(config, model=model))
    failure = failure_of(_factory("block_count_not_moved_on_condense"), "sim", examples=4)
    assert_caught(failure, "kv_writes_land", at_start_up=False)


def _assert_caught(bug: str, backend: str) -> None:
    failure = failure_of(_factory(bug), backend)
    assert_caught(failure, ON_CUDA[bug] if backend == "cuda" else CAUGHT_BY[bug], at_start_up=False)
