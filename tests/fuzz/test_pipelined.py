"""Pipelined pairs: the graph twin gets a pair's second step before anything of the first is read,
pairs never chain, both steps are judged, and the draws include them unless told not to."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_graphmode.contract import Batch, Request, StepResult
from pytest_graphmode.fuzz import GraphmodeFailure, replay
from pytest_graphmode.fuzz.checks import RESULTS_STAY_VALID, results_disjoint
from pytest_graphmode.fuzz.failure_message import how_it_ran
from pytest_graphmode.fuzz.kv_checks import kv_writes_confined, unlanded
from pytest_graphmode.strategies.plans import StepPlan, Stress
from pytest_graphmode.strategies.rank_schedules import rank_steps
from pytest_graphmode.strategies.scheduler import compile_schedule
from pytest_graphmode.strategies.schedules import schedules
from tests.fuzz import toy
from tests.fuzz.test_mutants import EXPECTED, PLANS
from tests.runners.caught import failure_of
from tests.runners.from_docs import fallback_shares_buffers

PAIRED = Stress(pipelined=True)
# Steps 2 and 5 are pipelined: the pairs are (1, 2) and (4, 5); the spec step 3 (a weight update)
# and the decode step 6 run in lockstep.
PIPELINED_PLANS = [
    dataclasses.replace(plan, stress=PAIRED) if step in (2, 5) else plan
    for step, plan in enumerate(PLANS)
]
EVENTS = compile_schedule(toy.SPEC, PIPELINED_PLANS, seed=5)


def test_a_pipelined_stress_refuses_churn_and_weight_updates() -> None:
    with pytest.raises(ValueError, match="pipelined=True"):
        Stress(pipelined=True, churn=1)
    with pytest.raises(ValueError, match="pipelined=True"):
        Stress(pipelined=True, weight_seed=3)


def test_the_correct_toy_passes_with_pipelined_pairs() -> None:
    stats = replay(EVENTS, factory=toy.make_target, seed=3)
    assert stats.failures == []
    assert (stats.steps, stats.pipelined_steps) == (len(PLANS), 4)


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_each_toy_mutant_fails_its_check_with_pipelined_pairs(bug: str) -> None:
    with pytest.raises(GraphmodeFailure) as caught:
        replay(EVENTS, factory=toy.factory([bug]), seed=3)
    assert caught.value.failure.check == EXPECTED[bug]


class _Recording:
    """A toy target that logs the contract calls a driver makes on it."""

    def __init__(self, mode: str, *, seed: int, backend: str) -> None:
        self.target = toy.ToyTarget(mode, seed=seed, backend=backend)
        self.spec = self.target.spec
        self.log: list[str] = []
        _MADE.append(self)

    def step(self, batch: Batch) -> StepResult:
        self.log.append(f"step {batch.num_reqs}")
        return self.target.step(batch)

    def state(self) -> Mapping[str, torch.Tensor]:
        self.log.append("state")
        return self.target.state()

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        self.log.append("static_buffers")
        return self.target.static_buffers()

    def address_views(self) -> Any:
        self.log.append("address_views")
        return self.target.address_views()

    def update_weights(self, seed: int) -> None:
        self.target.update_weights(seed)

    def close(self) -> None:
        self.target.close()


_MADE: list[_Recording] = []


def test_the_graph_twin_gets_the_second_step_before_anything_of_the_first_is_read() -> None:
    first = Batch((Request(1, (3,), 0, (1,)),))
    second = Batch((Request(1, (4,), 1, (1,)), Request(2, (5,), 0, (2,))))
    _MADE.clear()
    stats = replay([first, PAIRED, second], factory=_Recording, seed=1)
    graph = _MADE[0]  # the lockstep driver makes the graph twin first
    assert stats.pipelined_steps == 2
    assert graph.log[graph.log.index("step 1") + 1] == "step 2"


def test_pairs_do_not_chain() -> None:
    batches = [Batch((Request(1, (3 + i,), i, (1,)),)) for i in range(4)]
    chained = [batches[0], PAIRED, batches[1], PAIRED, batches[2], PAIRED, batches[3]]
    assert replay(chained, factory=toy.make_target, seed=1).pipelined_steps == 4
    alone = [batches[0], PAIRED, batches[1], PAIRED, batches[2], batches[3]]
    assert replay(alone, factory=toy.make_target, seed=1).pipelined_steps == 2


def test_results_held_at_once_must_not_share_memory() -> None:
    buffer = torch.zeros(4, toy.SPEC.vocab_size)
    tokens = torch.zeros(4, dtype=torch.long)
    earlier = StepResult(buffer[:2], tokens[:2].clone(), "full", 2)
    later = StepResult(buffer[1:3], tokens[:2].clone(), "full", 2)
    (violation,) = results_disjoint(earlier, 4, later, 5)
    assert violation.check == RESULTS_STAY_VALID
    assert "step 5 wrote into the result of step 4" in violation.detail
    apart = StepResult(buffer[2:4], tokens[2:4], "full", 2)
    assert results_disjoint(earlier, 4, apart, 5) == []
    empty = StepResult(buffer[:0], tokens[:0], "eager", None)
    assert results_disjoint(empty, 4, StepResult(buffer[:0], tokens[:0], "eager", None), 5) == []


def test_kv_writes_of_a_pair_may_touch_either_steps_slots() -> None:
    spec = toy.SPEC
    first = Batch((Request(1, (3,), 0, (1,)),))
    second = Batch((Request(2, (4,), 0, (2,)),))
    before = {"kv": torch.zeros(spec.num_slots, 2)}
    after = {"kv": before["kv"].clone()}
    after["kv"][1 * spec.block_size] = 1.0  # the first step's slot
    assert kv_writes_confined(second, before, after, spec, also=(first,)) == []
    (violation,) = kv_writes_confined(second, before, after, spec)
    assert "this step does not write" in violation.detail
    after["kv"][3 * spec.block_size] = 1.0
    (violation,) = kv_writes_confined(second, before, after, spec, also=(first,))
    assert "these two steps do not write" in violation.detail


def test_a_pairs_unwritten_slot_names_the_step_its_token_belongs_to() -> None:
    spec = toy.SPEC
    first = Batch((Request(1, (3,), 0, (1,)),))
    second = Batch((Request(2, (4,), 0, (2,)),))
    marked = torch.full((spec.num_slots, 2), 0.5)
    after = {"kv": marked.clone()}
    after["kv"][1 * spec.block_size] = 1.0  # the first step's token landed, the second's did not
    (violation,) = unlanded((first, second), [2 * spec.block_size], spec, "graph")
    assert "req 2's position 0 in the pair's second step belongs" in violation.detail
    (violation,) = unlanded((first,), [1 * spec.block_size], spec, "graph")
    assert "req 1's position 0 belongs: the step stored" in violation.detail
    assert kv_writes_confined(first, {"kv": marked}, after, spec, also=(second,)) == []
    stray = {"kv": marked.clone()}
    stray["kv"][2 * spec.block_size + 1] = 1.0  # a slot of the second step's block, not its token's
    (violation,) = kv_writes_confined(first, {"kv": marked}, stray, spec, also=(second,))
    assert "owned by req 2 in the pair's second step" in violation.detail


@pytest.mark.parametrize(("bug", "step"), [("padding_not_reset", 1), ("overlapping_views", 2)])
def test_a_pairs_failure_describes_both_steps(bug: str, step: int) -> None:
    """Steps 1 and 2 of `EVENTS` are a pair: its failure at either shows both steps' batches."""
    with pytest.raises(GraphmodeFailure) as caught:
        replay(EVENTS, factory=toy.factory([bug]), seed=3)
    failure = caught.value.failure
    assert failure.step == step
    assert f"failed at step {step}, in the pipelined pair of steps 1 and 2 (" in failure.message
    assert "steps 1 and 2 ran as a pipelined pair" in failure.message
    assert "\nstep 1: " in failure.message and "\nstep 2: " in failure.message
    # each step's line says how the graph twin ran it
    assert failure.message.count("; graph twin: path full, graph key ") == 2, failure.message
    # how to tell whether the pairing matters: the snippet's pair, run one step after the other
    assert "the snippet with `pipelined=False` in that `Stress`" in failure.message
    assert "pipelined=True" in failure.replay_snippet


