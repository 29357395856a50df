"""Class 6, unstable addresses: `update_weights` builds new weight tensors and rebinds them instead
of copying the new values into the tensors the graphs captured.

Mirrors weight reloads (RL weight sync, LoRA merges, quantisation repacking) that replace parameter
tensors without re-capturing: the graphs keep reading the old addresses. On a GPU they read freed,
possibly reused memory; the sim backend reports the read of the freed tensor.
"""

from __future__ import annotations

from typing import Literal

from tests.runners import minimal

BUG_CLASS = 6
EXPECTED_CHECK = "replay_matches_eager"


class WeightsRebound(minimal.MinimalRunner):
    def update_weights(self, seed: int) -> None:
        fresh = minimal.TinyDecoder(seed, self.backend.device)
        self.model.weights = fresh.weights


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> WeightsRebound:
    return WeightsRebound(mode, seed=seed, backend=backend)
