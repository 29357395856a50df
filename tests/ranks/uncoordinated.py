"""Class 11, cross-rank consistency: every rank dispatches its own batch alone, with no
coordination step, and an idle rank returns at once without running anything.

Mirrors vLLM #25906, where ranks picked their graphs from local token counts instead of the
data-parallel synced ones and the collectives in the model hung.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pytest_graphmode.contract import Batch
from pytest_graphmode.runtime.data_parallel import DATA_PARALLEL, Coordinator
from pytest_graphmode.runtime.dispatch import CAPTURE_FAILED, Decision
from pytest_graphmode.runtime.keys import GraphKey
from pytest_graphmode.runtime.target import RuntimeTarget
from tests.ranks._coordinated import with_coordinator

BUG_CLASS = 11
EXPECTED_CHECK = "ranks_agree"


class LocalCoordinator(Coordinator):
    def decide(self, batch: Batch, failed: Sequence[GraphKey], known_keys: int) -> Decision:
        return self.again(batch, failed)

    def again(self, batch: Batch, failed: Sequence[GraphKey]) -> Decision:
        if not batch.requests:
            return Decision("eager", None, "idle rank: nothing to run", 0, 0, DATA_PARALLEL)
        decision = self.dispatcher.decide(batch)
        if decision.key in failed:
            return Decision(
                "eager", None, "capture failed", batch.num_reqs, batch.num_tokens, CAPTURE_FAILED
            )
        return decision

    def failed_ranks(self, captured: bool) -> list[int]:
        return [] if captured else [self.member.rank]


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RuntimeTarget:
    return with_coordinator(LocalCoordinator, mode, seed=seed, backend=backend)
