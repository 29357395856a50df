"""Class 7, outputs overwritten by the next replay, in a plain torch.cuda runner: `decode`
returns the first rows of the graph's static outputs without copying them.

Mirrors graph runners that hand out `static_logits[:n]`: the caller's result is a view of memory
the next replay overwrites. The runner is `tests/runners/plain_cuda.py` (it imports nothing from
this package); the sim sees it through the drop-in.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from tests.runners.plain_cuda import PlainDecodeRunner
from tests.runners.plain_target import PlainTarget

BUG_CLASS = 7
EXPECTED_CHECK = "results_stay_valid"


class OutputView(PlainDecodeRunner):
    def _results(self, size: int, rows: int) -> tuple[Tensor, Tensor]:
        logits, tokens = self.outputs[size]
        return logits[:rows], tokens[:rows]


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PlainTarget:
    return PlainTarget(mode, seed=seed, runner=OutputView)
