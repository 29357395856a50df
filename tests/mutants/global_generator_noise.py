"""Class 2, randomness under replay: the sampler draws its Gumbel noise from the process-wide
random generator, ignoring the request's seed.

Mirrors samplers that call the framework's stateful RNG (exponential_, multinomial) inside the
captured step: each replay advances the generator's offset, so a seeded request's tokens depend on
how many steps, replays and other requests came before it, not on its seed and position.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from tests.runners import minimal

BUG_CLASS = 2
EXPECTED_CHECK = "replay_matches_eager"
# The poisoned and the clean graph twin draw different noise for the same logits too, and a
# request samples differently beside other requests than alone (its seed is ignored).
ALSO_SEEN_BY = ("padding_inert", "sampling_independent")


class GlobalGeneratorNoise(minimal.MinimalRunner):
    def run_model(self, inputs: minimal.StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv)
        uniform = torch.rand(logits.shape, device=logits.device).clamp(1e-7, 1 - 1e-7)
        noisy = logits / inputs.temperatures[:, None] - torch.log(-torch.log(uniform))
        return logits, torch.where(inputs.sampled, noisy.argmax(-1), logits.argmax(-1))


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> GlobalGeneratorNoise:
    return GlobalGeneratorNoise(mode, seed=seed, backend=backend)
