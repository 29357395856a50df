"""Class 7, outputs overwritten: the sampled tokens are handed back in a persistent host buffer
that every step reuses, in graph and eager mode alike.

Mirrors engines that copy next tokens into one preallocated (pinned) host tensor per runner to save
an allocation per step and return a slice of it: a result kept past the next step (by an
asynchronous scheduler, a detokenizer, a speculative verifier) silently changes.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch, StepResult
from tests.runners import minimal

BUG_CLASS = 7
EXPECTED_CHECK = "results_stay_valid"


class ResultBufferReused(minimal.MinimalRunner):
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        super().__init__(mode, seed=seed, backend=backend)
        self.host_tokens = self.backend.empty_pinned(minimal.SPEC.max_num_reqs, dtype=torch.int64)

    def step(self, batch: Batch) -> StepResult:
        result = super().step(batch)
        tokens = self.host_tokens[: batch.num_reqs]
        tokens.copy_(result.next_tokens)
        result.next_tokens = tokens
        return result


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ResultBufferReused:
    return ResultBufferReused(mode, seed=seed, backend=backend)
