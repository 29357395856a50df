"""Class 8, async staging races: every integer static input is staged through the same small pinned host
buffer with a non_blocking copy, and the next field overwrites the staging buffer before the
previous field's copy has run.

Mirrors input preparation that reuses one pinned staging tensor for several asynchronous
host-to-device copies without an event between them: a queued copy reads its source when it runs,
so fields end up holding another field's values, depending on how far the GPU lags behind.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch
from tests.runners import minimal

BUG_CLASS = 8
EXPECTED_CHECK = "replay_matches_eager"


class StagingBufferReused(minimal.MinimalRunner):
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        words = minimal.SPEC.capture_sizes[-1] * minimal.SPEC.max_blocks_per_req
        self.staging = minimal.get_backend(backend).empty_pinned(words, dtype=torch.int64)
        super().__init__(mode, seed=seed, backend=backend)

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        for name, buffer in self.buffers.items():
            buffer[n:size].fill_(minimal._PADDING[name])
        if not n:
            return
        for name, values in minimal._decode_rows(batch.requests).items():
            buffer = self.buffers[name]
            host = torch.tensor(values, dtype=buffer.dtype)
            if buffer.dtype != torch.int64:  # flags and temperatures: small, copied directly
                buffer[:n].copy_(host)
                continue
            staged = self.staging[: host.numel()].view(host.shape)
            staged.copy_(host)
            buffer[:n].copy_(staged, non_blocking=True)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> StagingBufferReused:
    return StagingBufferReused(mode, seed=seed, backend=backend)
