"""Swarm testing: each schedule switches a random part of the features and stressors off, and its
steps use only what is left on."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from pytest_graphmode.contract import Batch
from pytest_graphmode.strategies.plans import StepPlan
from pytest_graphmode.strategies.scheduler import compile_schedule
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


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_without_admissions_only_the_first_step_admits_and_the_rest_decode(
    data: st.DataObject,
) -> None:
    no_admissions = dataclasses.replace(data.draw(swarms(toy.SPEC)), shapes=frozenset())
    plans = data.draw(_plan_lists(toy.SPEC, True, 8, no_admissions))
    first, *later = plans
    assert later, "a schedule of the opening step alone only prefills"
    assert (first.kind, first.chunk, first.rows) == (
        "prefill",
        toy.SPEC.max_num_tokens,
        toy.SPEC.max_num_reqs,
    )
    assert all(1 <= a.prompt_len <= 3 for a in first.arrivals)  # a crowd: prefilled at once
    for plan in later:
        assert plan.kind in ("decode", "spec") and not plan.arrivals and not plan.preempt, plan
        assert len(plan.finish) <= 1
    batches = [e for e in compile_schedule(toy.SPEC, plans, seed=0) if isinstance(e, Batch)]
    admitted = {r.req_id for r in batches[0].requests}
    for batch in batches[1:]:
        # A prefill after the first step only where every request had finished before it
        fresh = [r for r in batch.requests if r.context_len == 0]
        assert not fresh or all(r.req_id not in admitted for r in batch.requests), batch
        admitted |= {r.req_id for r in batch.requests}


def _on(swarm: Swarm) -> set[str]:
    return set(swarm.features | swarm.stressors | swarm.shapes)


def test_a_swarm_removes_only_what_it_switched_off_from_the_spec() -> None:
    assert Swarm(frozenset(FEATURES), frozenset()).spec(toy.SPEC).features == toy.FEATURES
    no_adapters = Swarm(frozenset(FEATURES) - {"adapters"}, frozenset(STRESSORS))
    assert no_adapters.spec(toy.SPEC).features == toy.FEATURES - {"adapters"}
    lacking = dataclasses.replace(toy.SPEC, features=frozenset({"decode"}))
    assert EVERYTHING.spec(lacking).features == {"decode"}
