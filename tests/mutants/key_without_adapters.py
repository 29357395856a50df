"""Class 5, incomplete graph key: the runtime's graph key drops the adapter flag, so a batch that
uses adapters replays a graph captured without the adapter ops (or the reverse).

Mirrors graph keys that leave out whether LoRA is active: the low-rank deltas are recorded into the
graph only when the capture batch used an adapter, so requests on an adapter silently get base-model
logits from a graph captured for base-model batches of the same size.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pytest_graphmode.contract import Batch
from pytest_graphmode.runtime.dispatch import Decision
from pytest_graphmode.runtime.executor import GraphExecutor
from pytest_graphmode.runtime.target import RuntimeTarget
from tests.mutants._runtime import with_executor

BUG_CLASS = 5
EXPECTED_CHECK = "replay_matches_eager"


class AdapterBlindExecutor(GraphExecutor):
    def _route(self, batch: Batch) -> Decision:
        decision = super()._route(batch)
        if decision.key is None:
            return decision
        return dataclasses.replace(decision, key=dataclasses.replace(decision.key, adapters=False))


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RuntimeTarget:
    return with_executor(AdapterBlindExecutor, mode, seed=seed, backend=backend)
