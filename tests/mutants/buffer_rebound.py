"""Class 3, stale static-buffer contents: `prepare` builds this step's positions as a new tensor and
rebinds the buffer's name to it, so the graph keeps reading the tensor it captured.

Mirrors `self.positions = torch.tensor(...)` where `self.positions[:n].copy_(...)` was meant: the
Python name moves, the captured address does not. On a GPU the graph silently reads whatever that
memory holds next; the sim backend reports the read of the freed tensor.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch
from tests.runners import minimal

BUG_CLASS = 3
EXPECTED_CHECK = "replay_matches_eager"


class BufferRebound(minimal.MinimalRunner):
    def prepare(self, batch: Batch, size: int) -> None:
        super().prepare(batch, size)
        positions = [r.context_len for r in batch.requests]
        rows = len(self.buffers["positions"])
        padded = positions + [minimal._PADDING["positions"]] * (rows - len(positions))
        device = self.backend.device
        self.buffers["positions"] = torch.tensor(padded, dtype=torch.int64, device=device)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> BufferRebound:
    return BufferRebound(mode, seed=seed, backend=backend)
