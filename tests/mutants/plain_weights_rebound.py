"""Class 6, weights rebound after capture, in a plain torch.cuda runner: a weight update binds
fresh tensors to the runner's weight names instead of copying into the captured ones.

Mirrors weight reloading (RL weight sync, LoRA merges) that assigns new parameters: eager steps use
the new weights, replays keep reading the old ones. The runner is `tests/runners/plain_cuda.py`
(it imports nothing from this package); the sim sees it through the drop-in.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from tests.runners.plain_cuda import PlainDecodeRunner
from tests.runners.plain_target import PlainTarget

BUG_CLASS = 6
EXPECTED_CHECK = "replay_matches_eager"


class WeightsRebound(PlainDecodeRunner):
    def load_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            shape = self.weights[name].shape
            fresh = torch.randn(shape, generator=generator) / math.sqrt(shape[0])
            self.weights[name] = fresh.to(self.device)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PlainTarget:
    return PlainTarget(mode, seed=seed, runner=WeightsRebound)
