"""Runners written from the public docs alone (`tests/runners/from_docs/`): correct, each passes
the harness; with its bug, each is caught within the campaign's leading examples by the check
that names it."""

from __future__ import annotations

import importlib

import pytest
import torch

from pytest_graphmode.contract import TargetFactory
from pytest_graphmode.fuzz import run_campaign
from tests.runners.caught import assert_caught, failure_of

# runner -> the check that catches its bug on sim
CAUGHT_BY = {
    "max_context_baked": "replay_matches_eager",  # a capture batch's longest context baked in
    "dirty_rows": "kv_writes_land",  # a condensed row never re-uploaded to the device table
    "event_before_copy": "no_stream_races",  # the upload's event recorded before its copies
    "row_params_not_reset": "replay_matches_eager",  # a reused row keeps its sampling seed
    "staging_guard_on_resize": "no_stream_races",  # pinned staging rewritten under its upload
    "derived_weights_cached": "replay_matches_eager",  # a fused weight left out of the update
    "fallback_shares_buffers": "no_stream_races",  # the next upload under a replay still reading
    "adapter_path_baked": "replay_matches_eager",  # the LoRA path left out of a capture
    "adapter_id_baked": "replay_matches_eager",  # one adapter's weights baked into a capture
    "reorder_not_undone": "replay_matches_eager",  # rows left in the runner's own order
    "piecewise_query_len_baked": "replay_matches_eager",  # a capture's longest query baked in
    "weights_loaded_unsynced": "no_stream_races",  # weights still loading when a step reads them
}
# Caught on a GPU too, whatever the timing: no race among them. (`reorder_not_undone` and
# `piecewise_query_len_baked` have no race either, but have not run on a GPU yet.)
ON_CUDA = (
    "max_context_baked",
    "dirty_rows",
    "row_params_not_reset",
    "derived_weights_cached",
    "adapter_path_baked",
    "adapter_id_baked",
)
LEADING = 6  # the campaign's fixed leading examples (fuzz/campaign.py)


def _factory(runner: str, name: str) -> TargetFactory:
    module = importlib.import_module(f"tests.runners.from_docs.{runner}")
    return getattr(module, name)  # type: ignore[no-any-return]


def _passes(runner: str, backend: str) -> None:
    factory = _factory(runner, "make_target")
    stats = run_campaign(factory, backend=backend, max_examples=2 * LEADING, max_steps=8, seed=0)
    assert stats.failures == []
    assert stats.paths["full"] > 0  # it replays graphs: the campaign tested graph mode


@pytest.mark.parametrize("runner", sorted(CAUGHT_BY))
def test_the_correct_runner_passes_the_harness_on_sim(runner: str) -> None:
    _passes(runner, "sim")


@pytest.mark.parametrize("runner", sorted(CAUGHT_BY))
def test_the_bug_is_caught_on_sim_within_the_leading_examples(runner: str) -> None:
    failure = failure_of(_factory(runner, "make_buggy_target"), "sim", examples=LEADING)
    assert_caught(failure, CAUGHT_BY[runner], at_start_up=False)


@pytest.mark.graphmode_cuda
@pytest.mark.parametrize("runner", ON_CUDA)
def test_the_correct_runner_passes_the_harness_on_a_gpu(runner: str) -> None:
    _need_a_gpu()
    _passes(runner, "cuda")


@pytest.mark.graphmode_cuda
@pytest.mark.parametrize("runner", ON_CUDA)
def test_the_bug_is_caught_on_a_gpu_within_the_leading_examples(runner: str) -> None:
    _need_a_gpu()
    failure = failure_of(_factory(runner, "make_buggy_target"), "cuda", examples=LEADING)
    assert_caught(failure, CAUGHT_BY[runner], at_start_up=False)


def _need_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
