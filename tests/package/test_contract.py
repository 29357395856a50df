"""The contract's spec and batch legality: how many adapters a target has, and which ids a batch
may name; whether its logits may depend on the batch."""

from __future__ import annotations

import dataclasses

import pytest

from pytest_graphmode.contract import Batch, Request, TargetSpec, batch_problems

SPEC = TargetSpec(
    num_blocks=8,
    block_size=4,
    max_blocks_per_req=2,
    vocab_size=16,
    max_num_reqs=4,
    max_num_tokens=8,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "adapters"}),
    num_adapters=2,
)


def _on_adapter(adapter: int) -> Batch:
    return Batch((Request(req_id=0, tokens=(1,), context_len=1, block_ids=(1,), adapter=adapter),))


def test_a_spec_has_one_adapter_unless_it_says_otherwise() -> None:
    # What runners written before the field get: the one adapter the harness always sent.
    unsaid = {k: v for k, v in dataclasses.asdict(SPEC).items() if k != "num_adapters"}
    assert TargetSpec(**unsaid).num_adapters == 1


@pytest.mark.parametrize(
    ("features", "num_adapters", "message"),
    [
        ({"decode", "adapters"}, 0, "num_adapters=0 must be an integer >= 1 with the 'adapters'"),
        ({"decode"}, -1, "num_adapters=-1 must be an integer >= 0 as a count"),
        ({"decode", "adapters"}, 1.5, "num_adapters=1.5 must be an integer >= 1"),
        ({"decode", "adapters"}, True, "num_adapters=True must be an integer >= 1"),
    ],
)
def test_a_spec_without_a_usable_adapter_count_is_refused(
    features: set[str], num_adapters: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SPEC, features=frozenset(features), num_adapters=num_adapters)


def test_a_spec_without_adapters_may_count_none() -> None:
    spec = dataclasses.replace(SPEC, features=frozenset({"decode"}), num_adapters=0)
    assert batch_problems(_on_adapter(0), spec) == []


@pytest.mark.parametrize("adapter", [0, 1, 2])
def test_a_batch_may_name_every_adapter_up_to_the_count(adapter: int) -> None:
    assert batch_problems(_on_adapter(adapter), SPEC) == []


def test_a_batch_naming_an_adapter_past_the_count_is_refused() -> None:
    assert batch_problems(_on_adapter(3), SPEC) == [
        "request 0 (row 0): adapter=3 outside [0, num_adapters=2]"
    ]


def test_a_spec_is_batch_invariant_unless_it_says_otherwise() -> None:
    assert SPEC.batch_invariant is True
    assert dataclasses.replace(SPEC, batch_invariant=False).batch_invariant is False


def test_a_batch_invariance_that_is_not_a_bool_is_refused() -> None:
    # "no" is truthy: taken as given it would turn the company twin's check on silently.
    with pytest.raises(ValueError, match="batch_invariant='no' must be True or False"):
        dataclasses.replace(SPEC, batch_invariant="no")
