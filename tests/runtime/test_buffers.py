"""Persistent inputs: prefix + sentinel padding, one packed buffer, and rejection before any write."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from runtime_helpers import TINY, make_batch

from pytest_graphmode import Batch, Request
from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.buffers import InputLimits, StaticInputs
from pytest_graphmode.runtime.padding import PaddingPolicy
from pytest_graphmode.runtime.target import RuntimeTarget, make_target

LIMITS = InputLimits(
    max_num_reqs=8,
    max_num_tokens=32,
    max_blocks_per_req=TINY.max_blocks_per_req,
    num_blocks=TINY.num_blocks,
    block_size=TINY.block_size,
    vocab_size=TINY.vocab_size,
    num_adapters=TINY.num_adapters,
)
POLICY = PaddingPolicy(null_block=0, seq_len_fill=1)


@pytest.fixture(
    scope="module",
    params=[
        "sim",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ],
)
def backend(request: pytest.FixtureRequest) -> Any:
    return backends.get(request.param)


@pytest.fixture(scope="module")
def inputs(backend: Any) -> StaticInputs:
    return StaticInputs(LIMITS, POLICY, backend)


def test_stage_writes_the_prefix_and_fills_padding_with_sentinels(inputs: StaticInputs) -> None:
    batch = make_batch([2, 2], context=5, seeds=[9, None], adapters=[1, 0])
    inputs.stage(batch, 4, 8)
    v, s = inputs.views(4, 8), inputs.sampling_views(4)
    assert v.token_ids.tolist() == [5, 12, 36, 43, 0, 0, 0, 0]
    assert v.positions.tolist() == [5, 6, 5, 6, 0, 0, 0, 0]
    # request 0 owns blocks 1, 2; request 1 owns blocks 3, 4 (4 slots each)
    assert v.slot_mapping.tolist() == [9, 10, 17, 18, -1, -1, -1, -1]
    assert v.query_start.tolist() == [0, 2, 4, 4, 4]
    assert v.seq_lens.tolist() == [7, 7, 1, 1]
    assert v.block_tables.tolist() == [[1, 2] + [0] * 6, [3, 4] + [0] * 6, [0] * 8, [0] * 8]
    assert v.adapter_ids.tolist() == [1, 0, 0, 0]
    assert s.seeds.tolist() == [9, -1, -1, -1]
    assert s.temperatures.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert s.positions.tolist() == [7, 7, 1, 1]


def test_every_static_input_is_a_view_of_one_device_buffer(inputs: StaticInputs) -> None:
    storages = {t.untyped_storage().data_ptr() for t in inputs.tensors().values()}
    assert len(storages) == 1
    assert inputs.nbytes == sum(t.numel() * t.element_size() for t in inputs.tensors().values()) + (
        4 if LIMITS.max_num_reqs % 2 else 0
    )


def test_views_keep_their_addresses_across_stages(inputs: StaticInputs) -> None:
    before = {k: t.data_ptr() for k, t in inputs.views(4, 8).tensors().items()}
    inputs.stage(make_batch([1, 1, 1]), 4, 4)
    inputs.stage(make_batch([2]), 1, 2)
    after = {k: t.data_ptr() for k, t in inputs.views(4, 8).tensors().items()}
    assert before == after


@pytest.mark.parametrize("scheduler_seed", range(4))
def test_back_to_back_stages_leave_the_second_batch(
    inputs: StaticInputs, backend: Any, scheduler_seed: int
) -> None:
    backend.set_scheduler_seed(scheduler_seed)  # orders queued copies on sim; no-op on cuda
    inputs.stage(make_batch([1] * 4, context=3), 4, 4)
    inputs.stage(make_batch([1] * 2, context=9, first_block=20), 2, 2)
    assert inputs.views(2, 2).positions.tolist() == [9, 9]
    assert inputs.views(2, 2).block_tables[:, 0].tolist() == [20, 23]


def _with(batch: Batch, row: int, **changes: Any) -> Batch:
    requests = list(batch.requests)
    requests[row] = dataclasses.replace(requests[row], **changes)
    return Batch(tuple(requests))


GOOD = make_batch([1, 1, 1], context=6)

BAD_BATCHES = [
    pytest.param(_with(GOOD, 1, tokens=(256,)), "outside the vocabulary", id="token-id"),
    pytest.param(_with(GOOD, 1, tokens=(-1,)), "outside the vocabulary", id="negative-token"),
    pytest.param(_with(GOOD, 0, tokens=()), "no query tokens", id="no-tokens"),
    pytest.param(_with(GOOD, 2, block_ids=(0, 9)), "null block", id="null-block"),
    pytest.param(_with(GOOD, 2, block_ids=(64, 9)), "outside [0, 64)", id="block-range"),
    pytest.param(_with(GOOD, 0, block_ids=(1,)), "block table too short", id="short-table"),
    pytest.param(
        _with(GOOD, 0, block_ids=tuple(range(1, 10))), "max_blocks_per_req", id="long-table"
    ),
    pytest.param(_with(GOOD, 0, block_ids=(1, 1)), "twice", id="repeated-block"),
    pytest.param(
        _with(GOOD, 1, block_ids=(1, 2)),
        "also belongs to request 100 (row 0)",
        id="shared-written-slot",
    ),
    pytest.param(_with(GOOD, 1, req_id=100), "req_id also used", id="duplicate-req-id"),
    pytest.param(_with(GOOD, 1, temperature=0.0), "temperature", id="zero-temperature"),
    pytest.param(_with(GOOD, 1, temperature=float("nan")), "temperature", id="nan-temperature"),
    pytest.param(_with(GOOD, 1, seed=-5), "seed", id="negative-seed"),
    pytest.param(_with(GOOD, 1, adapter=3), "adapter=3", id="adapter-range"),
    pytest.param(_with(GOOD, 1, context_len=-1), "context_len", id="negative-context"),
    pytest.param(make_batch([1] * 33, context=0), "exceed max_num_reqs", id="too-many-requests"),
    pytest.param(make_batch([30] * 5, context=0), "exceed max_num_tokens", id="too-many-tokens"),
]


@pytest.fixture(scope="module")
def target() -> RuntimeTarget:
    made = make_target("graph", seed=1, backend="sim")
    made.step(make_batch([1, 1], context=3))  # a captured graph and non-trivial buffers
    return made


def _snapshot(target: RuntimeTarget) -> dict[str, torch.Tensor]:
    tensors = {**target.static_buffers(), **target.state()}
    return {name: t.clone() for name, t in tensors.items()}


def _assert_bit_identical(before: dict[str, torch.Tensor], target: RuntimeTarget) -> None:
    after = {**target.static_buffers(), **target.state()}
    for name, old in before.items():
        new = after[name]
        assert torch.equal(old.view(torch.uint8), new.view(torch.uint8)), f"{name} changed"


@pytest.mark.parametrize(("batch", "message"), BAD_BATCHES)
def test_a_bad_batch_is_rejected_with_a_reason_and_changes_nothing(
    target: RuntimeTarget, batch: Batch, message: str
) -> None:
    before = _snapshot(target)
    with pytest.raises(ValueError, match="rejected batch, nothing was staged") as raised:
        target.step(batch)
    assert message in str(raised.value)
    _assert_bit_identical(before, target)


_CORRUPTIONS = {
    "token": lambda r, v: {"tokens": (v % 7 + TINY.vocab_size,)},
    "null_block": lambda r, v: {"block_ids": (0, *r.block_ids[1:])},
    "block_range": lambda r, v: {"block_ids": (TINY.num_blocks + v % 5, *r.block_ids[1:])},
    "short_table": lambda r, v: {"context_len": r.context_len + TINY.block_size * 2},
    "temperature": lambda r, v: {"temperature": -float(v % 3)},
    "seed": lambda r, v: {"seed": -1 - v % 9},
    "adapter": lambda r, v: {"adapter": TINY.num_adapters + 1 + v % 3},
}


@given(
    query_len=st.sampled_from([1, 2, 4]),
    num_reqs=st.integers(1, 6),
    context=st.integers(0, 20),
    corruption=st.sampled_from(sorted(_CORRUPTIONS)),
    row=st.integers(0, 5),
    value=st.integers(0, 1000),
)
def test_any_rejected_batch_leaves_buffers_and_kv_cache_bit_identical(
    target: RuntimeTarget,
    query_len: int,
    num_reqs: int,
    context: int,
    corruption: str,
    row: int,
    value: int,
) -> None:
    batch = make_batch([query_len] * num_reqs, context=context)
    row %= num_reqs
    bad = _with(batch, row, **_CORRUPTIONS[corruption](batch.requests[row], value))
    before = _snapshot(target)
    with pytest.raises(ValueError, match=f"row {row}"):
        target.step(bad)
    _assert_bit_identical(before, target)


def test_padding_policy_rejects_a_non_finite_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        PaddingPolicy(null_block=0, seq_len_fill=1, temperature=float("inf"))


def test_limits_reject_empty_shapes() -> None:
    with pytest.raises(ValueError, match="max_num_reqs=0"):
        dataclasses.replace(LIMITS, max_num_reqs=0)


def test_request_fields_must_be_ints(inputs: StaticInputs) -> None:
    bad = Batch((Request(req_id=1, tokens=(1.5,), context_len=0, block_ids=(1,)),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"token ids \[1.5\] are not integers"):
        inputs.stage(bad, 1, 1)


def test_two_requests_may_not_share_a_block_even_at_different_slots(
    target: RuntimeTarget,
) -> None:
    # Request 1 writes slot 2 of block 5, request 0 slots 0 and 1: no slot is written twice,
    # but a block belongs to one request, as the harness's block allocator hands them out.
    shared = Batch(
        (
            Request(req_id=0, tokens=(1, 2), context_len=0, block_ids=(5,)),
            Request(req_id=1, tokens=(3,), context_len=2, block_ids=(5,)),
        )
    )
    before = _snapshot(target)
    with pytest.raises(ValueError, match=r"request 1 \(row 1\): block 5 also belongs to request 0"):
        target.step(shared)
    _assert_bit_identical(before, target)
