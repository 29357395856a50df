"""After a step whose checks passed, the graph-mode twins start the next step from the eager
twin's floating state, so rounding that differs between the paths does not add up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.fuzz import run_campaign
from pytest_graphmode.fuzz.aligned_states import align_states
from pytest_graphmode.fuzz.lockstep import Lockstep
from pytest_graphmode.strategies.plans import Arrival, StepPlan
from pytest_graphmode.strategies.scheduler import compile_schedule
from tests.fuzz import toy

SPEC = toy.SPEC
NULL = slice(SPEC.null_block * SPEC.block_size, (SPEC.null_block + 1) * SPEC.block_size)
OTHERS = torch.ones(SPEC.num_slots, dtype=torch.bool)
OTHERS[NULL] = False  # every slot but the null block's


class RoundsKeysOtherwise(toy.ToyTarget):
    """A correct toy whose graph mode stores each key 2e-5 larger than its eager mode, as another
    kernel rounds: within float32's tolerance of 1e-4 of a slot's scale."""

    def _forward(self, token_ids: torch.Tensor, *args: Any, rows: int) -> Any:
        if self.mode == "graph":
            token_ids = token_ids.clone()
            self.emb.mul_(1 + 2e-5)
            try:
                return super()._forward(token_ids, *args, rows=rows)
            finally:
                self.emb.div_(1 + 2e-5)
        return super()._forward(token_ids, *args, rows=rows)


def rounds_keys_otherwise(mode: str, *, seed: int, backend: str) -> RoundsKeysOtherwise:
    return RoundsKeysOtherwise(mode, seed=seed, backend=backend)


class Holds:
    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self._state = state

    def state(self) -> Mapping[str, torch.Tensor]:
        return self._state


def test_the_twins_take_the_eager_twins_floating_state_but_the_null_block() -> None:
    eager = Holds({"kv": torch.rand(SPEC.num_slots, 2), "ids": torch.arange(SPEC.num_slots)})
    graph = Holds({"kv": torch.zeros(SPEC.num_slots, 2), "ids": torch.zeros(SPEC.num_slots)})
    graph.state()["ids"].zero_()
    align_states(eager, [graph], SPEC)  # type: ignore[arg-type]
    kept, taken = graph.state()["kv"], eager.state()["kv"]
    assert torch.equal(kept[OTHERS], taken[OTHERS])
    assert not bool(kept[NULL].any())  # the null block: each twin's own
    assert not bool(graph.state()["ids"].any())  # integers matched exactly already


def test_state_made_in_inference_mode_is_aligned_too() -> None:
    with torch.inference_mode():
        eager = Holds({"kv": torch.rand(SPEC.num_slots, 2)})
        graph = Holds({"kv": torch.zeros(SPEC.num_slots, 2)})
    align_states(eager, [graph], SPEC)  # type: ignore[arg-type]
    assert torch.equal(graph.state()["kv"][OTHERS], eager.state()["kv"][OTHERS])


def test_after_each_passed_step_the_graph_and_clean_twins_hold_the_eager_twins_keys() -> None:
    plans = [StepPlan(kind="decode", rows=n, arrivals=(Arrival(3),) * n) for n in (2, 2, 3)]
    events = compile_schedule(SPEC, plans, seed=0)
    lockstep = Lockstep(rounds_keys_otherwise, backend="sim", seed=1, stats=CampaignStats())
    try:
        lockstep.run(events)
        eager = lockstep.eager.state()["kv"]
        assert bool(eager[OTHERS].any()), "the steps wrote no keys: nothing was aligned"
        for twin in (lockstep.graph, lockstep.clean):
            assert torch.equal(twin.state()["kv"][OTHERS], eager[OTHERS])
    finally:
        lockstep.close()


def test_a_runner_that_rounds_otherwise_passes() -> None:
    stats = run_campaign(rounds_keys_otherwise, max_examples=6, max_steps=8, seed=2)
    assert stats.failures == []
    assert stats.paths["full"] > 0
