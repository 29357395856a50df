"""Schedules for data-parallel ranks: one batch per rank and step, idle ranks, rank-local faults.

Each step draws one plan that most ranks share, so the ranks often agree on a FULL graph and the
coordination must keep them there (now and then the shared plan loads every rank to its limits),
and gives some ranks a plan of their own (a prefill, a speculative step or an adapter only that
rank has) or nothing at all (an idle rank runs a dummy batch). Rank-local faults push one rank
onto another path: forced eager, or every capture failing during the step. Stressors that change a
target's configuration (weight updates) apply to every rank at the same step, as a serving engine
applies them; every rank has its own scheduler, blocks and requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from hypothesis import strategies as st

from pytest_graphmode.contract import Batch, TargetSpec
from pytest_graphmode.strategies.plans import Arrival, StepPlan, Stress
from pytest_graphmode.strategies.scheduler import BlockScheduler
from pytest_graphmode.strategies.schedules import step_plans

RankEvent: TypeAlias = Batch | Stress  # an idle rank's step is the empty batch


@dataclass(frozen=True)
class RankFault:
    """Rank-local conditions for the next step: `force_eager` (the rank may not replay) and
    `fail_captures` (every graph capture on the rank fails during the step)."""

    force_eager: bool = False
    fail_captures: bool = False

    @property
    def active(self) -> bool:
        return self != RankFault()


@dataclass(frozen=True)
class RankStep:
    """One step of every rank: `plans[r]` is rank r's plan (None: idle), `faults[r]` its faults,
    `stress` what happens to every rank before the step."""

    plans: tuple[StepPlan | None, ...]
    faults: tuple[RankFault, ...]
    stress: Stress = field(default_factory=Stress)

    def __post_init__(self) -> None:
        if len(self.plans) != len(self.faults):
            raise ValueError(f"{len(self.plans)} plans but {len(self.faults)} faults")


def rank_faults() -> st.SearchStrategy[RankFault]:
    """Mostly none: a fault on every step would keep every rank off the graphs."""
    return st.one_of(
        st.just(RankFault()),
        st.just(RankFault()),
        st.builds(RankFault, force_eager=st.booleans(), fail_captures=st.booleans()),
    )


def loaded_plans(spec: TargetSpec) -> st.SearchStrategy[StepPlan]:
    """Steps that fill a rank to its limits (long prompts arriving, every ready request in the
    batch, the largest chunk): where ranks under load meet, a coordination step that adds up the
    ranks' sizes instead of taking the largest outgrows every bucket and buffer."""
    longest = BlockScheduler(spec).capacity
    long_prompts = st.builds(Arrival, prompt_len=st.integers(max(1, longest // 2), longest))
    return st.builds(
        StepPlan,
        kind=st.sampled_from(("prefill", "mixed", "decode")),
        rows=st.just(spec.max_num_reqs),
        arrivals=st.lists(long_prompts, min_size=2, max_size=4).map(tuple),
        chunk=st.just(spec.max_num_tokens),
    )


@st.composite
def rank_steps(draw: st.DrawFn, spec: TargetSpec, ranks: int) -> RankStep:
    shared = draw(st.one_of(step_plans(spec), loaded_plans(spec)))
    plans: list[StepPlan | None] = []
    for _ in range(ranks):
        role = draw(st.sampled_from(("shared", "shared", "own", "idle")))
        if role == "idle":
            plans.append(None)
        else:
            plan = shared if role == "shared" else draw(step_plans(spec))
            plans.append(dataclasses.replace(plan, stress=Stress()))
    faults = tuple(draw(rank_faults()) for _ in range(ranks))
    # The data-parallel driver runs its ranks in lockstep: it has no pipelined pairs.
    stress = dataclasses.replace(shared.stress, pipelined=False)
    return RankStep(tuple(plans), faults, stress)


def rank_schedules(
    spec: TargetSpec, ranks: int, max_steps: int = 12
) -> st.SearchStrategy[list[RankStep]]:
    """Lists of 1..max_steps steps of `ranks` ranks; any such list compiles to legal batches."""
    if ranks < 1 or max_steps < 1:
        raise ValueError(f"ranks={ranks} and max_steps={max_steps} must be >= 1")
    return st.lists(rank_steps(spec, ranks), min_size=1, max_size=max_steps)


def compile_rank_schedule(
    spec: TargetSpec, steps: Sequence[RankStep], seed: int = 0
) -> list[list[RankEvent | RankFault]]:
    """Every rank's event list: per step the shared `Stress` (when active), the rank's
    `RankFault` (when active), then its batch (empty when idle). Ranks schedule independently,
    each from its own seed."""
    ranks = len(steps[0].plans) if steps else 0
    schedulers = [BlockScheduler(spec, seed * 7919 + rank) for rank in range(ranks)]
    events: list[list[RankEvent | RankFault]] = [[] for _ in range(ranks)]
    for step in steps:
        if len(step.plans) != ranks:
            raise ValueError(f"a step of {len(step.plans)} ranks in a schedule of {ranks}")
        for rank, (plan, fault) in enumerate(zip(step.plans, step.faults, strict=True)):
            if step.stress.active:
                events[rank].append(step.stress)
            if fault.active:
                events[rank].append(fault)
            events[rank].append(Batch(()) if plan is None else schedulers[rank].compile(plan))
    return events
