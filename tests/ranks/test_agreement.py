"""The coordination step as a pure function: what every rank runs, given every rank's row."""

from __future__ import annotations

import pytest

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.runtime.buckets import schedule
from pytest_graphmode.runtime.data_parallel import Contribution, agree, contribution
from pytest_graphmode.runtime.dispatch import Dispatcher
from pytest_graphmode.runtime.keys import GraphKey


@pytest.fixture
def dispatcher() -> Dispatcher:
    return Dispatcher(
        schedule("vllm", 16),
        max_query_len=4,
        piecewise_sizes=schedule("pow2", 128, clamp=True),
        max_num_reqs=32,
    )


def decode(num_reqs: int, adapter: int = 0) -> Batch:
    return Batch(tuple(Request(i, (1,), 3, (i + 1,), adapter=adapter) for i in range(num_reqs)))


def prefill(num_tokens: int) -> Batch:
    return Batch((Request(0, tuple(range(num_tokens)), 0, tuple(range(1, 1 + num_tokens))),))


def rows(dispatcher: Dispatcher, *batches: Batch, forced: int | None = None) -> list[Contribution]:
    return [
        contribution(rank, batch, dispatcher, forced_eager=rank == forced, known_keys=0)
        for rank, batch in enumerate(batches)
    ]


def test_decoding_ranks_replay_the_full_graph_of_the_largest_rank(dispatcher: Dispatcher) -> None:
    agreed = agree(rows(dispatcher, decode(3), decode(9)), dispatcher)
    assert agreed is not None
    assert agreed.key == GraphKey("full", 16, 16, 1, "decode", False)
    assert (agreed.padded_reqs, agreed.padded_tokens) == (16, 16)


def test_an_idle_rank_constrains_nothing(dispatcher: Dispatcher) -> None:
    agreed = agree(rows(dispatcher, Batch(()), decode(3)), dispatcher)
    assert agreed is not None and agreed.key == GraphKey("full", 4, 4, 1, "decode", False)


def test_nobody_runs_when_no_rank_has_work(dispatcher: Dispatcher) -> None:
    assert agree(rows(dispatcher, Batch(()), Batch(())), dispatcher) is None


def test_a_prefill_on_one_rank_moves_every_rank_to_its_piecewise_graph(
    dispatcher: Dispatcher,
) -> None:
    agreed = agree(rows(dispatcher, decode(9), prefill(5)), dispatcher)
    assert agreed is not None
    assert agreed.key == GraphKey("piecewise", 16, None, None, None, False)
    assert "rank 1" in agreed.reason


def test_an_adapter_on_one_rank_puts_the_adapter_ops_in_every_rank_s_graph(
    dispatcher: Dispatcher,
) -> None:
    agreed = agree(rows(dispatcher, decode(2), decode(2, adapter=1)), dispatcher)
    assert agreed is not None and agreed.key == GraphKey("full", 2, 2, 1, "decode", True)


def test_a_rank_forced_eager_makes_every_rank_eager_padded_to_the_largest(
    dispatcher: Dispatcher,
) -> None:
    agreed = agree(rows(dispatcher, decode(3), decode(9), forced=0), dispatcher)
    assert agreed is not None
    assert (agreed.path, agreed.key, agreed.padded_reqs) == ("eager", None, 9)
    assert "rank 0 is forced eager" in agreed.reason


def test_a_failed_key_falls_back_to_the_next_weaker_path(dispatcher: Dispatcher) -> None:
    full = GraphKey("full", 4, 4, 1, "decode", False)
    agreed = agree(rows(dispatcher, decode(3), decode(1)), dispatcher, failed=[full])
    assert agreed is not None and agreed.key == GraphKey("piecewise", 4, None, None, None, False)


def test_ranks_with_different_graph_caches_are_refused(dispatcher: Dispatcher) -> None:
    mine, theirs = rows(dispatcher, decode(1), decode(1))
    with pytest.raises(RuntimeError, match="different graph caches"):
        agree([mine, Contribution(*[*theirs.row()[:-1], 1])], dispatcher)
