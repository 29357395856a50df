"""Class 8, async staging races: the step's inputs are uploaded on a dedicated copy stream and the
graph is replayed on the compute stream without waiting for that stream.

Mirrors runners that overlap input upload with the previous step's compute by copying on a side
stream and forget `compute_stream.wait_stream(copy_stream)` (or the event wait) before the replay:
the graph reads the previous step's, or poisoned, metadata whenever the copy lags.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch
from tests.runners import minimal

BUG_CLASS = 8
EXPECTED_CHECK = "replay_matches_eager"


class CopyStreamNotAwaited(minimal.MinimalRunner):
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        self.copy_stream = minimal.get_backend(backend).Stream()
        super().__init__(mode, seed=seed, backend=backend)

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = minimal._decode_rows(batch.requests)
        self.copy_stream.wait_stream(self.backend.current_stream())
        with self.backend.stream(self.copy_stream):
            for name, buffer in self.buffers.items():
                padded = rows[name] + [minimal._PADDING[name]] * (size - n)
                host = torch.tensor(padded, dtype=buffer.dtype).view(buffer[:size].shape)
                staged = self.backend.empty_pinned(host.numel(), dtype=buffer.dtype)
                staged.copy_(host.view(-1))
                buffer[:size].copy_(staged.view(host.shape), non_blocking=True)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> CopyStreamNotAwaited:
    return CopyStreamNotAwaited(mode, seed=seed, backend=backend)
