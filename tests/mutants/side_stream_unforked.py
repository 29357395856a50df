"""Class 10, capture coverage: sampling runs on a side stream that the capture never forked onto
(no wait on the capturing stream), so it is not part of the graph.

Mirrors multi-stream steps (sampling, logprobs or a KV transfer on its own stream) whose side stream
does not wait on an event recorded in the capturing stream: its work runs once, at capture time,
and no replay repeats it, so every replay returns the tokens sampled from the capture batch.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from tests.runners import minimal

BUG_CLASS = 10
EXPECTED_CHECK = "replay_matches_eager"


class SideStreamUnforked(minimal.MinimalRunner):
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        self.side = minimal.get_backend(backend).Stream()
        super().__init__(mode, seed=seed, backend=backend)

    def run_model(self, inputs: minimal.StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv)
        with self.backend.stream(self.side):
            tokens = minimal.sample(logits, inputs)
        self.backend.current_stream().wait_stream(self.side)
        return logits, tokens


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SideStreamUnforked:
    return SideStreamUnforked(mode, seed=seed, backend=backend)
