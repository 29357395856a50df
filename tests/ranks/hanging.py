"""A target whose rank 1 blocks in step 2 before it reaches the coordination collective, so the
other ranks wait in that collective for ever. A real cause would be a rank stuck in host work of
its own, or one that skipped the synchronisation; the harness must name the rank and the step."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Literal

from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, GraphTarget, StepResult
from pytest_graphmode.runtime.data_parallel import current
from pytest_graphmode.runtime.target import make_target as make_runtime_target

HANGING_RANK = 1
HANGING_STEP = 2


class HangingTarget:
    """The default target, except that its `HANGING_STEP`-th step on `HANGING_RANK` never ends."""

    def __init__(self, inner: GraphTarget, rank: int | None) -> None:
        self.inner, self.rank, self.spec = inner, rank, inner.spec
        self.steps = 0

    def step(self, batch: Batch) -> StepResult:
        if self.rank == HANGING_RANK and self.steps == HANGING_STEP:
            threading.Event().wait()  # never set
        self.steps += 1
        return self.inner.step(batch)

    def state(self) -> Mapping[str, Tensor]:
        return self.inner.state()

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.inner.static_buffers()

    def address_views(self) -> Sequence[AddressView]:
        return self.inner.address_views()

    def update_weights(self, seed: int) -> None:
        self.inner.update_weights(seed)

    def close(self) -> None:
        self.inner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HangingTarget:
    member = current()
    inner = make_runtime_target(mode, seed=seed, backend=backend)
    return HangingTarget(inner, None if member is None else member.rank)
