"""Every conformance case, in a stable order (topic by topic, as the modules declare them)."""

from __future__ import annotations

from tests.conformance import (
    cases_async,
    cases_attention,
    cases_capture,
    cases_compile,
    cases_custom_ops,
    cases_float8,
    cases_frees,
    cases_graph,
    cases_host,
    cases_inference,
    cases_lifetime,
    cases_memory,
    cases_ops,
    cases_pools,
    cases_replay,
    cases_rng,
    cases_streams,
    cases_threads,
)
from tests.conformance.case import CASES, Case

# Importing a case module registers its cases; the tuple keeps the imports meaningful to linters.
MODULES = (
    cases_capture,
    cases_ops,
    cases_replay,
    cases_pools,
    cases_graph,
    cases_rng,
    cases_streams,
    cases_async,
    cases_lifetime,
    cases_frees,
    cases_host,
    cases_threads,
    cases_inference,
    cases_custom_ops,
    cases_compile,
    cases_attention,
    cases_memory,
    cases_float8,
)


def all_cases() -> list[Case]:
    order = [m.__name__.rsplit(".", 1)[-1].removeprefix("cases_") for m in MODULES]
    return sorted(CASES, key=lambda c: order.index(c.topic))


def available_backends() -> list[str]:
    """cuda first: sim's process-wide hooks must not be in place while cuda cases run."""
    import torch

    return ["cuda", "sim"] if torch.cuda.is_available() else ["sim"]
