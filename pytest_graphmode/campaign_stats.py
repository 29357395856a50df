"""Campaign statistics: what ran, which buckets and paths were hit, what failed.

One class counts a campaign, a test session (all its campaigns, `SessionSummary`) and the workers
of an xdist run; its JSON form is what workers send to the controller and what the report holds.
Imports no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_graphmode.failure import Failure

_COUNTERS = ("paths", "fallback_reasons", "checks_run")


@dataclass
class CampaignStats:
    """Counters of one campaign, or of several merged."""

    examples: int = 0
    steps: int = 0
    buckets_hit: Counter[int] = field(default_factory=Counter)  # 0: above every capture size
    paths: Counter[str] = field(default_factory=Counter)
    fallback_reasons: Counter[str] = field(default_factory=Counter)
    checks_run: Counter[str] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0

    def merge(self, other: CampaignStats) -> CampaignStats:
        """A new object holding both campaigns' counts (neither input changes)."""
        return CampaignStats(
            examples=self.examples + other.examples,
            steps=self.steps + other.steps,
            buckets_hit=self.buckets_hit + other.buckets_hit,
            paths=self.paths + other.paths,
            fallback_reasons=self.fallback_reasons + other.fallback_reasons,
            checks_run=self.checks_run + other.checks_run,
            failures=[*self.failures, *other.failures],
            seconds=self.seconds + other.seconds,
        )

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types only; bucket sizes become string keys, as JSON requires."""
        return {
            "examples": self.examples,
            "steps": self.steps,
            "buckets_hit": {str(k): v for k, v in sorted(self.buckets_hit.items())},
            **{name: dict(sorted(getattr(self, name).items())) for name in _COUNTERS},
            "failures": [failure.to_json() for failure in self.failures],
            "seconds": round(self.seconds, 3),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CampaignStats:
        """The inverse of `to_json`."""
        missing = [
            key
            for key in ("examples", "steps", "buckets_hit", *_COUNTERS, "failures", "seconds")
            if key not in data
        ]
        if missing:
            raise ValueError(f"campaign stats JSON lacks keys {missing}; got {sorted(data)}")
        return cls(
            examples=int(data["examples"]),
            steps=int(data["steps"]),
            buckets_hit=Counter({int(k): int(v) for k, v in data["buckets_hit"].items()}),
            **{
                name: Counter({str(k): int(v) for k, v in data[name].items()}) for name in _COUNTERS
            },
            failures=[Failure.from_json(failure) for failure in data["failures"]],
            seconds=float(data["seconds"]),
        )


@dataclass
class SessionSummary:
    """All campaigns of one test session (all xdist workers): their merged statistics and how
    many campaigns there were."""

    campaigns: int = 0
    stats: CampaignStats = field(default_factory=CampaignStats)

    def add_campaign(self, stats: CampaignStats) -> None:
        """Count one campaign, finished, failed or interrupted."""
        self.campaigns += 1
        self.stats = self.stats.merge(stats)

    def merge(self, other: SessionSummary) -> None:
        """Fold in another session's summary (an xdist worker's)."""
        self.campaigns += other.campaigns
        self.stats = self.stats.merge(other.stats)

    def to_json(self) -> dict[str, Any]:
        return {"campaigns": self.campaigns, **self.stats.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SessionSummary:
        if "campaigns" not in data:
            raise ValueError(f"session summary JSON lacks key 'campaigns'; got {sorted(data)}")
        return cls(int(data["campaigns"]), CampaignStats.from_json(data))
