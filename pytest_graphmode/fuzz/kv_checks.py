"""Per-step oracles on slot-major state (KV caches): who may write which slot, and whether the
twins' states agree. Pure functions over a step's batch and state snapshots, like `checks`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pytest_graphmode.contract import Batch, TargetSpec, request_slots, slot_major
from pytest_graphmode.fuzz.tolerance import (
    coarser_precision,
    same_bits,
    state_precision,
    within,
    within_slots,
)
from pytest_graphmode.fuzz.violation import Violation, differences
from pytest_graphmode.strategies.idle_blocks import (
    slots_to_write,
    unwritten_slots,
    written_slots,
)

State = Mapping[str, torch.Tensor]

KV_WRITES_CONFINED = "kv_writes_confined"
KV_WRITES_LAND = "kv_writes_land"
STATES_MATCH = "states_match"


def valid_slots(batch: Batch, spec: TargetSpec) -> dict[int, int]:
    """Slot -> req_id for every position a step writes (context_len..seq_len-1 per request)."""
    return {
        slot: request.req_id
        for request in batch.requests
        for slot in request_slots(request, spec.block_size)
    }


def row_mask(equal: torch.Tensor) -> torch.Tensor:
    return equal.reshape(equal.shape[0], -1).all(dim=1)


def _owner_text(block: int, batches: Sequence[Batch], spec: TargetSpec) -> str:
    """Whose `block` is, in `batches`: one step's batch, or a pipelined pair's (first step first,
    `_in_pair` says which step a request was in)."""
    if block == spec.null_block:
        return "the null block"
    if not any(batch.requests for batch in batches):
        return f"block {block}, before any request was sent"
    for index in reversed(range(len(batches))):  # the latest owner first
        for request in batches[index].requests:
            if block in request.block_ids:
                return f"block {block}, owned by req {request.req_id}{_in_pair(index, batches)}"
    return f"block {block}, owned by no request of this step (free, or a waiting request's)"


def _in_pair(index: int, batches: Sequence[Batch]) -> str:
    """' in the pair's first (second) step' for a pipelined pair's `batches[index]`: the report
    names the pair's first step, and a request of the second is easily read as one of it."""
    if len(batches) < 2:
        return ""
    return f" in the pair's {'first' if index == 0 else 'second'} step"


