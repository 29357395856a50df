"""Class 3, stale static-buffer contents: the block tables are uploaded only when the batch's
requests or their block counts changed since the previous replay.

Mirrors runners that skip re-copying metadata they believe unchanged between decode steps (an
optimisation for large block tables): anything else that wrote the persistent buffer in between
(another bucket's replay, an eager step, a preemption that reused a block id) leaves the graph
reading stale block ids.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch
from tests.runners import minimal

BUG_CLASS = 3
EXPECTED_CHECK = "replay_matches_eager"


class TablesUploadSkipped(minimal.MinimalRunner):
    uploaded: tuple[object, ...] = ()

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        layout = (size, tuple((r.req_id, len(r.block_ids)) for r in batch.requests))
        unchanged = layout == self.uploaded
        self.uploaded = layout
        for name, values in minimal._decode_rows(batch.requests).items():
            if name == "tables" and unchanged:
                continue
            buffer = self.buffers[name]
            if n:
                buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype))
            buffer[n:size].fill_(minimal._PADDING[name])


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> TablesUploadSkipped:
    return TablesUploadSkipped(mode, seed=seed, backend=backend)
