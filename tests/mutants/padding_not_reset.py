"""Class 1, padding rows not inert: `prepare` writes the batch into the static buffers' prefix but
leaves the padding rows as they were.

Mirrors graph runners that copy only the valid rows' slot mapping and block tables into the
persistent buffers and rely on the padding rows still holding harmless values from capture. After a
larger batch (or anything else) wrote those rows, padding rows carry stale slot ids and write into
KV blocks that live requests own.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch
from tests.runners import minimal

BUG_CLASS = 1
EXPECTED_CHECK = "replay_matches_eager"


class PaddingNotReset(minimal.MinimalRunner):
    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        if not n:
            return
        for name, values in minimal._decode_rows(batch.requests).items():
            buffer = self.buffers[name]
            buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype))


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PaddingNotReset:
    return PaddingNotReset(mode, seed=seed, backend=backend)
