"""Swarm testing: each schedule switches a random part of the features and stressors off, and its
steps use only what is left on."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from pytest_graphmode.contract import Batch
from pytest_graphmode.strategies.plans import StepPlan
from pytest_graphmode.strategies.scheduler import BlockScheduler, compile_schedule
from pytest_graphmode.strategies.schedules import _plan_lists, step_plans
from pytest_graphmode.strategies.swarm import (
    EVERYTHING,
    FEATURES,
    SHAPES,
    STRESSORS,
    Swarm,
    swarms,
)
from tests.fuzz import toy


def _uses(plan: StepPlan) -> set[str]:
    """The features and stressors `plan` uses."""
    used = set()
    if any(a.adapter for a in plan.arrivals):
        used.add("adapters")
    if any(a.seed is not None for a in plan.arrivals):
        used.add("sampling")
    if plan.kind == "spec":
        used.add("spec_decode")
    stress = plan.stress
    if stress.weight_seed is not None:
        used.add("weight_update")
    if stress.churn:
        used.add("churn")
    if stress.delay_cycles or stress.scheduler_seed is not None:
        used.add("delays")
    if stress.pipelined:
        used.add("pipelined")
    return used


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_steps_use_only_what_their_swarm_leaves_on(data: st.DataObject) -> None:
    swarm = data.draw(swarms(toy.SPEC))
    plans = data.draw(st.lists(step_plans(toy.SPEC, True, swarm), max_size=6))
    allowed = swarm.features | swarm.stressors
    for plan in plans:
        assert _uses(plan) <= allowed, (plan, swarm)


def test_every_feature_stressor_and_shape_is_switched_off_by_some_swarm_and_on_by_others() -> None:
    assert find(swarms(toy.SPEC), lambda s: True) == EVERYTHING  # the simplest: all on
    for name in (*FEATURES, *STRESSORS, *SHAPES):
        off = find(swarms(toy.SPEC), lambda s, n=name: n not in _on(s))
        assert _on(off) == set(FEATURES + STRESSORS + SHAPES) - {name}


class _RoomCounting(BlockScheduler):
    """Counts the steps at which every block was taken and all requests but one were preempted."""

    made_room = 0

    def _make_room(self, plan: StepPlan) -> list[Any]:
        self.made_room += 1
        return super()._make_room(plan)


@pytest.mark.parametrize(
    "shapes", [frozenset({"regrouping"}), frozenset()], ids=["regrouped", "draining"]
)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_without_admissions_only_the_first_step_admits_and_the_rest_decode(
    shapes: frozenset[str], data: st.DataObject
) -> None:
    no_admissions = dataclasses.replace(data.draw(swarms(toy.SPEC)), shapes=shapes)
    plans = data.draw(_plan_lists(toy.SPEC, True, 8, no_admissions))
    opening, steady = _opening(plans)
    first = opening[0]
    assert steady, "a schedule of the opening steps alone only prefills"
    for plan in opening:
        assert (plan.kind, plan.chunk, plan.rows) == (
            "prefill",
            toy.SPEC.max_num_tokens,
            toy.SPEC.max_num_reqs,
        )
    # a crowd of 1-3 token prompts but for at most one long one, prefilled by the opening steps
    assert sum(not 1 <= a.prompt_len <= 3 for a in first.arrivals) <= 1
    tokens = sum(a.prompt_len for a in first.arrivals)
    assert len(opening) == min(-(-tokens // toy.SPEC.max_num_tokens), len(plans) - 1)
    for plan in steady:
        assert plan.kind in ("decode", "spec") and not plan.arrivals and not plan.preempt, plan
        assert len(plan.finish) <= 1
    scheduler = _RoomCounting(toy.SPEC, seed=0)
    admitted = {r.req_id for plan in opening for r in scheduler.compile(plan).requests}
    for plan in steady:
        preempted_before = scheduler.made_room > 0
        batch = scheduler.compile(plan)
        # A prefill after the first step only where every request had finished before it, or
        # where a request preempted when the blocks ran out computes its prompt again
        fresh = [r for r in batch.requests if r.context_len == 0]
        restarted = [r for r in fresh if r.req_id in admitted]
        assert not restarted or preempted_before, batch
        assert restarted or not fresh or all(r.req_id not in admitted for r in batch.requests)
        admitted |= {r.req_id for r in batch.requests}


def _opening(plans: list[StepPlan]) -> tuple[list[StepPlan], list[StepPlan]]:
    """A schedule without admissions split into its opening steps (the crowd's, and the prefill
    steps that finish its prompts past one step's token budget) and its steady steps."""
    count = 1
    while count < len(plans) and plans[count].kind == "prefill" and not plans[count].arrivals:
        count += 1
    return plans[:count], plans[count:]


@st.composite
def _draining(draw: st.DrawFn) -> list[StepPlan]:
    """Schedules of swarms with admissions and regrouping off: an opening crowd, then a drain."""
    swarm = dataclasses.replace(draw(swarms(toy.SPEC)), shapes=frozenset())
    assert swarm.drains
    return draw(_plan_lists(toy.SPEC, True, 8, swarm))


def _ids_past_prompts(batch: Batch) -> list[int] | None:
    """The batch's request ids in row order; None unless every request is past its prompt."""
    if all(r.context_len > 0 for r in batch.requests):
        return [r.req_id for r in batch.requests]
    return None


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_a_draining_batch_keeps_its_order(data: st.DataObject) -> None:
    plans = data.draw(_draining())
    opening, steady = _opening(plans)
    assert len(steady) >= 3, "a drain needs steps to lose rows in"
    for plan in steady:
        assert (plan.kind, plan.rows, plan.rotate) == ("decode", toy.SPEC.max_num_reqs, 0), plan
        assert plan.finish in ((), (-1,)), plan
    events = compile_schedule(toy.SPEC, plans, seed=data.draw(st.integers(0, 2**16)))
    batches = [e for e in events if isinstance(e, Batch)][len(opening) - 1 :]
    for plan, before, after in zip(steady[1:], batches[1:-1], batches[2:], strict=True):
        rows_before, rows_after = _ids_past_prompts(before), _ids_past_prompts(after)
        if rows_before is None or rows_after is None:
            continue  # a request that the opening step could not prefill runs its prompt
        # Shorter where the last request finished, or where the blocks ran out for a request
        # that needed one more (it runs again once a block is free): either way the requests
        # of both steps keep their order.
        remaining = iter(rows_before)
        stayed = [req for req in rows_after if req in rows_before]
        assert all(req in remaining for req in stayed), (plan, before, after)


def test_a_draining_batch_loses_its_last_row_while_the_rows_before_it_stay() -> None:
    def loses_its_tail(plans: list[StepPlan]) -> bool:
        batches = [e for e in compile_schedule(toy.SPEC, plans) if isinstance(e, Batch)]
        rows = [_ids_past_prompts(b) for b in batches[1:]]
        return any(
            a is not None and b is not None and len(b) >= 2 and b == a[:-1]
            for a, b in itertools.pairwise(rows)
        )

    assert find(_draining(), loses_its_tail, settings=settings(database=None))


def _on(swarm: Swarm) -> set[str]:
    return set(swarm.features | swarm.stressors | swarm.shapes)


def test_a_swarm_removes_only_what_it_switched_off_from_the_spec() -> None:
    assert Swarm(frozenset(FEATURES), frozenset()).spec(toy.SPEC).features == toy.FEATURES
    no_adapters = Swarm(frozenset(FEATURES) - {"adapters"}, frozenset(STRESSORS))
    assert no_adapters.spec(toy.SPEC).features == toy.FEATURES - {"adapters"}
    lacking = dataclasses.replace(toy.SPEC, features=frozenset({"decode"}))
    assert EVERYTHING.spec(lacking).features == {"decode"}
