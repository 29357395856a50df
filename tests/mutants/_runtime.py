"""Build the default target around a mutant executor: the target's graph twin gets an instance of
`executor_class` in place of `GraphExecutor`, made with the same arguments."""

from __future__ import annotations

from typing import Literal

from pytest_graphmode.runtime.executor import GraphExecutor
from pytest_graphmode.runtime.target import RuntimeTarget, make_target


def with_executor(
    executor_class: type[GraphExecutor],
    mode: Literal["graph", "eager"],
    *,
    seed: int,
    backend: str,
    piecewise: bool = False,
) -> RuntimeTarget:
    target = make_target(mode, seed=seed, backend=backend, piecewise=piecewise)
    if mode == "eager":
        return target
    correct = target.executor
    spec = target.spec
    target.executor = executor_class(
        target.decoder,
        correct.backend,
        capture_sizes=spec.capture_sizes,
        max_query_len=correct.dispatcher.max_query_len,
        memory="shared",
        piecewise=piecewise,
        max_num_reqs=spec.max_num_reqs,
        max_num_tokens=spec.max_num_tokens,
    )
    correct.close()
    return target
