"""What a person sees after a campaign: the terminal summary, the live progress line, the JSON file.

All of them show a `SessionSummary`: every campaign of the session, merged across xdist workers.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_graphmode.campaign_stats import CampaignStats, SessionSummary

if TYPE_CHECKING:
    import pytest

REPORT_VERSION = 1
PATHS = ("full", "piecewise", "eager")
TOP_CAUSES = 4
"""Fallback causes shown in the summary line; the JSON report keeps every reason."""


def summary_lines(
    summary: SessionSummary, *, checks: Sequence[str] = (), base_seed: int | None = None
) -> list[str]:
    """The terminal summary, one line per fact, most important first.

    `checks` (every check's name, in the registry's order) lets it name the checks that had
    nothing to judge in this run; `base_seed` the run's seed, for the rerun hint after failures.
    """
    stats = summary.stats
    paths = "  ".join(f"{name} {stats.paths.get(name, 0)}" for name in PATHS)
    buckets = ", ".join(f"{size}: {count}" for size, count in sorted(stats.buckets_hit.items()))
    lines = [
        f"campaigns: {summary.campaigns}  examples: {stats.examples}{_shrunk(stats)}  "
        f"steps: {stats.steps}  "
        f"time: {stats.seconds:.1f} s",
        f"paths: {paths}",
        f"pipelined: {stats.pipelined_steps} of {stats.steps} steps (in pairs, the second "
        f"submitted before the first was read)",
        "token buckets hit (steps per capture size their tokens pad to, whichever path or graph "
        f"ran them; 0: more tokens than the largest, any phase): {buckets or 'none'}",
        f"fallback reasons: {fallback_causes(stats.fallback_reasons) or 'none'}",
        f"checks run: {_counts(stats.checks_run) or 'none'}",
        f"graph keys replayed (steps per key): {_most(stats.graph_keys) or 'none'}",
    ]
    idle = [name for name in checks if not stats.checks_run.get(name)]
    if idle and stats.steps:
        lines.append(f"not applicable (nothing to judge in this run): {', '.join(idle)}")
    lines.append(f"failures: {len(stats.failures)}")
    for failure in stats.failures:
        first_line = failure.message.splitlines()[0] if failure.message else ""
        seed = "" if failure.seed is None else f" (replay seed {failure.seed})"
        lines.append(f"  FAILED {failure.check} {failure.where}{seed}: {first_line}")
    if stats.failures:
        rerun = "run a failure's replay snippet to reproduce it alone"
        if base_seed is not None:
            rerun += f", or --graphmode-seed={base_seed} to rerun every campaign"
        lines.append(f"  ({rerun}; the replay seed is the one its snippet passes to `replay`)")
    if stats.first_failure_check is not None:
        lines.append(_first_failure_line(stats))
    if stats.harness_error is not None:
        lines.append(f"harness error (not a finding about the target): {stats.harness_error}")
    return lines


def _most(counts: Counter[str], top: int = 8) -> str:
    """The `top` most frequent of `counts`, most first, and how many more there are."""
    shown = ", ".join(f"{name}: {count}" for name, count in counts.most_common(top))
    more = len(counts) - top
    return shown + (f" (and {more} more)" if more > 0 else "")


def _shrunk(stats: CampaignStats) -> str:
    if not stats.shrink_examples:
        return ""
    return f" ({stats.shrink_examples} of them shrinking a failure)"


def fallback_causes(reasons: Counter[str], top: int = TOP_CAUSES) -> str:
    """`reasons` grouped by cause, most frequent first: the dispatcher's reasons carry the batch's
    numbers, so each distinct batch would otherwise be its own entry. A number every reason of a
    cause shares is part of its text and stays."""
    # cause -> the first clause of each of its reasons, with the reason's count
    groups: dict[str, list[tuple[str, int]]] = {}
    for reason, count in reasons.items():
        clause = _first_clause(reason).strip()
        groups.setdefault(_numbers_as_n(clause) or reason, []).append((clause, count))
    causes: Counter[str] = Counter()
    for cause, members in groups.items():
        causes[_shared_numbers_kept(cause, [clause for clause, _ in members])] += sum(
            count for _, count in members
        )
    shown = ", ".join(f"{cause}: {count}" for cause, count in causes.most_common(top))
    rest = len(causes) - top
    return f"{shown} (+{rest} more in the JSON report)" if rest > 0 else shown


def fallback_cause(reason: str) -> str:
    """The stable part of a fallback reason: its first clause, with numbers replaced by N
    (`batch of 12 tokens exceeds the largest capture size 8` -> `batch of N tokens exceeds the
    largest capture size N`)."""
    return _numbers_as_n(_first_clause(reason).strip()) or reason


def _numbers_as_n(clause: str) -> str:
    return re.sub(r"\d+", "N", clause)


def _shared_numbers_kept(cause: str, clauses: list[str]) -> str:
    """`cause` with the numbers all its `clauses` share written out: only those that differ
    from reason to reason are the batch's (`query longer than 1 + 4 tokens` keeps its 1 where the
    4 varies). The clauses of one cause differ in their numbers alone."""
    if not clauses[0]:
        return cause
    split = [re.split(r"(\d+)", clause) for clause in clauses]  # text, number, text, ...
    parts = split[0]
    for index in range(1, len(parts), 2):
        if any(other[index] != parts[index] for other in split):
            parts[index] = "N"
    return "".join(parts)


def _first_clause(reason: str) -> str:
    """`reason` up to its first `;` or `,` outside brackets: a graph key such as `(16, 32, 256)`
    belongs to its clause."""
    depth = 0
    for index, char in enumerate(reason):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(depth - 1, 0)
        elif char in ";," and depth == 0:
            return reason[:index]
    return reason


def check_glossary(
    summary: SessionSummary, descriptions: Mapping[str, str], *, verbose: bool
) -> list[str]:
    """One line per check saying what it proves: every check with -v, else the failed ones."""
    failed = dict.fromkeys(failure.check for failure in summary.stats.failures)
    names = list(descriptions) if verbose else [name for name in failed if name in descriptions]
    lines = [f"  {name}: {descriptions[name]}" for name in names]
    if lines:
        lines.insert(0, "what the checks prove:")
    if not verbose:
        lines.append("(-v explains every check)")
    return lines


def campaign_line(nodeid: str, data: Mapping[str, Any]) -> str:
    """One finished test's campaigns, for the xdist controller (which draws no progress line)."""
    failures = int(data["failures"])
    return (
        f"graphmode {nodeid}: {data['campaigns']} campaign(s), {data['examples']} examples, "
        f"{data['steps']} steps, {failures} failure{'s' if failures != 1 else ''}, "
        f"{float(data['seconds']):.1f} s"
    )


