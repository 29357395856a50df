"""Class 8, async staging races: the integer inputs live in one packed device buffer that is
uploaded from a pinned staging buffer on a dedicated copy stream, and the graph is replayed on the
compute stream without waiting for that stream.

Mirrors runners that overlap the metadata upload with other host work by copying on a side stream
and forget `compute_stream.wait_stream(copy_stream)` (or the event wait) before the replay: the
graph reads the previous step's, or any other, metadata whenever the copy lags behind.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch
from tests.runners import minimal
from tests.runners.overlapped import PACKED, unpack

BUG_CLASS = 8
EXPECTED_CHECK = "no_stream_races"
# The graph reads stale metadata whenever the scheduler runs the copy after the replay.
ALSO_SEEN_BY = ("replay_matches_eager",)


class CopyStreamNotAwaited(minimal.MinimalRunner):
    def allocate_buffers(self, rows: int) -> dict[str, torch.Tensor]:
        buffers = super().allocate_buffers(rows)
        self.shapes = {name: buffers[name].shape for name in PACKED}
        words = sum(shape.numel() for shape in self.shapes.values())
        self.packed = torch.zeros(words, dtype=torch.int64, device=self.backend.device)
        self.staging = self.backend.empty_pinned(words, dtype=torch.int64)
        self.copy_stream = self.backend.Stream()
        return {**buffers, **unpack(self.packed, self.shapes)}

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = minimal._decode_rows(batch.requests)
        host = torch.zeros_like(self.staging)
        for name, field in unpack(host, self.shapes).items():
            if n:
                field[:n] = torch.tensor(rows[name], dtype=field.dtype)
            field[n:size] = minimal._PADDING[name]
        for name in ("temperatures", "sampled"):  # small, written directly
            buffer = self.buffers[name]
            if n:
                buffer[:n].copy_(torch.tensor(rows[name], dtype=buffer.dtype))
            buffer[n:size].fill_(minimal._PADDING[name])
        self.staging.copy_(host)
        self.copy_stream.wait_stream(self.backend.current_stream())
        with self.backend.stream(self.copy_stream):
            self.packed.copy_(self.staging, non_blocking=True)


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CopyStreamNotAwaited:
    return CopyStreamNotAwaited(mode, seed=seed, backend=backend)
