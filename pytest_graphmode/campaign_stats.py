"""Campaign statistics: what ran, which buckets and paths were hit, what failed.

One class counts a campaign, a test session (all its campaigns, `SessionSummary`) and the workers
of an xdist run; its JSON form is what workers send to the controller and what the report holds.
Imports no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pytest_graphmode.failure import Failure

_COUNTERS = ("paths", "fallback_reasons", "checks_run")
T = TypeVar("T")


@dataclass
class CampaignStats:
    """Counters of one campaign, or of several merged."""

    examples: int = 0
    steps: int = 0
    # Of `examples`, those run while shrinking a failure (after the first failing example).
    shrink_examples: int = 0
    pipelined_steps: int = 0  # steps the graph twin ran in pipelined pairs (two per pair)
    buckets_hit: Counter[int] = field(default_factory=Counter)  # 0: above every capture size
    paths: Counter[str] = field(default_factory=Counter)
    fallback_reasons: Counter[str] = field(default_factory=Counter)
    checks_run: Counter[str] = field(default_factory=Counter)
    # Steps per graph key the graph twin replayed (its `StepResult.graph_key`, as text): which
    # graphs ran how often, by request count where a runner keys its graphs so.
    graph_keys: Counter[str] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0
    # The first failing example, as found (before shrinking): when, which, and which check.
    first_failure_seconds: float | None = None  # from the campaign's start
    first_failure_example: int | None = None  # 1-based
    first_failure_check: str | None = None
    # The campaign it was found in, as the plugin labels it ("campaign", "pinned seed 0"; None:
    # unlabelled): a session's first failure may be any of its campaigns'.
    first_failure_campaign: str | None = None
    # The leading example (a fixed schedule, never shrunk) it was found in; None: a drawn one.
    first_failure_leading: str | None = None
    shrinking: bool = False  # the failure is being shrunk now
    shrink_seconds: float = 0.0
    shrink_budget_seconds: float | None = None  # None: unbounded
    shrink_stopped_by_budget: bool = False
    planned_examples: int = 0  # the example budget, for "N of M" (0: a time budget instead)
    time_budget_seconds: float | None = None  # no new example after this long (None: no limit)
    stopped_by_time_budget: bool = False
    # The first line of a `HarnessError` that ended the campaign: the harness's own code raised,
    # which is no finding about the runner and not among `failures`.
    harness_error: str | None = None

    def merge(self, other: CampaignStats) -> CampaignStats:
        """A new object holding both campaigns' counts (neither input changes)."""
        return CampaignStats(
            examples=self.examples + other.examples,
            steps=self.steps + other.steps,
            shrink_examples=self.shrink_examples + other.shrink_examples,
            pipelined_steps=self.pipelined_steps + other.pipelined_steps,
            buckets_hit=self.buckets_hit + other.buckets_hit,
            paths=self.paths + other.paths,
            fallback_reasons=self.fallback_reasons + other.fallback_reasons,
            checks_run=self.checks_run + other.checks_run,
            graph_keys=self.graph_keys + other.graph_keys,
            failures=[*self.failures, *other.failures],
            seconds=self.seconds + other.seconds,
            # The session's first failure is the first campaign's that has one.
            **(_first_failure(self) if self.first_failure_check else _first_failure(other)),
            shrinking=self.shrinking or other.shrinking,
            shrink_seconds=self.shrink_seconds + other.shrink_seconds,
            shrink_budget_seconds=_first_set(
                self.shrink_budget_seconds, other.shrink_budget_seconds
            ),
            shrink_stopped_by_budget=self.shrink_stopped_by_budget
            or other.shrink_stopped_by_budget,
            planned_examples=self.planned_examples + other.planned_examples,
            time_budget_seconds=_first_set(self.time_budget_seconds, other.time_budget_seconds),
            stopped_by_time_budget=self.stopped_by_time_budget or other.stopped_by_time_budget,
            harness_error=self.harness_error or other.harness_error,
        )

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types only; bucket sizes become string keys, as JSON requires."""
        return {
            "examples": self.examples,
            "steps": self.steps,
            "shrink_examples": self.shrink_examples,
            "pipelined_steps": self.pipelined_steps,
            "buckets_hit": {str(k): v for k, v in sorted(self.buckets_hit.items())},
            **{name: dict(sorted(getattr(self, name).items())) for name in _COUNTERS},
            "graph_keys": dict(sorted(self.graph_keys.items())),
            "failures": [failure.to_json() for failure in self.failures],
            "seconds": round(self.seconds, 3),
            **_first_failure(self),
            "shrinking": self.shrinking,
            "shrink_seconds": round(self.shrink_seconds, 3),
            "shrink_budget_seconds": self.shrink_budget_seconds,
            "shrink_stopped_by_budget": self.shrink_stopped_by_budget,
            "planned_examples": self.planned_examples,
            "time_budget_seconds": self.time_budget_seconds,
            "stopped_by_time_budget": self.stopped_by_time_budget,
            "harness_error": self.harness_error,
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
            shrink_examples=int(data.get("shrink_examples", 0)),  # absent in older reports
            pipelined_steps=int(data.get("pipelined_steps", 0)),  # absent in older reports
            buckets_hit=Counter({int(k): int(v) for k, v in data["buckets_hit"].items()}),
            **{
                name: Counter({str(k): int(v) for k, v in data[name].items()}) for name in _COUNTERS
            },
            graph_keys=Counter(
                {str(k): int(v) for k, v in data.get("graph_keys", {}).items()}  # absent in older
            ),
            failures=[Failure.from_json(failure) for failure in data["failures"]],
            seconds=float(data["seconds"]),
            # Absent in reports written before these fields existed.
            first_failure_seconds=_optional(data.get("first_failure_seconds"), float),
            first_failure_example=_optional(data.get("first_failure_example"), int),
            first_failure_check=_optional(data.get("first_failure_check"), str),
            first_failure_campaign=_optional(data.get("first_failure_campaign"), str),
            first_failure_leading=_optional(data.get("first_failure_leading"), str),
            shrinking=bool(data.get("shrinking", False)),
            shrink_seconds=float(data.get("shrink_seconds", 0.0)),
            shrink_budget_seconds=_optional(data.get("shrink_budget_seconds"), float),
            shrink_stopped_by_budget=bool(data.get("shrink_stopped_by_budget", False)),
            planned_examples=int(data.get("planned_examples", 0)),
            time_budget_seconds=_optional(data.get("time_budget_seconds"), float),
            stopped_by_time_budget=bool(data.get("stopped_by_time_budget", False)),
            harness_error=_optional(data.get("harness_error"), str),
        )

    def update_from(self, other: CampaignStats) -> None:
        """Take every count of `other` (a copy of this campaign's counts from elsewhere, e.g. a
        child process), so that whoever holds this object sees them."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(other, name))


def _first_failure(stats: CampaignStats) -> dict[str, Any]:
    return {
        "first_failure_seconds": stats.first_failure_seconds,
        "first_failure_example": stats.first_failure_example,
        "first_failure_check": stats.first_failure_check,
        "first_failure_campaign": stats.first_failure_campaign,
        "first_failure_leading": stats.first_failure_leading,
    }


def _first_set(left: float | None, right: float | None) -> float | None:
    return left if left is not None else right


def _optional(value: Any, kind: Callable[[Any], T]) -> T | None:
    return None if value is None else kind(value)


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
