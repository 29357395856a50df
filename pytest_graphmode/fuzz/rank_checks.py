"""Cross-rank checks: what every rank's step must agree on, judged from all ranks' reports.

`ranks_agree`: at every step every rank replays the same graph key on the same path (an idle rank
runs the agreed graph on a dummy batch), and an idle rank's dummy batch returns empty results.
`ranks_arrive`: every rank arrives at every collective within the timeout (judged by the parent
process's watchdog; see `fuzz.ranks`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pytest_graphmode.fuzz.violation import Violation

RANKS_AGREE = "ranks_agree"
RANKS_ARRIVE = "ranks_arrive"


@dataclass(frozen=True)
class RankReport:
    """One rank's step as the other ranks see it: its graph twin's path and key (None where the
    step raised: that rank's own checks report it), its reason, and its first violation."""

    rank: int
    path: str | None
    key: Hashable | None
    reason: str | None
    idle: bool
    violation: Violation | None = None

    def describe(self) -> str:
        role = "idle, dummy batch" if self.idle else "working"
        if self.path is None:
            return f"rank {self.rank} ({role}): raised"
        where = f"replayed {self.key}" if self.key is not None else "ran eagerly"
        return f"rank {self.rank} ({role}): {self.path}, {where} ({self.reason})"


def ranks_agree(reports: Sequence[RankReport]) -> list[Violation]:
    """Every rank that returned a result took the same path with the same graph key."""
    ran = [r for r in reports if r.path is not None]
    if len({(r.path, r.key) for r in ran}) <= 1:
        return []
    first = ran[0]
    odd = next(r for r in ran if (r.path, r.key) != (first.path, first.key))
    lines = "\n".join(f"  {r.describe()}" for r in reports)
    return [
        Violation(
            RANKS_AGREE,
            "data-parallel ranks ran different graphs at the same step (a collective between "
            f"them would hang or mix graph and eager work):\n{lines}",
            expected=f"rank {odd.rank}: {first.path} {first.key} like rank {first.rank}",
            actual=f"{odd.path} {odd.key}",
        )
    ]


def first_violation(reports: Sequence[RankReport]) -> tuple[int | None, Violation] | None:
    """The violation to report for a step and the rank it belongs to (None: all of them):
    disagreement first, since any rank's wrong result may follow from it, then by rank."""
    agreement = ranks_agree(reports)
    if agreement:
        return None, agreement[0]
    for report in reports:
        if report.violation is not None:
            return report.rank, report.violation
    return None
