"""Every check catches the toy mutant that breaks its rule, and passes the correct toy, on one
fixed schedule replayed through the full lockstep driver."""

from __future__ import annotations

import pytest

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.fuzz import GraphmodeFailure, lockstep, replay
from pytest_graphmode.fuzz.snippet import replay_snippet
from pytest_graphmode.strategies.idle_blocks import MarkedBlocks
from pytest_graphmode.strategies.plans import Arrival, StepPlan, Stress
from pytest_graphmode.strategies.scheduler import compile_schedule
from tests.fuzz import toy

PLANS = [
    StepPlan(
        "prefill", rows=3, arrivals=(Arrival(3, seed=11), Arrival(2), Arrival(5, seed=12)), chunk=4
    ),
    StepPlan("decode", rows=3, stress=Stress(churn=2)),
    StepPlan("decode", rows=2, rotate=1),
    StepPlan("spec", rows=3, spec_k=2, accepted=1, stress=Stress(weight_seed=4)),
    StepPlan("decode", rows=3, rotate=2, arrivals=(Arrival(1, seed=13),)),
    StepPlan("decode", rows=1),
    StepPlan("decode", rows=4),
]
EVENTS = compile_schedule(toy.SPEC, PLANS, seed=5)

EXPECTED = {
    "padding_not_reset": "kv_writes_confined",
    "output_view": "results_stay_valid",
    "seed_baked": "replay_matches_eager",
    "row_noise": "sampling_independent",
    "slot_noise": "sampling_independent",
    "row_bias": "sampling_independent",  # the sampled requests' rows move first
    "reads_scratch": "padding_inert",
    "drift": "replay_matches_eager",
    "global_noise": "replay_matches_eager",
    "raises_at_3": "replay_matches_eager",
    "overlapping_views": "address_views_disjoint",
    "pool_growth": "pool_within_bound",
}
# Bugs that schedule does not reach, each with a test of its own below.
OWN_SCHEDULE = {"host_rows_stale": "kv_writes_confined"}


def test_every_toy_bug_has_an_expected_check():
    assert set(EXPECTED) | set(OWN_SCHEDULE) == toy.BUGS


def test_the_correct_toy_passes_every_check():
    stats = replay(EVENTS, factory=toy.make_target, seed=3)
    assert stats.steps == len(PLANS)
    assert stats.failures == []
    assert stats.paths["full"] > 0 and stats.paths["eager"] > 0


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_each_mutant_fails_its_check(bug):
    with pytest.raises(GraphmodeFailure) as caught:
        replay(EVENTS, factory=toy.factory([bug]), seed=3)
    assert caught.value.failure.check == EXPECTED[bug]
    assert caught.value.stats is not None
    assert caught.value.stats.failures == [caught.value.failure]


def test_failure_message_names_check_step_seed_and_replay():
    with pytest.raises(GraphmodeFailure) as caught:
        replay(EVENTS, factory=toy.factory(["padding_not_reset"]), seed=3)
    failure = caught.value.failure
    message = str(caught.value)
    assert f"'kv_writes_confined' failed at step {failure.step} (seed 3)" in message
    assert "owned by req" in message or "owned by no request" in message
    assert failure.replay_snippet in message


def test_the_replay_snippet_reproduces_the_failure():
    with pytest.raises(GraphmodeFailure) as caught:
        replay(EVENTS, factory=toy.factory(["drift"]), seed=3)
    snippet = caught.value.failure.replay_snippet
    snippet = snippet.replace("make_target", "toy.factory(['drift'])")
    with pytest.raises(GraphmodeFailure) as again:
        exec(snippet, {"toy": toy})
    assert again.value.failure.check == "replay_matches_eager"
    assert again.value.failure.step == caught.value.failure.step


def test_snippet_imports_a_factory_importable_by_name():
    snippet = replay_snippet(EVENTS[:1], factory=toy.make_target, backend="sim", seed=3)
    assert "from tests.fuzz.toy import make_target" in snippet
    assert snippet.endswith("replay(events, backend='sim', seed=3, factory=make_target)")


def test_snippet_asks_for_a_factory_that_has_no_importable_name():
    snippet = replay_snippet(EVENTS[:1], factory=toy.factory(["drift"]), backend="sim", seed=3)
    assert "# make_target: your TargetFactory" in snippet


def test_replay_refuses_an_illegal_batch_before_running_it():
    illegal = Batch((Request(0, (1,), context_len=0, block_ids=(0,)),))  # the null block
    with pytest.raises(ValueError, match="null block"):
        replay([illegal], factory=toy.make_target)


def _departed() -> list[Batch]:
    """Four requests prefill two tokens each, decode one token each, then decode without the
    last one, which has finished (its block is free)."""
    blocks = (1, 2, 3, 4)
    prefill = Batch(tuple(Request(i, (i, i + 5), 0, (b,)) for i, b in enumerate(blocks)))
    decode = Batch(tuple(Request(i, (i + 9,), 2, (b,)) for i, b in enumerate(blocks)))
    after = Batch(tuple(Request(i, (i + 13,), 3, (b,)) for i, b in enumerate(blocks[:3])))
    return [prefill, decode, after]


def test_a_write_of_the_bits_an_idle_slot_holds_fails_kv_writes_confined():
    """The padding row of the three-request step still holds the finished request's inputs and
    stores its keys again: bit for bit what its slot holds, so only the mark the harness puts in
    idle blocks during a step shows the write."""
    with pytest.raises(GraphmodeFailure) as caught:
        replay(_departed(), factory=toy.factory(["host_rows_stale"]), seed=3)
    assert caught.value.failure.check == OWN_SCHEDULE["host_rows_stale"]
    assert caught.value.failure.step == 2
    assert "slot 18 (block 4, owned by no request of this step" in str(caught.value)


def test_without_the_mark_that_write_is_invisible(monkeypatch):
    def mark_nothing(states, spec, batches):
        return MarkedBlocks([])

    monkeypatch.setattr(lockstep, "mark_idle_blocks", mark_nothing)
    stats = replay(_departed(), factory=toy.factory(["host_rows_stale"]), seed=3)
    assert stats.failures == [] and stats.paths["full"] == 3
