"""What a person sees after a campaign: the terminal summary, the live progress line, the JSON file.

All of them show a `SessionSummary`: every campaign of the session, merged across xdist workers.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pytest_graphmode.campaign_stats import CampaignStats, SessionSummary

REPORT_VERSION = 1
PATHS = ("full", "piecewise", "eager")


def summary_lines(summary: SessionSummary) -> list[str]:
    """The terminal summary, one line per fact, most important first."""
    stats = summary.stats
    paths = "  ".join(f"{name} {stats.paths.get(name, 0)}" for name in PATHS)
    buckets = ", ".join(f"{size}: {count}" for size, count in sorted(stats.buckets_hit.items()))
    lines = [
        f"campaigns: {summary.campaigns}  examples: {stats.examples}  steps: {stats.steps}  "
        f"time: {stats.seconds:.1f} s",
        f"paths: {paths}",
        f"buckets hit: {buckets or 'none'}",
        f"fallback reasons: {_counts(stats.fallback_reasons) or 'none'}",
        f"checks run: {_counts(stats.checks_run) or 'none'}",
        f"failures: {len(stats.failures)}",
    ]
    for failure in stats.failures:
        first_line = failure.message.splitlines()[0] if failure.message else ""
        lines.append(
            f"  FAILED {failure.check} at step {failure.step} (seed {failure.seed}): {first_line}"
        )
    if stats.first_failure_check is not None:
        lines.append(_first_failure_line(stats))
    return lines


def _first_failure_line(stats: CampaignStats) -> str:
    if stats.shrink_stopped_by_budget:
        shrunk = f"stopped at its {stats.shrink_budget_seconds or 0.0:g} s budget"
    else:
        shrunk = "finished"
    return (
        f"first failure: {stats.first_failure_check} at example {stats.first_failure_example} "
        f"after {stats.first_failure_seconds or 0.0:.1f} s; shrinking {shrunk} after "
        f"{stats.shrink_seconds:.1f} s"
    )


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


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{name}: {count}" for name, count in counter.most_common())
