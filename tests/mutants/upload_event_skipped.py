"""Class 8, async staging races: a runner that overlaps its steps rewrites its pinned staging
buffer for the next step without waiting on the event recorded after the previous upload.

Mirrors engines with asynchronous scheduling whose input preparation for step N+1 runs while step
N is still queued on the device, and that rely on something else (a result read, a synchronizing
call) having waited in between: a copy still queued reads its source when it runs, so step N is
computed from step N+1's inputs. A driver that reads every result before it sends the next step
never sees it; a pipelined pair does. The correct runner is `tests/runners/overlapped.py`.
"""

from __future__ import annotations

from typing import Literal

from pytest_graphmode.contract import Batch
from tests.runners import overlapped

BUG_CLASS = 8
EXPECTED_CHECK = "no_stream_races"
# Where the race checker does not run (cuda), the step computed from the next step's inputs.
ALSO_SEEN_BY = ("replay_matches_eager",)


class UploadEventSkipped(overlapped.OverlappedRunner):
    def stage(self, batch: Batch, size: int) -> None:
        self.write_staging(batch, size)  # no `self.uploaded.synchronize()` first


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> UploadEventSkipped:
    return UploadEventSkipped(mode, seed=seed, backend=backend)
