"""Idle blocks marked for one step, so that a write into them shows whatever it stores.

`kv_writes_confined` sees a stray write only when it changes bits. The commonest stray write does
not: a padding row left with an earlier step's slot mapping and inputs (stale staging, a slot
mapping not reset) computes that step's keys and values again and stores them where that step
stored them, in a slot that already holds exactly those bits. A request that is not in this step,
or one that has finished, owns such a slot. So before a step the harness overwrites every slot of
every block that no request of the step lists (the null block aside) with a mark, and restores the
slots afterwards: any write to them, of any value, is then a change.

A correct runner does not read those blocks for a valid row (their values reach no result), and
the mark is finite, so attention that multiplies masked values by zero stays finite. Only floating
slot-major tensors are marked: integer state may hold indices that a correct runner follows.

The slots the step must write (its valid slots: positions `context_len .. seq_len - 1` of each
request) get the mark too, and are not restored: the step overwrites them. A slot that still
holds the mark afterwards was never written, so that token's keys and values went elsewhere (the
null block, most often: a block-table column the runner never filled), which no comparison of
twins sees when every twin runs the same wrong table (`kv_writes_land`). A correct runner reads
such a slot only after writing it: causal attention sees positions up to its own, and the step
writes them before it attends.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pytest_graphmode.contract import Batch, TargetSpec, kv_slot, request_slots, slot_major
from pytest_graphmode.strategies.stressors import live_indices, writes_into_targets

MARK = 0.5
"""What every element of an idle slot holds during the step: finite and exact in every floating
dtype down to float8, and not zero, which a freshly allocated cache holds."""

# The bits of a floating tensor, as an integer tensor of the same element size: index_select,
# index_fill_ and index_copy_ exist for every integer dtype on every device, not for float8, and
# the bits restore exactly (NaN payloads too).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class MarkedBlocks:
    """The marked tensors and their saved slots; `restore()` puts the slots back."""

    saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (bits, slots, their rows)

    def restore(self) -> None:
        with writes_into_targets():
            for bits, slots, rows in self.saved:
                bits.index_copy_(0, slots, rows)
        self.saved = []


def idle_slots(spec: TargetSpec, batches: Sequence[Batch]) -> list[int]:
    """The slots of every block that no request of `batches` lists, the null block excepted."""
    listed = {*live_indices(spec, batches)[0], spec.null_block}
    size = spec.block_size
    return [
        block * size + offset
        for block in range(spec.num_blocks)
        if block not in listed
        for offset in range(size)
    ]


def _floating_slot_major(
    states: Sequence[Mapping[str, torch.Tensor]], spec: TargetSpec
) -> list[tuple[torch.Tensor, int]]:
    """The floating slot-major tensors of `states`, as integer views of their bits, each with the
    bits of `MARK` in its dtype."""
    return [
        (tensor.detach().view(_BITS[tensor.element_size()]), _mark_bits(tensor.dtype))
        for state in states
        for tensor in state.values()
        if tensor.is_floating_point() and slot_major(tensor, spec)
    ]


def mark_idle_blocks(
    states: Sequence[Mapping[str, torch.Tensor]], spec: TargetSpec, batches: Sequence[Batch]
) -> MarkedBlocks:
    """Fill the idle slots (`idle_slots`) of every floating slot-major tensor of `states` with
    `MARK`, saving what they held."""
    marked = MarkedBlocks([])
    slots = idle_slots(spec, batches)
    if not slots:
        return marked
    with writes_into_targets():
        for bits, index, mark in _marked_tensors(states, spec, slots):
            marked.saved.append((bits, index, bits.index_select(0, index)))
            bits.index_fill_(0, index, mark)
    return marked


def mark_slots_to_write(
    states: Sequence[Mapping[str, torch.Tensor]], spec: TargetSpec, batches: Sequence[Batch]
) -> list[int]:
    """Fill `slots_to_write(spec, batches)` in every floating slot-major tensor of `states` with
    `MARK`, saving nothing: the steps overwrite them (module docstring). Returns those slots."""
    slots = slots_to_write(spec, batches)
    if slots:
        with writes_into_targets():
            for bits, index, mark in _marked_tensors(states, spec, slots):
                bits.index_fill_(0, index, mark)
    return slots


def _marked_tensors(
    states: Sequence[Mapping[str, torch.Tensor]], spec: TargetSpec, slots: Sequence[int]
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(bits, index, mark) for each floating slot-major tensor of `states`: `_floating_slot_major`
    with `slots` as an index on the tensor's device, made once per device."""
    on_device: dict[torch.device, torch.Tensor] = {}
    found = []
    for bits, mark in _floating_slot_major(states, spec):
        index = on_device.get(bits.device)
        if index is None:
            index = on_device[bits.device] = torch.tensor(slots, device=bits.device)
        found.append((bits, index, mark))
    return found


def slots_to_write(spec: TargetSpec, batches: Sequence[Batch]) -> list[int]:
    """The slots marked before `batches` run back to back (a pipelined pair) and judged after the
    last: every slot the first writes, and those of each later batch that no earlier one reads. A
    request that finishes at the first step may hand its block to one that starts at the second,
    and the first step still reads that block's cached positions."""
    slots: set[int] = set()
    read: set[int] = set()
    for index, batch in enumerate(batches):
        slots.update(slot for slot in written_slots(batch, spec) if slot not in read)
        if index < len(batches) - 1:  # what the last batch reads concerns no later one
            read.update(
                kv_slot(request.block_ids, position, spec.block_size)
                for request in batch.requests
                for position in range(request.seq_len)
            )
    return sorted(slots)


def written_slots(batch: Batch, spec: TargetSpec) -> dict[int, tuple[int, int]]:
    """Slot -> (req_id, position) for every slot `batch` writes."""
    return {
        slot: (request.req_id, request.context_len + i)
        for request in batch.requests
        for i, slot in enumerate(request_slots(request, spec.block_size))
    }


def unwritten_slots(
    state: Mapping[str, torch.Tensor], spec: TargetSpec, slots: Sequence[int]
) -> list[int]:
    """Those of `slots` that hold the mark in every element of every floating slot-major tensor of
    `state` (a host snapshot taken after the step): no write reached them. Empty when `state` has
    no such tensor. One tensor still marked is not enough: state the runner writes less often
    than once a token (a scale per block, say) may keep the mark legitimately."""
    tensors = [t for t in state.values() if t.is_floating_point() and slot_major(t, spec)]
    if not tensors or not slots:
        return []
    index = torch.tensor(slots)
    still = torch.ones(len(slots), dtype=torch.bool)
    for tensor in tensors:
        still &= marked_rows(tensor, index.to(tensor.device)).cpu()
    return [slot for slot, marked in zip(slots, still.tolist(), strict=True) if marked]


def marked_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Which slots of `index` (on `tensor`'s device) hold the mark in every element of `tensor`,
    a floating slot-major tensor, as a bool tensor over `index`."""
    bits = tensor.detach().view(_BITS[tensor.element_size()])
    rows = bits.index_select(0, index).reshape(len(index), -1)
    return (rows == _mark_bits(tensor.dtype)).all(dim=1)


@functools.cache
def _mark_bits(dtype: torch.dtype) -> int:
    return int(torch.tensor(MARK).to(dtype).view(_BITS[dtype.itemsize]).item())
