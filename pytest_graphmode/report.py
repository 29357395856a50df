"""What a person sees after a campaign: the terminal summary, the live progress line, the JSON file.

Everything here works on the JSON form of `CampaignStats` (`CampaignStats.to_json()`), because that is
what pytest-xdist workers can send to the controller; one session merges all of them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPORT_VERSION = 1
PATHS = ("full", "piecewise", "eager")
_COUNTERS = ("buckets_hit", "paths", "fallback_reasons", "checks_run")
_FAILURE_KEYS = ("check", "step", "message", "seed", "replay_snippet")


@dataclass
class SessionSummary:
    """All campaigns of one test session (all workers), merged."""

    campaigns: int = 0
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    buckets_hit: Counter[str] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)
    fallback_reasons: Counter[str] = field(default_factory=Counter)
    checks_run: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)

    def add_campaign(self, stats_json: Mapping[str, Any]) -> None:
        """Fold in one campaign's `CampaignStats.to_json()`."""
        missing = [
            k
            for k in ("examples", "steps", "seconds", "failures", *_COUNTERS)
            if k not in stats_json
        ]
        if missing:
            raise ValueError(f"campaign stats JSON lacks keys {missing}; got {sorted(stats_json)}")
        self.campaigns += 1
        self.examples += int(stats_json["examples"])
        self.steps += int(stats_json["steps"])
        self.seconds += float(stats_json["seconds"])
        for name in _COUNTERS:
            counter: Counter[str] = getattr(self, name)
            counter.update({str(k): int(v) for k, v in stats_json[name].items()})
        for failure in stats_json["failures"]:
            self.failures.append({key: failure[key] for key in _FAILURE_KEYS})

    def add_failure(self, failure: Mapping[str, Any]) -> None:
        """Fold in a failure that came without campaign statistics."""
        self.campaigns += 1
        self.failures.append({key: failure[key] for key in _FAILURE_KEYS})

    def merge(self, other: SessionSummary) -> None:
        """Fold in another session's summary (an xdist worker's)."""
        self.campaigns += other.campaigns
        self.examples += other.examples
        self.steps += other.steps
        self.seconds += other.seconds
        for name in _COUNTERS:
            getattr(self, name).update(getattr(other, name))
        self.failures.extend(other.failures)

    def to_json(self) -> dict[str, Any]:
        return {
            "campaigns": self.campaigns,
            "examples": self.examples,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            **{name: dict(sorted(getattr(self, name).items())) for name in _COUNTERS},
            "failures": list(self.failures),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SessionSummary:
        summary = cls(
            campaigns=int(data["campaigns"]),
            examples=int(data["examples"]),
            steps=int(data["steps"]),
            seconds=float(data["seconds"]),
            failures=list(data["failures"]),
        )
        for name in _COUNTERS:
            getattr(summary, name).update(data[name])
        return summary


def summary_lines(summary: SessionSummary) -> list[str]:
    """The terminal summary, one line per fact, most important first."""
    paths = "  ".join(f"{name} {summary.paths.get(name, 0)}" for name in PATHS)
    lines = [
        f"campaigns: {summary.campaigns}  examples: {summary.examples}  steps: {summary.steps}  "
        f"time: {summary.seconds:.1f} s",
        f"paths: {paths}",
        f"buckets hit: {_counts(summary.buckets_hit, key=_bucket_order) or 'none'}",
        f"fallback reasons: {_counts(summary.fallback_reasons) or 'none'}",
        f"checks run: {_counts(summary.checks_run) or 'none'}",
        f"failures: {len(summary.failures)}",
    ]
    for failure in summary.failures:
        first_line = str(failure["message"]).splitlines()[0] if failure["message"] else ""
        lines.append(
            f"  FAILED {failure['check']} at step {failure['step']} "
            f"(seed {failure['seed']}): {first_line}"
        )
    return lines


def write_report(path: Path, summary: SessionSummary, run: Mapping[str, Any]) -> None:
    """Write the JSON report: how the run was configured (`run`) and what it found."""
    document = {"version": REPORT_VERSION, "run": dict(run), **summary.to_json()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")


class ProgressLine:
    """A live `graphmode: ...` line, rewritten in place at most every `interval` seconds.

    `write(text)` is the sink (the terminal reporter's rewrite); the line starts on a line of its
    own, and the last update of a campaign is always written, followed by a newline from `finish`.
    """

    def __init__(
        self,
        write: Callable[[str], None],
        newline: Callable[[], None],
        label: str,
        interval: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._write = write
        self._newline = newline
        self._label = label
        self._interval = interval
        self._clock = clock
        self._last_shown = float("-inf")
        self._pending: str | None = None

    def update(self, examples: int, steps: int, failures: int) -> None:
        line = (
            f"graphmode {self._label}: {examples} examples, {steps} steps, "
            f"{failures} failures so far"
        )
        now = self._clock()
        if now - self._last_shown >= self._interval:
            if self._last_shown == float("-inf"):
                self._newline()  # start below the test's own progress dots, not over them
            self._write(line)
            self._last_shown = now
            self._pending = None
        else:
            self._pending = line

    def finish(self) -> None:
        if self._pending is not None:
            self._write(self._pending)
            self._pending = None
        if self._last_shown != float("-inf"):
            self._newline()


def _bucket_order(item: tuple[str, int]) -> tuple[int, str]:
    key = item[0]
    return (int(key), key) if key.lstrip("-").isdigit() else (1 << 62, key)


def _counts(counter: Counter[str], key: Callable[[tuple[str, int]], Any] | None = None) -> str:
    items: Iterable[tuple[str, int]] = (
        sorted(counter.items(), key=key) if key else counter.most_common()
    )
    return ", ".join(f"{name}: {count}" for name, count in items)
