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
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pytest_graphmode.contract import Batch, TargetSpec, slot_major
from pytest_graphmode.strategies.stressors import live_indices

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


def mark_idle_blocks(
    states: Sequence[Mapping[str, torch.Tensor]], spec: TargetSpec, batches: Sequence[Batch]
) -> MarkedBlocks:
    """Fill the idle slots (`idle_slots`) of every floating slot-major tensor of `states` with
    `MARK`, saving what they held."""
    marked = MarkedBlocks([])
    slots = idle_slots(spec, batches)
    if not slots:
        return marked
    on_device: dict[torch.device, torch.Tensor] = {}
    for state in states:
        for tensor in state.values():
            if not (tensor.is_floating_point() and slot_major(tensor, spec)):
                continue
            bits = tensor.detach().view(_BITS[tensor.element_size()])
            index = on_device.get(tensor.device)
            if index is None:
                index = on_device[tensor.device] = torch.tensor(slots, device=tensor.device)
            marked.saved.append((bits, index, bits.index_select(0, index)))
            bits.index_fill_(0, index, _mark_bits(tensor.dtype))
    return marked


@functools.cache
def _mark_bits(dtype: torch.dtype) -> int:
    return int(torch.tensor(MARK).to(dtype).view(_BITS[dtype.itemsize]).item())
