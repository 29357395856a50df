"""Class 7, outputs overwritten by the next replay: `replay` returns the first rows of the graph's
static outputs without copying them.

Mirrors the textbook mistake of returning `static_output[:n]` from a graph runner: the caller's
result is a view of memory the next replay of the same graph overwrites, so logits kept for later
(speculative verification, logprobs, asynchronous post-processing) change under the caller.
"""

from __future__ import annotations

from typing import Literal

from pytest_graphmode.contract import Batch, StepResult
from tests.runners import minimal

BUG_CLASS = 7
EXPECTED_CHECK = "results_stay_valid"


class OutputView(minimal.MinimalRunner):
    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in minimal.SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n], tokens[:n], "full", ("decode", size))


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OutputView:
    return OutputView(mode, seed=seed, backend=backend)