def test_a_race_across_a_pair_names_the_step_each_side_came_from() -> None:
    """The runner's copy stream uploads the second step's inputs into the static buffers that the
    first step's compute, still queued, reads: the race's sides are issued by the two steps of a
    pair, and its report says so, not only their lines (the same for every step)."""
    failure = failure_of(fallback_shares_buffers.make_buggy_target, "sim", examples=2)
    assert failure.check == "no_stream_races", failure.message
    assert "fallback_shares_buffers.py:" in failure.message
    assert ", in step 0, the first of a pipelined pair\n" in failure.message, failure.message
    assert ", in step 1, the second of a pipelined pair\n" in failure.message, failure.message


def test_a_block_handed_on_within_a_pair_keeps_what_the_first_step_reads() -> None:
    """A request finishes between the steps of a pair and the next one starts in its block: the
    first step still attends to that block, so the slots the second step writes there are not
    marked before the pair (`idle_blocks.slots_to_write`); a correct runner passes."""
    first = Request(0, (5,), context_len=2, block_ids=(3,))
    events = [
        Batch((Request(0, (4, 6), context_len=0, block_ids=(3,)),)),
        Batch((first,)),
        PAIRED,  # the second step of the pair: `first` and this one
        Batch((Request(1, (7,), context_len=0, block_ids=(3,)),)),
    ]
    stats = replay(events, factory=toy.make_target, seed=3)
    assert stats.failures == [] and stats.pipelined_steps == 2


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_only_the_single_rank_draws_are_pipelined(data: st.DataObject) -> None:
    plans: list[StepPlan] = data.draw(schedules(toy.SPEC, pipelined=False))
    assert not any(plan.stress.pipelined for plan in plans)
    assert not data.draw(rank_steps(toy.SPEC, ranks=2)).stress.pipelined


def test_the_default_draws_include_pipelined_steps() -> None:
    drawn: list[bool] = []

    @settings(max_examples=60, deadline=None, database=None)
    @given(schedules(toy.SPEC))
    def draw(plans: list[StepPlan]) -> None:
        drawn.extend(plan.stress.pipelined for plan in plans)

    draw()
    assert any(drawn) and not all(drawn)


def test_a_failed_steps_line_says_how_the_graph_twin_ran_it() -> None:
    full = StepResult(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), "full", 8)
    eager = StepResult(
        torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), "eager", None, "prefill"
    )
    assert how_it_ran(full) == "; graph twin: path full, graph key 8"
    assert how_it_ran(eager) == "; graph twin: path eager (prefill)"
    assert how_it_ran(None) == "; graph twin: raised"
