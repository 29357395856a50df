"""Class 11, cross-rank consistency: the coordination step pads every rank to the SUM of the
ranks' request and token counts instead of their maximum.

Mirrors SGLang #5527, where graphs were captured per rank but chosen by the data-parallel sum, so
they were silently never used; here the summed shape also outgrows the static input buffers, and
the graph twin rejects batches the runner accepts alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from pytest_graphmode.contract import Batch
from pytest_graphmode.runtime.buckets import BucketTable
from pytest_graphmode.runtime.data_parallel import PATH_RANK, Contribution, Coordinator
from pytest_graphmode.runtime.dispatch import Decision
from pytest_graphmode.runtime.keys import GraphKey
from pytest_graphmode.runtime.target import RuntimeTarget
from tests.ranks._coordinated import with_coordinator

BUG_CLASS = 11
EXPECTED_CHECK = "replay_matches_eager"


class SumCoordinator(Coordinator):
    _rows: list[Contribution]  # swapped for the summed rows while the agreement is computed

    def again(self, batch: Batch, failed: Sequence[GraphKey]) -> Decision:
        gathered = self._rows
        self._rows = [self._summed(row, gathered) for row in gathered]
        try:
            return super().again(batch, failed)
        finally:
            self._rows = gathered

    def _summed(self, row: Contribution, rows: Sequence[Contribution]) -> Contribution:
        if not row.working:
            return row
        reqs = sum(r.num_reqs for r in rows)
        tokens = sum(r.num_tokens for r in rows)
        best, padded = row.best, row.padded_reqs
        if best == PATH_RANK["full"]:
            sizes = self.dispatcher.capture_sizes
            bucket = BucketTable(sizes).padded(reqs)
            if bucket is None or bucket * row.query_len > sizes[-1]:
                best = PATH_RANK["piecewise"]
            else:
                padded = bucket
        return dataclasses.replace(
            row, num_reqs=reqs, num_tokens=tokens, best=best, padded_reqs=padded
        )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RuntimeTarget:
    return with_coordinator(SumCoordinator, mode, seed=seed, backend=backend)
