"""Class 12, piecewise split and order: the piecewise graph replays all its pieces first and runs
the eager attention runners afterwards, instead of alternating them in recorded order.

Mirrors piecewise runners that keep pieces and eager ops in separate lists and launch the graph
pieces back to back (to save launches) without honouring the dependency of each piece on the eager
op before it: every piece after the first reads the previous step's attention output.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from torch import Tensor

from pytest_graphmode.runtime.captured_steps import CapturedStep, PiecewiseStep
from pytest_graphmode.runtime.executor import GraphExecutor
from pytest_graphmode.runtime.keys import GraphKey
from pytest_graphmode.runtime.model import DecoderInputs
from pytest_graphmode.runtime.piecewise import PiecewiseGraph
from pytest_graphmode.runtime.target import RuntimeTarget
from tests.mutants._runtime import with_executor

BUG_CLASS = 12
EXPECTED_CHECK = "replay_matches_eager"


class PiecesFirst(PiecewiseGraph):
    def replay(self, inputs: DecoderInputs, kv_cache: Tensor) -> Tensor:
        for piece in self.pieces:
            piece.replay()
        for runner in self.runners:
            runner.run(inputs, kv_cache)
        return self.hidden


class PiecesFirstExecutor(GraphExecutor):
    def _capture(self, key: GraphKey, padded_reqs: int) -> CapturedStep | None:
        captured = super()._capture(key, padded_reqs)
        if isinstance(captured, PiecewiseStep):
            fields = dataclasses.fields(PiecewiseGraph)
            captured.pieces = PiecesFirst(
                **{f.name: getattr(captured.pieces, f.name) for f in fields}
            )
        return captured


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RuntimeTarget:
    return with_executor(PiecesFirstExecutor, mode, seed=seed, backend=backend, piecewise=True)
