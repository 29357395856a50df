"""The twins start identical: judged once they are made, before their first step.

The contract's first rule (docs/contract.md: same seed, same weights and state) is what every other
check relies on. A twin whose construction breaks it (a capture or warm-up at start-up that writes
the KV cache outside the null block, an upload on a side stream that nothing orders after the
buffer's allocation) would otherwise fail the first step's checks, which then blame a step that did
nothing wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

from pytest_graphmode.contract import Batch, TargetSpec
from pytest_graphmode.fuzz import kv_checks, race_check
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
    no race checker), then each named twin's `state()` against the eager twin's (`reference`)."""
    found = race_check.no_stream_races(races or ())
    if found:
        return found, ""
    for name, state in others:
        found = kv_checks.states_match(NO_REQUESTS, state, reference, spec)
        if found:
            return found, name
    return [], ""