def kv_writes_confined(
    batch: Batch,
    before: State,
    after: State,
    spec: TargetSpec,
    twin: str = "graph",
    also: Sequence[Batch] = (),
) -> list[Violation]:
    """Only the step's valid slots and the null block's slots may change in slot-major state.

    `also`: the steps that also ran between `before` and `after` (the other step of a pipelined
    pair): their valid slots may change too. Each step of the pair writes only its own slots, so
    their union is the most the pair may write, whatever order the steps' writes landed in."""
    allowed = torch.zeros(spec.num_slots, dtype=torch.bool)
    for written in (batch, *also):
        allowed[list(valid_slots(written, spec))] = True
    null = spec.null_block * spec.block_size
    allowed[null : null + spec.block_size] = True
    for key, new in after.items():
        old = before.get(key)
        if old is None or not slot_major(new, spec) or old.shape != new.shape:
            continue
        changed = ~row_mask(same_bits(old, new.detach().cpu()))
        stray = changed & ~allowed
        if bool(stray.any()):
            slot = int(stray.nonzero()[0])
            where = _owner_text(slot // spec.block_size, (batch, *also), spec)
            steps = "these two steps do" if also else "this step does"
            return [
                Violation(
                    KV_WRITES_CONFINED,
                    f"{twin} twin changed {key!r} at slot {slot} ({where}), which {steps} "
                    f"not write (expected: what the slot held before the step)",
                    slot=slot,
                    **differences(old[slot], new[slot]),
                )
            ]
    return []


def kv_writes_land(
    batch: Batch, afters: Mapping[str, State], spec: TargetSpec, also: Sequence[Batch] = ()
) -> list[Violation]:
    """Every token of the step stores its keys and values in its own slot (`kv_slot` of its
    position through its request's `block_ids`).

    The harness marks those slots before the step (`strategies/idle_blocks.py`); one that still
    holds the mark in all of the twin's floating slot-major state afterwards was never written: the
    token's K/V went to another slot, most often the null block through a block-table entry the
    runner never filled, where `kv_writes_confined` allows it. Every twin running the same wrong
    table reads them back from there alike, so no comparison of twins sees it until a later step
    reads the request's cache through the right table. `also`: the later step of a pipelined
    pair, whose slots were marked too where the first step reads none of them
    (`slots_to_write`). `afters`: each twin judged (by name) and its state after the step."""
    batches = (batch, *also)
    slots = slots_to_write(spec, batches)
    return [
        violation
        for twin, after in afters.items()
        for violation in unlanded(batches, unwritten_slots(after, spec, slots), spec, twin)
    ]


def unlanded(
    batches: Sequence[Batch], missing: Sequence[int], spec: TargetSpec, twin: str
) -> list[Violation]:
    """The `kv_writes_land` violation for `missing`, slots of `batches` that `twin` left
    unwritten (none when it is empty)."""
    if not missing:
        return []
    owners: dict[int, tuple[int, int, int]] = {}
    for index, written in enumerate(batches):
        for written_slot, (owner, at) in written_slots(written, spec).items():
            owners[written_slot] = (owner, at, index)
    slot = missing[0]
    req_id, position, index = owners[slot]
    steps = "these two steps" if len(batches) > 1 else "the step"
    return [
        Violation(
            KV_WRITES_LAND,
            f"{twin} twin never wrote slot {slot} (block {slot // spec.block_size}), where req "
            f"{req_id}'s position {position}{_in_pair(index, batches)} belongs: {steps} stored "
            f"that token's keys and values elsewhere ({len(missing)} such slot(s) in all)",
            req_id=req_id,
            slot=slot,
            expected=f"req {req_id}'s keys and values for position {position}",
            actual="the mark the harness left there before the step, in every element",
        )
    ]


def states_match(
    batch: Batch,
    graph_after: State,
    eager_after: State,
    spec: TargetSpec,
    computed: torch.dtype | None = None,
) -> list[Violation]:
    """The twins' states agree after the step (exact for integers but a quantized cache's 8-bit
    codes; floating slot-major state slot by slot at its dtype's tolerance times the slot's
    scale, or where the runner computes in a coarser precision (`computed`: its logits', else
    its state's) at that precision's tolerance (`tolerance.within_slots`); other floating state
    element by element). The null block is padding's sink and is not compared."""
    name = STATES_MATCH
    if set(graph_after) != set(eager_after):
        return [
            Violation(
                name,
                "the twins' state() keys differ",
                expected=str(sorted(eager_after)),
                actual=str(sorted(graph_after)),
            )
        ]
    null = spec.null_block * spec.block_size
    floor = coarser_precision(state_precision(eager_after, spec), computed)
    for key, expected in eager_after.items():
        actual = graph_after[key].detach().cpu()
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            return [
                Violation(
                    name,
                    f"state {key!r} has another shape or dtype",
                    expected=f"{tuple(expected.shape)} {expected.dtype}",
                    actual=f"{tuple(actual.shape)} {actual.dtype}",
                )
            ]
        if slot_major(expected, spec):
            rows = row_mask(within_slots(actual, expected, floor))
            rows[null : null + spec.block_size] = True
            if not bool(rows.all()):
                slot = int((~rows).nonzero()[0])
                where = _owner_text(slot // spec.block_size, (batch,), spec)
                one = slice(slot, slot + 1)
                close = within_slots(actual[one], expected[one], floor)[0]
                return [
                    Violation(
                        name,
                        f"state {key!r} differs at slot {slot} ({where})",
                        slot=slot,
                        **differences(expected[slot], actual[slot], close),
                    )
                ]
            continue
        equal = within(actual, expected)
        if not bool(equal.all()):
            index = tuple(int(i) for i in (~equal).nonzero()[0])
            return [
                Violation(
                    name,
                    f"state {key!r} differs at index {index} (compared whole: its "
                    f"{expected.shape[0] if expected.dim() else 0} rows are not the spec's "
                    f"{spec.num_slots} slots, so it is not slot-major and no null block is left "
                    "out)",
                    expected=str(expected[index]),
                    actual=str(actual[index]),
                )
            ]
    return []
