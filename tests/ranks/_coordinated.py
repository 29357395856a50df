"""Build the default target around a mutant coordinator: the target's graph twin (made inside a
data-parallel group) coordinates through an instance of `coordinator_class` in place of the
runtime's `Coordinator`, made with the same membership and dispatcher."""

from __future__ import annotations

from typing import Literal

from pytest_graphmode.runtime.data_parallel import Coordinator
from pytest_graphmode.runtime.target import RuntimeTarget, make_target


def with_coordinator(
    coordinator_class: type[Coordinator],
    mode: Literal["graph", "eager"],
    *,
    seed: int,
    backend: str,
) -> RuntimeTarget:
    target = make_target(mode, seed=seed, backend=backend)
    correct = target.executor.coordinator
    if correct is not None:
        target.executor.coordinator = coordinator_class(correct.member, correct.dispatcher)
    return target
