"""Class 6, unstable addresses: the logits are computed into a workspace sized for the largest
graph, and an eager batch with more requests grows the workspace in place (`resize_`).

Mirrors attention and sampling backends that allocate their workspace lazily and enlarge it when a
bigger batch arrives: growing moves the storage, while every captured graph still writes the old
address. The sim backend reports the replay's access to the reallocated tensor.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import Batch, StepResult
from tests.runners import minimal

BUG_CLASS = 6
EXPECTED_CHECK = "replay_matches_eager"


class WorkspaceResized(minimal.MinimalRunner):
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        rows = minimal.SPEC.capture_sizes[-1]
        self.workspace = torch.zeros(rows, minimal.SPEC.vocab_size, device=minimal.get_backend(backend).device)
        super().__init__(mode, seed=seed, backend=backend)

    def run_model(self, inputs: minimal.StepInputs) -> tuple[Tensor, Tensor]:
        rows = inputs.seeds.shape[0]
        if rows > self.workspace.shape[0]:
            self.workspace.resize_(rows, minimal.SPEC.vocab_size)
        logits = self.workspace[:rows]
        logits.copy_(self.model.forward(inputs, self.kv))
        return logits, minimal.sample(logits, inputs)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        result = super().run_eager(batch, reason)
        result.logits = result.logits.clone()  # the workspace is reused by the next step
        return result


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> WorkspaceResized:
    return WorkspaceResized(mode, seed=seed, backend=backend)
