"""Class 10, capture coverage: sampling is issued after the `with graph(...)` block, so it runs once
at capture time and is not part of the graph, while the replay path returns the static tokens as if
the graph produced them.

Mirrors steps whose tail (sampling, a logits processor, a KV-cache store issued from a callback)
ends up outside the captured region: the work happens once, on the capture batch, and every replay
returns the same stale result.
"""

from __future__ import annotations

from typing import Literal

from pytest_graphmode.contract import Batch
from tests.runners import minimal

BUG_CLASS = 10
EXPECTED_CHECK = "replay_matches_eager"


class SamplingOutsideCapture(minimal.MinimalRunner):
    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(minimal.SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inputs = self.static_inputs(size)
            self.run_model(inputs)  # warm-up outside the graph
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                logits = self.model.forward(inputs, self.kv)
            self.outputs[size] = (logits, minimal.sample(logits, inputs))
            self.graphs[size] = graph


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SamplingOutsideCapture:
    return SamplingOutsideCapture(mode, seed=seed, backend=backend)
