"""Class 1, padding rows not inert, in a plain torch.cuda runner: the staging buffer gets the
batch's rows but not the padding rows, so the upload carries whatever an earlier, larger batch left
in them.

Mirrors runners that fill a pinned staging buffer with only the live requests' slot mapping and
block tables and upload the whole padded prefix: stale padding rows write KV slots that live
requests own. The runner is `tests/runners/plain_cuda.py` (it imports nothing from this package);
the sim sees it through the drop-in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from tests.runners.plain_cuda import PlainDecodeRunner, Row
from tests.runners.plain_target import PlainTarget

BUG_CLASS = 1
EXPECTED_CHECK = "kv_writes_confined"
# Or, when the stale rows land in blocks this step reads, the logits differ first.
ALSO_SEEN_BY = ("replay_matches_eager",)


class PaddingStale(PlainDecodeRunner):
    def _stage(self, rows: Sequence[Row], size: int) -> None:
        if not rows:  # capture: every row is padding
            super()._stage(rows, size)
            return
        for i, row in enumerate(rows):
            self.staging[i] = torch.tensor(self._values(row), dtype=torch.int64)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PlainTarget:
    return PlainTarget(mode, seed=seed, runner=PaddingStale)
