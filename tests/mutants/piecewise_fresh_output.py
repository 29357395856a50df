"""Class 12, piecewise split: the eager attention runner between two graph pieces returns a freshly
allocated tensor instead of writing into the output buffer the next piece captured.

Mirrors piecewise runners (custom attention or MoE ops left out of the graph) whose eager op
allocates its output: the next piece keeps reading the captured buffer, which holds whatever the
capture left there. The runtime's address contract check reports it at the first replay.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from pytest_graphmode.runtime.captured_steps import CapturedStep, PiecewiseStep
from pytest_graphmode.runtime.executor import GraphExecutor
from pytest_graphmode.runtime.keys import GraphKey
from pytest_graphmode.runtime.model import DecoderInputs
from pytest_graphmode.runtime.piecewise import AttentionRunner
from pytest_graphmode.runtime.target import RuntimeTarget
from tests.mutants._runtime import with_executor

BUG_CLASS = 12
EXPECTED_CHECK = "replay_matches_eager"


class FreshOutputRunner(AttentionRunner):
    def run(self, inputs: DecoderInputs, kv_cache: Tensor) -> Tensor:
        return self.attention(self.layer, self.q, self.k, self.v, inputs, kv_cache)


class FreshOutputExecutor(GraphExecutor):
    def _capture(self, key: GraphKey, padded_reqs: int) -> CapturedStep | None:
        captured = super()._capture(key, padded_reqs)
        if isinstance(captured, PiecewiseStep):
            runners = captured.pieces.runners
            for index, r in enumerate(runners):
                assert isinstance(r, AttentionRunner)  # the runtime's only runner
                runners[index] = FreshOutputRunner(r.layer, r.q, r.k, r.v, r.out, r.attention)
        return captured


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RuntimeTarget:
    return with_executor(FreshOutputExecutor, mode, seed=seed, backend=backend, piecewise=True)
