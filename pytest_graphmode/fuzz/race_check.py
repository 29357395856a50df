"""The stream-race oracle: a step left two conflicting accesses that nothing orders.

The sim backend's happens-before checker (docs/backends.md, "The race checker") judges every
access when it is issued, so a missing event wait, `wait_stream` or synchronization is reported at
its first occurrence, whatever order the scheduler ran the streams in, and before it corrupts a
value. A stream-ordered free (memory freed while another stream's queued work still uses it,
without `record_stream`) is such a race too: its later access is the allocation that may be handed
the block. A race is a root cause: the registry runs this check first. On cuda there is no such
checker; the delayed steps report the host's accesses to pinned memory whose non-blocking copy was
still in flight (runtime/backends/cuda_races.py), whatever values the copy moved.
"""

from __future__ import annotations

from collections.abc import Sequence

from pytest_graphmode.fuzz.violation import Violation
from pytest_graphmode.runtime.backends.race import Race

NO_STREAM_RACES = "no_stream_races"


def no_stream_races(races: Sequence[Race]) -> list[Violation]:
    """No two accesses to the same bytes, one of them a write, are left unordered by stream
    order, events, wait_stream and synchronization. Each race is one violation naming the
    tensor, its bytes and both accesses (operation, stream, line)."""
    return [
        Violation(
            NO_STREAM_RACES,
            race.describe(),
            expected=f"{race.earlier.op} ({race.earlier.line}) ordered before "
            f"{race.later.op} ({race.later.line})",
            actual=(
                f"the memory freed with {race.earlier.stream}'s use pending"
                if race.cause
                else f"{race.earlier.stream} and {race.later.stream} not synchronized between them"
            ),
        )
        for race in races
    ]