def leading_unshrunk(name: str) -> str:
    """What the summary and the announcement of a failure say of one found in the leading
    example `name`, which is never shrunk."""
    return f"not shrunk: it is the leading example {name}"


def _first_failure_line(stats: CampaignStats) -> str:
    if stats.first_failure_leading is not None:
        shrunk = leading_unshrunk(stats.first_failure_leading)
    elif stats.shrink_stopped_by_budget:
        shrunk = (
            f"shrinking stopped at its {stats.shrink_budget_seconds or 0.0:g} s budget after "
            f"{stats.shrink_seconds:.1f} s"
        )
    else:
        shrunk = f"shrinking finished after {stats.shrink_seconds:.1f} s"
    found_in = "" if stats.first_failure_campaign is None else f" of {stats.first_failure_campaign}"
    return (
        f"first failure: {stats.first_failure_check} at example {stats.first_failure_example}"
        f"{found_in} after {stats.first_failure_seconds or 0.0:.1f} s; {shrunk}"
    )


def write_report(
    path: Path,
    summary: SessionSummary,
    run: Mapping[str, Any],
    skipped: Mapping[str, str] | None = None,
) -> None:
    """Write the JSON report: how the run was configured (`run`), what it found, and which
    campaign tests it skipped and why (`skipped`: test id -> reason)."""
    document = {
        "version": REPORT_VERSION,
        "run": dict(run),
        **summary.to_json(),
        "skipped_campaigns": dict(skipped or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")


LIVE_INTERVAL = 0.5
"""Seconds between redraws of the progress line on a terminal."""
LOG_INTERVAL = 10.0
"""Seconds between progress lines written into a log (not a terminal): each one stays."""


class ProgressLine:
    """A `graphmode <label>: example N of M ...` line, shown at most every `interval` seconds.

    `write(text)` is the sink: on a terminal the reporter's in-place rewrite, into a log a plain
    line of its own. The line starts on a line of its own, and the last update of a campaign is
    always written, followed by a newline from `finish`. `planned` is the example budget, used
    until the engine reports its own (`planned_examples`).
    """

    def __init__(
        self,
        write: Callable[[str], None],
        newline: Callable[[], None],
        label: str,
        interval: float = LIVE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        planned: int | None = None,
    ) -> None:
        self._write = write
        self._newline = newline
        self._label = label
        self._interval = interval
        self._clock = clock
        self._planned = planned
        self._last_shown = float("-inf")
        self._pending: str | None = None

    def update(self, stats: CampaignStats) -> None:
        line = f"graphmode {self._label}: {self._text(stats)}"
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

    def _text(self, stats: CampaignStats) -> str:
        # The engine's newer fields are read with defaults: older engines lack them.
        planned = getattr(stats, "planned_examples", 0) or self._planned
        of = f" of {planned}" if planned else ""
        budget = getattr(stats, "time_budget_seconds", None)
        if budget and not planned:
            of = f" in a {budget:g} s budget"
        failures = len(stats.failures)
        text = f"example {stats.examples}{of}, {stats.steps} steps, {failures} failures"
        found_at = getattr(stats, "first_failure_example", None)
        if found_at is None:
            return text
        check = getattr(stats, "first_failure_check", None) or "a check"
        after = getattr(stats, "first_failure_seconds", None)
        found = f"FAILURE found by {check} at example {found_at}"
        if after is not None:
            found += f" after {after:.1f} s"
        if not getattr(stats, "shrinking", False):
            return f"{text}; {found}"
        spent = float(getattr(stats, "shrink_seconds", 0.0))
        budget = getattr(stats, "shrink_budget_seconds", None)
        of_budget = f" of {budget:.0f} s" if budget else ""
        return f"{found}; shrinking it to a minimal schedule ({spent:.0f} s{of_budget})"


def progress_line(config: pytest.Config, label: str, planned: int | None) -> ProgressLine:
    """The progress line of one campaign in this pytest run: redrawn in place on a terminal,
    a plain line every `LOG_INTERVAL` seconds into a log, nothing where no reporter draws (an
    xdist worker: the controller prints a line per finished test instead)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return ProgressLine(write=lambda line: None, newline=lambda: None, label=label)

    def shown(draw: Callable[[], None]) -> None:
        if capture is None:
            draw()
            return
        # Output capture would swallow a line written during the test call.
        with capture.global_and_fixture_disabled():
            draw()

    if reporter.isatty():
        return ProgressLine(
            write=lambda line: shown(lambda: reporter.rewrite(line, erase=True)),
            newline=lambda: shown(lambda: reporter.line("")),
            label=label,
            planned=planned,
        )
    return ProgressLine(
        write=lambda line: shown(lambda: reporter.write_line(line)),
        newline=lambda: None,
        label=label,
        interval=LOG_INTERVAL,
        planned=planned,
    )


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{name}: {count}" for name, count in counter.most_common())
