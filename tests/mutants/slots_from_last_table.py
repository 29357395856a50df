"""Class 3, stale static-buffer contents: the slot a token writes is looked up in the block table
as the runner held it after the request's previous step, so a token that starts a block the
scheduler added for this step writes the null block; attention reads the new table.

Mirrors runners that compute the slot mapping from a persistent block table before this step's
new blocks are appended to it (or from a device copy of the table that the append has not reached
yet). The eager and graph paths share that metadata, so the twins agree with each other: they all
read the fresh block back through the new table, holding whatever it held before. Only an oracle
that knows where each token's keys and values belong sees it (`kv_writes_land`); a comparison of
twins sees it only where one twin's block held other contents than another's.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch, Request, StepResult
from tests.runners import minimal

BUG_CLASS = 3
EXPECTED_CHECK = "kv_writes_land"


class SlotsFromLastTable(minimal.MinimalRunner):
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        super().__init__(mode, seed=seed, backend=backend)
        self.tables: dict[int, tuple[int, ...]] = {}  # req_id -> its blocks as of its last step

    def _slot(self, request: Request, position: int) -> int:
        """The slot through the table as it stood before this step: a block added since reads
        as the null block, the table's filler."""
        held = self.tables.get(request.req_id, ()) if request.context_len else request.block_ids
        index = position // minimal.SPEC.block_size
        block = held[index] if index < len(held) else minimal.SPEC.null_block
        return block * minimal.SPEC.block_size + position % minimal.SPEC.block_size

    def _slots(self, batch: Batch) -> list[int]:
        return [
            self._slot(request, request.context_len + i)
            for request in batch.requests
            for i in range(len(request.tokens))
        ]

    def prepare(self, batch: Batch, size: int) -> None:
        super().prepare(batch, size)
        if batch.num_reqs:
            self.buffers["slots"][: batch.num_reqs].copy_(torch.tensor(self._slots(batch)))

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        inputs = minimal._eager_inputs(batch, self.backend.device)
        inputs.slots = torch.tensor(self._slots(batch), device=self.backend.device)
        logits, tokens = self.run_model(inputs)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        result = super().step(batch)
        self.tables.update((r.req_id, r.block_ids) for r in batch.requests)
        return result


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SlotsFromLastTable:
    return SlotsFromLastTable(mode, seed=seed, backend=backend)
