"""What a failed check reports: `Failure`, its one JSON form, and the `GraphmodeFailure` raised.

Imports neither torch nor the engine: a test catches `GraphmodeFailure`, and a report reads
`Failure`s, where no campaign ran in the process (e.g. on the xdist controller).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_graphmode.campaign_stats import CampaignStats


MADE_TWINS = -1
"""`Failure.step` of a failure found when the twins were made, before the example's first step."""


@dataclass(frozen=True)
class Failure:
    """A failed check: which one, at which step of the shrunk schedule (counted from 0;
    `MADE_TWINS`: before step 0, when the twins were made), the message a person reads, the
    example's seed and the Python source that replays it."""

    check: str
    step: int
    message: str
    seed: int | None
    replay_snippet: str

    @property
    def where(self) -> str:
        """Where it failed, for a message: at step N, or before step 0 (in the twins'
        construction)."""
        if self.step == MADE_TWINS:
            return "before step 0 (when the twins were made)"
        return f"at step {self.step}"

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "step": self.step,
            "message": self.message,
            "seed": self.seed,
            "replay_snippet": self.replay_snippet,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Failure:
        missing = [key for key in cls.__dataclass_fields__ if key not in data]
        if missing:
            raise ValueError(f"failure JSON lacks keys {missing}; got {sorted(data)}")
        seed = data["seed"]
        return cls(
            check=str(data["check"]),
            step=int(data["step"]),
            message=str(data["message"]),
            seed=None if seed is None else int(seed),
            replay_snippet=str(data["replay_snippet"]),
        )


class GraphmodeFailure(AssertionError):
    """A check failed; `failure` says which and how to replay it, `stats` what ran until then."""

    def __init__(self, failure: Failure, stats: CampaignStats | None = None) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.stats = stats

    def __reduce__(self) -> tuple[type[GraphmodeFailure], tuple[Failure, CampaignStats | None]]:
        return (GraphmodeFailure, (self.failure, self.stats))  # crosses xdist worker boundaries
