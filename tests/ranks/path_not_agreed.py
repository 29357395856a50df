"""Class 11, cross-rank consistency: the coordination step agrees on the padded size, but a rank
whose own best path differs from the agreed one takes its own path (and its own graph).

Mirrors vllm-ascend #13827, where an early return skipped the mode synchronisation: one rank
replayed a graph while another ran eagerly, and their collectives mixed graph and eager work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pytest_graphmode.contract import Batch
from pytest_graphmode.runtime.data_parallel import Coordinator
from pytest_graphmode.runtime.dispatch import Decision
from pytest_graphmode.runtime.keys import GraphKey
from pytest_graphmode.runtime.target import RuntimeTarget
from tests.ranks._coordinated import with_coordinator

BUG_CLASS = 11
EXPECTED_CHECK = "ranks_agree"
ALSO_SEEN_BY = ("ranks_arrive",)  # a rank off the agreed graph may capture alone and wait there


class SizeOnlyCoordinator(Coordinator):
    def again(self, batch: Batch, failed: Sequence[GraphKey]) -> Decision:
        agreed = super().again(batch, failed)
        if not batch.requests:
            return agreed
        own = self.dispatcher.decide(batch)
        if own.path == agreed.path or own.key in failed:
            return agreed
        return own


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RuntimeTarget:
    return with_coordinator(SizeOnlyCoordinator, mode, seed=seed, backend=backend)
