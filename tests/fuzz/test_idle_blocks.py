"""The marks in idle blocks: every slot of a block no request of the step lists, in floating
slot-major state only, restored bit for bit afterwards."""

from __future__ import annotations

import dataclasses

import torch

from pytest_graphmode.contract import (
    AddressView,
    Batch,
    Request,
    StepResult,
    kv_slot,
    request_slots,
)
from pytest_graphmode.fuzz import replay
from pytest_graphmode.runtime.backends import get as get_backend
from pytest_graphmode.strategies.idle_blocks import (
    MARK,
    idle_slots,
    mark_idle_blocks,
    mark_slots_to_write,
    slots_to_write,
    unwritten_slots,
)
from tests.fuzz.toy import SPEC

SIZE = SPEC.block_size
FIRST = Batch((Request(0, (1, 2), 0, (3,)), Request(1, (4,), 5, (5, 7))))
SECOND = Batch((Request(2, (6,), 0, (9,)),))


def _blocks(slots: list[int]) -> set[int]:
    return {slot // SIZE for slot in slots}


def test_idle_slots_are_every_slot_of_every_unlisted_block_but_the_null_block():
    slots = idle_slots(SPEC, [FIRST])
    assert len(slots) == len(set(slots)) == len(_blocks(slots)) * SIZE
    assert _blocks(slots) == set(range(SPEC.num_blocks)) - {3, 5, 7, SPEC.null_block}
    assert _blocks(idle_slots(SPEC, [FIRST, SECOND])) == _blocks(slots) - {9}


def test_floating_slot_major_tensors_are_marked_in_idle_slots_only():
    kv = torch.randn(SPEC.num_slots, 2, 3)
    scales = torch.randn(SPEC.num_slots).to(torch.float8_e4m3fn)
    ids = torch.arange(SPEC.num_slots)
    weights = torch.randn(SPEC.num_slots + 1, 2)
    before = [t.clone() for t in (kv, scales, ids, weights)]
    marked = mark_idle_blocks(
        [{"kv": kv, "ids": ids}, {"scales": scales, "w": weights}], SPEC, [FIRST]
    )
    idle = torch.zeros(SPEC.num_slots, dtype=torch.bool)
    idle[idle_slots(SPEC, [FIRST])] = True
    assert bool((kv[idle] == MARK).all()) and torch.equal(kv[~idle], before[0][~idle])
    assert bool((scales[idle].float() == MARK).all())
    assert torch.equal(ids, before[2]) and torch.equal(weights, before[3])
    marked.restore()
    assert torch.equal(kv, before[0])
    assert torch.equal(scales.view(torch.uint8), before[1].view(torch.uint8))


def test_restoring_gives_back_the_exact_bits_nan_payloads_included():
    kv = torch.randn(SPEC.num_slots, 4)
    bits = kv.view(torch.int32)
    bits[:, 0] = 0x7FC0_1234  # a NaN with a payload
    before = bits.clone()
    mark_idle_blocks([{"kv": kv}], SPEC, [SECOND]).restore()
    assert torch.equal(kv.view(torch.int32), before)


def test_with_every_block_listed_nothing_is_marked():
    every = Batch(
        tuple(
            Request(i, (1,), 0, (block,))
            for i, block in enumerate(b for b in range(SPEC.num_blocks) if b != SPEC.null_block)
        )
    )
    kv = torch.randn(SPEC.num_slots, 2)
    assert mark_idle_blocks([{"kv": kv}], SPEC, [every]).saved == []


def test_the_slots_a_step_writes_are_marked_and_not_saved():
    # FIRST writes req 0's positions 0 and 1 (block 3, slots 12-13) and req 1's 5 (block 7)
    kv = torch.randn(SPEC.num_slots, 3)
    ids = torch.arange(SPEC.num_slots)
    before = kv.clone()
    marked = mark_slots_to_write([{"kv": kv, "ids": ids}], SPEC, [FIRST])
    written = [3 * SIZE, 3 * SIZE + 1, 7 * SIZE + 1]
    assert slots_to_write(SPEC, [FIRST]) == written == marked
    assert bool((kv[written] == MARK).all())
    others = torch.ones(SPEC.num_slots, dtype=torch.bool)
    others[written] = False
    assert torch.equal(kv[others], before[others]) and torch.equal(
        ids, torch.arange(SPEC.num_slots)
    )
    assert unwritten_slots({"kv": kv}, SPEC, written) == written
    kv[written[1], 2] = 1.0  # one element written is a write
    assert unwritten_slots({"kv": kv}, SPEC, written) == [written[0], written[2]]


def test_a_pair_leaves_unmarked_the_slots_its_second_step_writes_where_the_first_reads():
    # req 0 reads block 3 at the first step; it finishes, and req 2 starts in block 3 at the
    # second: marking that slot before the pair would overwrite what the first step attends to.
    handed_on = Batch((Request(2, (1,), 0, (3,)),))
    assert slots_to_write(SPEC, [FIRST, handed_on]) == slots_to_write(SPEC, [FIRST])
    assert slots_to_write(SPEC, [FIRST, SECOND]) == sorted(
        [*slots_to_write(SPEC, [FIRST]), 9 * SIZE]
    )


class _LastTokenState:
    """An eager runner whose state holds its keys at every token and a second tensor written only
    at each request's last token: state written less often than once a token (docs/contract.md)."""

    spec = dataclasses.replace(SPEC, capture_sizes=(1,), features=frozenset({"decode", "prefill"}))

    def __init__(self, mode: str, *, seed: int, backend: str) -> None:
        self.device = get_backend(backend).device
        self.kv = torch.zeros(SPEC.num_slots, 2, device=self.device)
        self.last = torch.zeros(SPEC.num_slots, 2, device=self.device)

    def step(self, batch: Batch) -> StepResult:
        size = SPEC.block_size
        every = [s for r in batch.requests for s in request_slots(r, size)]
        last = [kv_slot(r.block_ids, r.seq_len - 1, size) for r in batch.requests]
        self.kv[torch.tensor(every, device=self.device)] = 1.0
        self.last[torch.tensor(last, device=self.device)] = 2.0
        logits = torch.zeros(batch.num_reqs, SPEC.vocab_size, device=self.device)
        tokens = torch.zeros(batch.num_reqs, dtype=torch.int64, device=self.device)
        return StepResult(logits, tokens, "eager", None, reason="no graphs")

    def state(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv, "last": self.last}

    def static_buffers(self) -> dict[str, torch.Tensor]:
        return {}

    def address_views(self) -> list[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_state_written_once_a_request_keeps_the_mark_and_passes():
    # The slots a step writes are marked on the poisoned and eager twins, not the clean one:
    # `padding_inert` compared the mark kept in `last` with the clean twin's 0 and failed.
    prefill = Batch((Request(0, (3, 5), 0, (1,)),))
    decode = Batch((Request(0, (7,), 2, (1,)),))
    replay([prefill, decode], backend="sim", seed=0, factory=_LastTokenState)
