"""The twins start identical: judged once they are made, before their first step.

The contract's first rule (docs/contract.md: same seed, same weights and state) is what every other
check relies on. A twin whose construction breaks it (a capture or warm-up at start-up that writes
the KV cache outside the null block, an upload on a side stream that nothing orders after the
buffer's allocation) would otherwise fail the first step's checks, which then blame a step that did
nothing wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from pytest_graphmode.contract import Batch, GraphTarget, TargetSpec
from pytest_graphmode.fuzz import kv_checks, race_check
from pytest_graphmode.fuzz.checks import REPLAY_MATCHES_EAGER, both_raised, sim_refusal
from pytest_graphmode.fuzz.kv_checks import State
from pytest_graphmode.fuzz.violation import Violation
from pytest_graphmode.runtime.backends.race import Race

NO_REQUESTS = Batch(requests=())


def made_twins_violations(
    races: Sequence[Race] | None,
    reference: State,
    others: Sequence[tuple[str, State]],
    spec: TargetSpec,
) -> tuple[list[Violation], str]:
    """The first violation of the twins as made, and which twin shows it ("" for a race, which
    all twins ran the same code into): stream races while they were made (None: the backend has
    no race checker; on cuda nothing is delayed while they are made), then each named twin's `state()` against the eager twin's (`reference`)."""
    found = race_check.no_stream_races(races or ())
    if found:
        return found, ""
    for name, state in others:
        found = kv_checks.states_match(NO_REQUESTS, state, reference, spec)
        if found:
            return found, name
    return [], ""


def state_not_live(target: GraphTarget) -> str | None:
    """Why `target.state()` is not the runner's own state, or None when it is. The harness marks,
    poisons and restores state in place through the tensors `state()` returns, so each must be
    the runner's memory (the cache, or a view of it), the same at every call: a copy the call
    makes takes the marks and the poison instead of the cache, and `kv_writes_land` and
    `kv_writes_confined` then judge what the copy held, not what the step wrote."""
    first = target.state()
    second = target.state()  # while `first` lives: a copy cannot be handed the same memory
    for key, tensor in first.items():
        again = second.get(key)
        if again is None or tensor.numel() == 0:
            continue  # a key missing at the second call is `Reset`'s to report
        if _where(tensor) != _where(again):
            return (
                f"state()[{key!r}] is another tensor at every call (a copy, not the runner's "
                "memory): the harness marks, poisons and restores state in place through the "
                "tensors state() returns, so each must be the runner's own (the cache, or a "
                "view of it). A cache that no view makes slot-major can keep a slot-major image "
                "that the step copies into the cache before it runs and back after "
                '(docs/contract.md, "State is slot-major")'
            )
    return None


def _where(tensor: Tensor) -> tuple[int, int, tuple[int, ...]]:
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.stride())


def construction_raised(graph_error: str | None, eager_error: str | None) -> Violation:
    """The violation of twins whose factory raised (at least one did: `graph_error`, the
    traceback of the graph twin's construction, or `eager_error`): `replay_matches_eager`, as for a
    step that raised, since graph mode then fails where eager mode works (most often a capture at
    start-up that CUDA refuses), or the runner fails in both modes."""
    if graph_error and eager_error:
        detail = both_raised(graph_error, eager_error, "while they were made")
    elif graph_error:
        detail = (
            "graph_raised: the graph twin's construction raised, the eager twin's did not (a "
            f"capture or warm-up at start-up, for example):\n{graph_error}"
        )
    else:
        detail = f"eager_raised: the eager twin's construction raised, the graph twin's did not:\n{eager_error}"
    return Violation(REPLAY_MATCHES_EAGER, sim_refusal(graph_error, eager_error) + detail)
