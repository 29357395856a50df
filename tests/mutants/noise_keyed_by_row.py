"""Class 2, randomness under replay: the Gumbel noise is hashed from the request's row in the batch
instead of its position in its sequence.

Mirrors samplers that draw one random stream per batch and give row i the i-th slice of it (or key
per-row offsets by the row index): a seeded request's tokens then depend on which other requests
share its batch and in what order, although its own logits are the same.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import Tensor

from tests.runners import minimal

BUG_CLASS = 2
EXPECTED_CHECK = "sampling_independent"


class NoiseKeyedByRow(minimal.MinimalRunner):
    def run_model(self, inputs: minimal.StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv)
        rows = torch.arange(logits.shape[0], device=logits.device)
        return logits, minimal.sample(
            logits, dataclasses.replace(inputs, positions=rows, last=None)
        )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> NoiseKeyedByRow:
    return NoiseKeyedByRow(mode, seed=seed, backend=backend)
