"""Class 6, unstable addresses: the step runs through a token scratch buffer sized for the largest
graph, which an eager step with more tokens grows in place (`resize_`).

Mirrors attention and sampling backends that allocate their workspace lazily and enlarge it when a
bigger batch arrives (a long prefill on the eager path): growing moves the storage while every
captured graph still uses the old address. The sim backend reports the replay's access to the
reallocated tensor; a GPU reads or writes freed memory.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import Tensor

from tests.runners import minimal

BUG_CLASS = 6
EXPECTED_CHECK = "replay_matches_eager"


class WorkspaceResized(minimal.MinimalRunner):
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        device = minimal.get_backend(backend).device
        self.workspace = torch.zeros(
            minimal.SPEC.capture_sizes[-1], dtype=torch.int64, device=device
        )
        super().__init__(mode, seed=seed, backend=backend)

    def run_model(self, inputs: minimal.StepInputs) -> tuple[Tensor, Tensor]:
        tokens = inputs.tokens.shape[0]
        if tokens > self.workspace.shape[0]:
            self.workspace.resize_(tokens)
        scratch = self.workspace[:tokens]
        scratch.copy_(inputs.tokens)
        return super().run_model(dataclasses.replace(inputs, tokens=scratch))


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> WorkspaceResized:
    return WorkspaceResized(mode, seed=seed, backend=backend)
