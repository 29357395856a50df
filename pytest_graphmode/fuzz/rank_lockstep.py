"""One rank's side of a data-parallel example: the lockstep twins of one rank, joined to the group.

Runs inside a rank's process (see `fuzz.ranks`). The rank's graph twin and its clean twin are made
inside `runtime.data_parallel.joined`, each with a process group of its own, so every rank's graph
twins coordinate with each other and every rank's clean twins likewise; the eager twins run alone.
Every step runs the checks of `registry.REGISTRY` on this rank through `Lockstep` (an idle rank
checks that its dummy batch wrote nothing but the null block), then all ranks exchange a
`RankReport` in one more collective and judge `ranks_agree` together, so every rank stops at the
same step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal
from unittest import mock

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import Batch, GraphTarget, StepResult, TargetFactory
from pytest_graphmode.fuzz import kv_checks
from pytest_graphmode.fuzz.checks import Outcome
from pytest_graphmode.fuzz.lockstep import Lockstep, snapshot, step_outcome
from pytest_graphmode.fuzz.rank_checks import RANKS_AGREE, RankReport, first_violation
from pytest_graphmode.fuzz.registry import Kept
from pytest_graphmode.fuzz.violation import Violation
from pytest_graphmode.runtime.backends.footprint import issuing
from pytest_graphmode.runtime.data_parallel import DataParallel, joined
from pytest_graphmode.strategies.plans import Stress
from pytest_graphmode.strategies.rank_schedules import RankEvent, RankFault


@dataclass(frozen=True)
class Finding:
    """A failed check as every rank saw it: the check, the step, the rank it belongs to (None:
    all of them) and the text to show."""

    check: str
    step: int
    rank: int | None
    text: str


class RankLockstep(Lockstep):
    """The lockstep twins of rank `graph_member.rank`; `exchange` gathers one object per rank."""

    def __init__(
        self,
        factory: TargetFactory,
        *,
        backend: str,
        seed: int,
        stats: CampaignStats,
        members: tuple[DataParallel, DataParallel],
        exchange: Callable[[RankReport], list[RankReport]],
        arrive: Callable[[int], None],
    ) -> None:
        self._members = members
        self._joined = 0
        self._exchange, self._arrive = exchange, arrive
        self._last: StepResult | None = None
        super().__init__(factory, backend=backend, seed=seed, stats=stats)

    def _make(self, mode: Literal["graph", "eager"]) -> GraphTarget:
        if mode == "eager":
            return super()._make(mode)
        # The graph twin first, the clean twin second: each joins a group of its own.
        member = self._members[self._joined]
        self._joined += 1
        with joined(member):
            return super()._make(mode)

    def run_rank(self, events: Sequence[RankEvent | RankFault]) -> Finding | None:
        """Run this rank's events; the first finding of any rank, the same on every rank."""
        kept: list[Kept] = []
        pending, fault = Stress(), RankFault()
        previous: Batch | None = None
        step = 0
        for event in events:
            if isinstance(event, Stress):
                pending = event
                continue
            if isinstance(event, RankFault):
                fault = event
                continue
            self._arrive(step)
            rng = random.Random(self.seed * 1_000_003 + step)
            with issuing(f"step {step}"):  # a race's sides say which step they came from
                held = self._stress(pending, previous, event, rng)
                self._last = None
                with self._faults(fault):
                    if event.requests:
                        violations, kept = self._check_step(step, event, kept, pending)
                    else:
                        violations = self._check_idle(step, event, pending)
            held.clear()
            pending, fault = Stress(), RankFault()
            finding = self._judge(step, event, violations)
            if finding is not None:
                return finding
            if event.requests:
                previous = event
            step += 1
        return None

    def _count(self, step: int, batch: Batch, result: StepResult | None) -> None:
        self._last = result
        super()._count(step, batch, result)

    @contextmanager
    def _faults(self, fault: RankFault) -> Iterator[None]:
        for member in self._members:
            member.force_eager = fault.force_eager
        try:
            if fault.fail_captures:
                # Shadows the backend's `graph` for this step only; the method shows again after.
                failing = _failing_capture(self._members[0].rank)
                with mock.patch.object(self.backend, "graph", failing):
                    yield
            else:
                yield
        finally:
            for member in self._members:
                member.force_eager = False

    def _check_idle(self, step: int, batch: Batch, stress: Stress) -> list[Violation]:
        """An idle rank runs the agreed shape on a dummy batch: empty results, and no KV write
        outside the null block."""
        before = snapshot(self.graph.state())
        graph = self._graph_step(batch, stress)
        clean = step_outcome(self.clean, batch)
        self._count(step, batch, graph.result)
        for twin, outcome in (("graph", graph), ("clean", clean)):
            problem = _idle_problem(outcome, self.spec.vocab_size)
            if problem:
                return [Violation(RANKS_AGREE, f"idle rank, {twin} twin: {problem}")]
        self.stats.checks_run[kv_checks.KV_WRITES_CONFINED] += 1
        after = snapshot(self.graph.state())
        return kv_checks.kv_writes_confined(batch, before, after, self.spec, "graph")

    def _judge(self, step: int, batch: Batch, violations: list[Violation]) -> Finding | None:
        result = self._last
        report = RankReport(
            rank=self._members[0].rank,
            path=None if result is None else result.path,
            key=None if result is None else result.graph_key,
            reason=None if result is None else result.reason,
            idle=not batch.requests,
            violation=violations[0] if violations else None,
        )
        reports = self._exchange(report)
        self.stats.checks_run[RANKS_AGREE] += 1
        found = first_violation(reports)
        if found is None:
            return None
        rank, violation = found
        ranks = "\n".join(f"  {r.describe()}" for r in reports)
        text = f"{violation.describe()}\nevery rank at step {step}:\n{ranks}"
        return Finding(violation.check, step, rank, text)


def _idle_problem(outcome: Outcome, vocab: int) -> str | None:
    if outcome.result is None:
        return f"raised on the dummy batch:\n{outcome.error}"
    shapes = (tuple(outcome.result.logits.shape), tuple(outcome.result.next_tokens.shape))
    if shapes != ((0, vocab), (0,)):
        return f"results of shapes {shapes} for an empty batch, want ((0, {vocab}), (0,))"
    return None


def _failing_capture(rank: int) -> Callable[..., Any]:
    from pytest_graphmode.runtime.backends import CaptureError

    def graph(*args: object, **kwargs: object) -> Any:
        raise CaptureError(f"capture failure injected on rank {rank}")

    return graph
