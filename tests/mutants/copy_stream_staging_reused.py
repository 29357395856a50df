"""Class 8, async staging races: the integer static inputs are uploaded on a dedicated copy
stream, each field staged in turn through one pinned host buffer; the compute stream waits for
the uploads correctly, but the host rewrites the staging buffer for the next field while the
previous field's copy may still be queued on the copy stream.

Mirrors input preparation that moves the host-to-device copies off the compute stream and orders
the device side with an event, but forgets that the host must wait for a copy (its event's
`synchronize()`) before it reuses the copy's pinned source: a delay on the compute stream never
shows it, since the copy stream is the one that lags.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch
from tests.runners import minimal

BUG_CLASS = 8
EXPECTED_CHECK = "no_stream_races"
# A field holds another field's values whenever the scheduler runs its copy late.
ALSO_SEEN_BY = ("replay_matches_eager",)


class CopyStreamStagingReused(minimal.MinimalRunner):
    def allocate_buffers(self, rows: int) -> dict[str, torch.Tensor]:
        words = rows * minimal.SPEC.max_blocks_per_req
        self.staging = self.backend.empty_pinned(words, dtype=torch.int64)
        self.copy_stream = self.backend.Stream()
        self.uploaded = self.backend.Event()
        return super().allocate_buffers(rows)

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = minimal._decode_rows(batch.requests)
        # The copies overwrite buffers the compute stream used: they start after its work.
        self.copy_stream.wait_stream(self.backend.current_stream())
        for name, buffer in self.buffers.items():
            padded = torch.full(
                (size, *buffer.shape[1:]), minimal._PADDING[name], dtype=buffer.dtype
            )
            if n:
                padded[:n] = torch.tensor(rows[name], dtype=buffer.dtype)
            if buffer.dtype != torch.int64:  # flags and temperatures: small, copied directly
                buffer[:size].copy_(padded)
                continue
            source = self.staging[: padded.numel()].view(padded.shape)
            source.copy_(padded)  # the previous field's copy out of `staging` may be queued
            with self.backend.stream(self.copy_stream):
                buffer[:size].copy_(source, non_blocking=True)
        self.uploaded.record(self.copy_stream)
        self.backend.current_stream().wait_event(self.uploaded)


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CopyStreamStagingReused:
    return CopyStreamStagingReused(mode, seed=seed, backend=backend)
