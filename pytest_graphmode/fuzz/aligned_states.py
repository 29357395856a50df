"""Each step judged from the same state: after a step whose checks passed, the graph-mode twins
take the eager twin's floating state.

A correct runner's graph path may round otherwise than its eager path (other kernels, a fused
projection, a quantizer that rounds once instead of twice), and each step then leaves the twins'
KV caches and recurrent states a little apart, within `states_match`'s tolerance. Kept apart,
those differences add up: every later step attends over a whole context of keys that differ a
little, a recurrent state compounds them, and a bfloat16 router whose two experts nearly tie
picks another one on one twin. A correct runner then fails `replay_matches_eager` steps after
anything differed by more than rounding, and a bug that does no more than rounding would go
unseen anyway: `states_match` has just judged the state the step wrote.

So once a step (or a pipelined pair) passed, the graph twin and the clean twin (also graph mode,
and compared with the graph twin bit for bit) are given the eager twin's floating state, and the
next step starts all three from the same values. Integer state matched exactly already. The null
block is left as each twin has it: the harness poisons it on the graph and eager twins before
every step, and the clean twin's stays unpoisoned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

from pytest_graphmode.contract import GraphTarget, TargetSpec, slot_major
from pytest_graphmode.strategies.stressors import writes_into_targets


def align_states(reference: GraphTarget, twins: Iterable[GraphTarget], spec: TargetSpec) -> None:
    """Copy `reference`'s floating `state()` into each of `twins`, in place, the null block's
    slots excepted; a key of another shape or dtype (which `states_match` has refused) is left."""
    source = reference.state()
    null = slice(spec.null_block * spec.block_size, (spec.null_block + 1) * spec.block_size)
    with writes_into_targets():
        _copy_into(source, twins, spec, null)


def _copy_into(
    source: Mapping[str, Tensor], twins: Iterable[GraphTarget], spec: TargetSpec, null: slice
) -> None:
    for twin in twins:
        for key, tensor in twin.state().items():
            values = source.get(key)
            if values is None or not tensor.is_floating_point():
                continue
            if values.shape != tensor.shape or values.dtype != tensor.dtype:
                continue
            if slot_major(tensor, spec):
                tensor[: null.start].copy_(values[: null.start])
                tensor[null.stop :].copy_(values[null.stop :])
            else:
                tensor.copy_(values)
