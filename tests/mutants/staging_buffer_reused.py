"""Class 8, async staging races: the static inputs (their valid and padding rows) are staged one
after another through the same pinned host buffer, each followed by a non_blocking copy, and the
next field overwrites the staging buffer before the previous field's copy has run.

Mirrors input preparation that fills a pinned CPU buffer through its numpy view and issues the
host-to-device copy asynchronously, then reuses the buffer without waiting on an event: a queued
copy reads its source when it runs, so a field ends up holding another field's values whenever the
device lags behind the host.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch
from tests.runners import minimal

BUG_CLASS = 8
EXPECTED_CHECK = "no_stream_races"
# A wrong field value shows whenever the scheduler runs a copy after the next field was staged.
ALSO_SEEN_BY = ("replay_matches_eager",)


class StagingBufferReused(minimal.MinimalRunner):
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        words = minimal.SPEC.capture_sizes[-1] * minimal.SPEC.max_blocks_per_req
        self.staging = minimal.get_backend(backend).empty_pinned(words, dtype=torch.int64)
        self.staging_np = self.staging.numpy()  # host writes, as a numpy view of pinned memory
        super().__init__(mode, seed=seed, backend=backend)

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = minimal._decode_rows(batch.requests)
        for name, buffer in self.buffers.items():
            fill = minimal._PADDING[name]
            padded = torch.full((size, *buffer.shape[1:]), fill, dtype=buffer.dtype)
            if n:
                padded[:n] = torch.tensor(rows[name], dtype=buffer.dtype)
            array = padded.view(-1).numpy()
            # The staging bytes as this field's dtype; the previous field's copy may not have run.
            self.staging_np.view(array.dtype)[: array.size] = array
            source = self.staging.view(buffer.dtype)[: array.size].view(padded.shape)
            buffer[:size].copy_(source, non_blocking=True)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> StagingBufferReused:
    return StagingBufferReused(mode, seed=seed, backend=backend)
