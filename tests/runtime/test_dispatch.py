"""The dispatcher's decision table: FULL for uniform batches that fit, then PIECEWISE, then EAGER."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from runtime_helpers import make_batch

from pytest_graphmode.runtime.dispatch import (
    GRAPHS_DISABLED,
    NON_UNIFORM,
    OVERSIZED,
    QUERY_TOO_LONG,
    Dispatcher,
)
from pytest_graphmode.runtime.keys import GraphKey

SIZES = [1, 2, 4, 8]
PIECES = [16, 32]


def full(reqs: int, q: int, phase: str = "decode", adapters: bool = False) -> GraphKey:
    return GraphKey("full", reqs * q, reqs, q, phase, adapters)  # type: ignore[arg-type]


PIECE16 = GraphKey("piecewise", 16, None, None, None, False)

# fmt: off
# query lengths, context, adapters, piecewise -> path, key, padded reqs, padded tokens, cause, reason
TABLE = [
    pytest.param([1] * 3, 5, None, False, "full", full(4, 1), 4, 4, None, "padded to 4",
                 id="decode-3"),
    pytest.param([1] * 8, 5, None, False, "full", full(8, 1), 8, 8, None, "8 requests",
                 id="decode-8"),
    pytest.param([2] * 3, 5, None, False, "full", full(4, 2), 4, 8, None, "x 2 tokens",
                 id="spec-k1"),
    pytest.param([4] * 2, 5, None, False, "full", full(2, 4), 2, 8, None, "x 4 tokens",
                 id="spec-k3"),
    pytest.param([2, 2], 0, None, False, "full", full(2, 2, "prefill"), 2, 4, None, "prefill",
                 id="uniform-prefill"),
    pytest.param([1, 1], 5, [0, 2], False, "full", full(2, 1, adapters=True), 2, 2, None, "",
                 id="adapters"),
    pytest.param([4] * 3, 5, None, False, "eager", None, 3, 12, OVERSIZED,
                 "batch of 12 tokens exceeds the largest capture size 8", id="spec-too-many"),
    pytest.param([1] * 9, 5, None, False, "eager", None, 9, 9, OVERSIZED,
                 "batch of 9 tokens exceeds the largest capture size 8, piecewise not enabled",
                 id="too-many"),
    pytest.param([1, 3], 5, None, False, "eager", None, 2, 4, NON_UNIFORM,
                 "non-uniform query lengths (mixed batch), piecewise not enabled",
                 id="mixed"),
    pytest.param([5], 5, None, False, "eager", None, 1, 5, QUERY_TOO_LONG,
                 "query length 5 exceeds max_query_len=4", id="long-query"),
    pytest.param([1, 3], 5, None, True, "piecewise", PIECE16, 16, 16, NON_UNIFORM,
                 "piecewise graph of 16 tokens", id="mixed-piecewise"),
    pytest.param([1] * 9, 5, None, True, "piecewise", PIECE16, 16, 16, OVERSIZED,
                 "piecewise graph of 16 tokens", id="too-many-piecewise"),
    pytest.param([8] * 5, 5, None, True, "eager", None, 5, 40, OVERSIZED,
                 "also exceeds the largest piecewise size 32", id="too-many-tokens-for-pieces"),
]
# fmt: on


@pytest.mark.parametrize(
    (
        "query_lens",
        "context",
        "adapters",
        "piecewise",
        "path",
        "key",
        "reqs",
        "tokens",
        "cause",
        "reason",
    ),
    TABLE,
)
def test_decision_table(
    query_lens: list[int],
    context: int,
    adapters: list[int] | None,
    piecewise: bool,
    path: str,
    key: GraphKey | None,
    reqs: int,
    tokens: int,
    cause: str | None,
    reason: str,
) -> None:
    dispatcher = Dispatcher(SIZES, max_query_len=4, piecewise_sizes=PIECES if piecewise else None)
    decision = dispatcher.decide(make_batch(query_lens, context=context, adapters=adapters))
    assert (decision.path, decision.key) == (path, key)
    assert (decision.padded_reqs, decision.padded_tokens) == (reqs, tokens)
    assert decision.cause == cause
    assert reason in decision.reason


def test_padding_the_request_count_may_push_tokens_over_the_largest_size() -> None:
    decision = Dispatcher([1, 4, 6], max_query_len=2).decide(make_batch([2, 2]))
    assert (decision.path, decision.cause) == ("eager", OVERSIZED)
    assert "pads to 4 requests = 8 tokens, above the largest capture size 6" in decision.reason


def test_piecewise_request_padding_stops_at_max_num_reqs() -> None:
    dispatcher = Dispatcher(SIZES, max_query_len=1, piecewise_sizes=PIECES, max_num_reqs=12)
    decision = dispatcher.decide(make_batch([1, 3, 2]))
    assert (decision.path, decision.padded_reqs, decision.padded_tokens) == ("piecewise", 12, 16)


def test_no_capture_sizes_means_every_batch_runs_eagerly() -> None:
    decision = Dispatcher([], max_query_len=1).decide(make_batch([1]))
    assert (decision.path, decision.cause) == ("eager", GRAPHS_DISABLED)
    assert "no capture sizes" in decision.reason


def test_empty_batch_is_rejected_with_a_reason() -> None:
    with pytest.raises(ValueError, match="at least one request"):
        Dispatcher(SIZES, max_query_len=1).decide(make_batch([]))


def test_dispatch_counts_per_key_and_per_cause_but_decide_counts_nothing() -> None:
    dispatcher = Dispatcher(SIZES, max_query_len=1)
    dispatcher.decide(make_batch([1]))
    assert not dispatcher.by_key and not dispatcher.by_cause
    for query_lens in ([1], [1], [1, 1, 1], [1, 2], [1] * 9):
        dispatcher.dispatch(make_batch(query_lens))
    assert dispatcher.by_key == {full(1, 1): 2, full(4, 1): 1}
    assert dispatcher.by_cause == {NON_UNIFORM: 1, OVERSIZED: 1}


def test_full_keys_come_largest_first_and_stay_within_the_largest_size() -> None:
    keys = Dispatcher(SIZES, max_query_len=4).full_keys(query_lens=(1, 4), adapters=(False, True))
    tokens = [k.num_tokens for k in keys]
    assert tokens == sorted(tokens, reverse=True)
    assert max(tokens) == 8
    assert {(k.num_reqs, k.query_len) for k in keys} == {
        (1, 1),
        (2, 1),
        (4, 1),
        (8, 1),
        (1, 4),
        (2, 4),
    }


@given(
    reqs=st.integers(1, 12),
    q=st.integers(1, 4),
    sizes=st.lists(st.integers(1, 16), min_size=1, max_size=6, unique=True),
)
def test_full_decisions_pad_to_the_smallest_fitting_size(
    reqs: int, q: int, sizes: list[int]
) -> None:
    decision = Dispatcher(sizes, max_query_len=4).decide(make_batch([q] * reqs, context=1))
    fitting = [s for s in sizes if s >= reqs and s * q <= max(sizes)]
    if not fitting:
        assert decision.path == "eager" and decision.cause == OVERSIZED
        return
    assert decision.path == "full"
    assert decision.padded_reqs == min(fitting)
    assert decision.padded_tokens == min(fitting) * q
    assert decision.key == full(min(fitting), q)


def test_graph_keys_reject_inconsistent_fields() -> None:
    with pytest.raises(ValueError, match="!= 9 tokens"):
        GraphKey("full", 9, 4, 2, "decode", False)
    with pytest.raises(ValueError, match="token count only"):
        GraphKey("piecewise", 16, 4, None, None, False)


def test_graph_keys_differ_in_every_topology_field() -> None:
    base = full(4, 1)
    variants = [
        full(8, 1),
        full(4, 2),
        full(4, 1, "prefill"),
        full(4, 1, adapters=True),
        GraphKey("full", 4, 4, 1, "decode", False, extra=("tp2",)),
    ]
    assert len({base, *variants}) == 1 + len(variants)
