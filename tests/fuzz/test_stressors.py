"""Stressors poison what a stale read would see and leave nothing unpoisoned."""

from __future__ import annotations

import random

import torch

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.strategies import stressors
from pytest_graphmode.strategies.plans import Stress
from tests.fuzz.toy import SPEC


def test_float_buffers_hold_only_non_finite_or_huge_values_after_poisoning():
    buffers = {"x": torch.zeros(64), "y": torch.zeros(4, 8, dtype=torch.bfloat16)}
    stressors.poison_static_buffers(buffers, live_blocks=[3], live_slots=[12], rng=random.Random(0))
    for tensor in buffers.values():
        values = tensor.float()
        assert bool(((~values.isfinite()) | (values.abs() > 1e37)).all())


def test_integer_buffers_receive_live_block_and_slot_ids():
    buffer = torch.zeros(512, dtype=torch.int32)
    stressors.poison_static_buffers(
        {"ids": buffer}, live_blocks=[3, 5], live_slots=[13, 21], rng=random.Random(1)
    )
    assert {3, 5, 13, 21, -1} <= set(buffer.tolist())


def test_poisoning_is_reproducible_from_the_seed():
    first, second = torch.zeros(32, dtype=torch.long), torch.zeros(32, dtype=torch.long)
    for buffer in (first, second):
        stressors.poison_static_buffers(
            {"b": buffer}, live_blocks=[1], live_slots=[4], rng=random.Random(7)
        )
    assert torch.equal(first, second)


def test_null_block_slots_become_nan_and_no_others():
    kv = torch.zeros(SPEC.num_slots, 2)
    stressors.poison_null_block({"kv": kv, "weights": torch.zeros(3)}, SPEC)
    start = SPEC.null_block * SPEC.block_size
    assert bool(kv[start : start + SPEC.block_size].isnan().all())
    assert int(kv.isnan().any(dim=1).sum()) == SPEC.block_size


def test_live_indices_cover_every_slot_of_every_block_in_the_batches():
    batch = Batch((Request(0, (1,), 0, (3,)), Request(1, (1,), 4, (5, 6))))
    blocks, slots = stressors.live_indices(SPEC, [batch])
    assert blocks == [3, 5, 6]
    assert len(slots) == 3 * SPEC.block_size and 12 in slots and 27 in slots


def test_churn_keeps_half_of_its_nan_filled_allocations_alive():
    held = stressors.churn(torch.device("cpu"), 4, random.Random(0))
    assert len(held) == 2
    assert all(bool(t.isnan().all()) for t in held)


class _RecordingBackend:
    name = "sim"

    def __init__(self):
        self.seeds = []

    def set_scheduler_seed(self, seed):
        self.seeds.append(seed)


def test_delay_reseeds_the_sim_stream_scheduler():
    backend = _RecordingBackend()
    stressors.delay(backend, Stress(scheduler_seed=9, delay_cycles=1000))
    assert backend.seeds == [9]
