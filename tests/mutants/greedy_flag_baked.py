"""Class 4, host values frozen at capture: an "all greedy" fast path chosen by a host-side flag
computed from the batch skips the sampler.

Mirrors samplers whose metadata carries host booleans (all_greedy / all_random) and whose Python
branch on them runs once, at capture, where the warm-up batch is all padding and hence greedy:
every replay of the graph takes the greedy branch, also for sampled requests.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from pytest_graphmode.contract import Batch, StepResult
from tests.runners import minimal

BUG_CLASS = 4
EXPECTED_CHECK = "replay_matches_eager"


class GreedyFlagBaked(minimal.MinimalRunner):
    any_sampled = False

    def step(self, batch: Batch) -> StepResult:
        self.any_sampled = any(r.seed is not None for r in batch.requests)
        return super().step(batch)

    def run_model(self, inputs: minimal.StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv)
        if not self.any_sampled:
            return logits, logits.argmax(-1)
        return logits, minimal.sample(logits, inputs)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> GreedyFlagBaked:
    return GreedyFlagBaked(mode, seed=seed, backend=backend)
