"""transformers 5.0 to 5.3, whose batch processor is built by the generation loop and pads,
captures and replays itself: the engine hands it the caller's batch through a one-batch
scheduler."""

from types import SimpleNamespace

import pytest

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.fuzz import run_campaign
from pytest_graphmode.hf.continuous_api import _intervals, _LastLookup, _OneBatch
from pytest_graphmode.hf.target import make_target
from pytest_graphmode.hf.versions import check_version, has, installed_layout, support_problem

PROMPT = tuple(range(1, 11))  # 10 tokens: padded to 16 query tokens, 32 KV tokens read


def _state(tokens: int, context: int) -> SimpleNamespace:
    return SimpleNamespace(tokens_to_process=[0] * tokens, position_offset=context)


def test_the_one_batch_scheduler_hands_out_the_callers_batch() -> None:
    states = [_state(10, 0), _state(1, 17)]
    futures = [SimpleNamespace(state=state) for state in states]
    assert _OneBatch(futures, states).schedule_batch(32, 256) == futures


def test_the_one_batch_scheduler_refuses_a_batch_over_transformers_budgets() -> None:
    states = [_state(20, 0), _state(20, 0)]
    with pytest.raises(ValueError, match="40 query tokens reading 0 cached ones is over"):
        _OneBatch(states, states).schedule_batch(32, 256)


def test_the_graph_dict_before_5_3_remembers_the_key_last_looked_up_or_stored() -> None:
    graphs = _LastLookup({(16, 32): "replayed"})
    assert graphs.get((16, 32)) == "replayed" and graphs.last == (16, 32)
    graphs[(32, 64)] = "captured"
    assert graphs.last == (32, 64)


def test_interval_counts_give_the_buckets_of_the_interval_sizes() -> None:
    assert (_intervals(32, 16), _intervals(256, 32)) == (2, 8)
    with pytest.raises(ValueError, match="12 must divide 32"):
        _intervals(32, 12)


needs_continuous_api = pytest.mark.skipif(
    support_problem() is not None or installed_layout() != "continuous_api",
    reason="needs transformers 5.0 to 5.3",
)


@needs_continuous_api
def test_a_batch_is_padded_by_transformers_and_keys_its_graph_by_the_padded_sizes() -> None:
    graph = make_target("graph", seed=0, backend="sim")
    captured = graph.step(Batch((Request(1, PROMPT, 0, (5, 2)),)))
    replayed = graph.step(Batch((Request(1, (4,), len(PROMPT), (5, 2)),)))
    graph.close()
    assert captured.reason is not None and "keyed (16, 32)" in captured.reason
    assert (replayed.path, replayed.graph_key) == ("full", (16, 32))


@needs_continuous_api
def test_before_the_compute_stream_the_sim_campaign_finds_no_stream_race() -> None:
    # 5.0 to 5.2 capture on a fresh stream that waits for the current one and replay on the
    # current one: the campaign that finds the race from 5.3 (test_target.py) passes.
    if has(check_version(), "compute_stream"):
        pytest.skip("from 5.3 the race is found (tests/hf/test_target.py)")
    run_campaign(make_target, backend="sim", max_examples=3, max_steps=6, seed=0)
