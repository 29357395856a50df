"""Campaign statistics: what ran, which buckets and paths were hit, what failed."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pytest_graphmode.fuzz.failure import Failure


@dataclass
class CampaignStats:
    """Counters of one campaign (or of several, merged: xdist workers each run their own)."""

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
            "paths": dict(sorted(self.paths.items())),
            "fallback_reasons": dict(sorted(self.fallback_reasons.items())),
            "checks_run": dict(sorted(self.checks_run.items())),
            "failures": [
                {
                    "check": f.check,
                    "step": f.step,
                    "message": f.message,
                    "seed": f.seed,
                    "replay_snippet": f.replay_snippet,
                }
                for f in self.failures
            ],
            "seconds": round(self.seconds, 3),
        }
