"""Backends: the subset of torch.cuda a graph runner uses, on a GPU (`cuda`) or the CPU (`sim`).

A runner written against a backend runs unchanged on both. `get("auto")` picks cuda when a GPU is
present. The surface (names and semantics as in torch.cuda): `Graph`, `graph(g, pool=, stream=)`,
`graph_pool_handle()`, `Stream`, `Event`, `stream(s)`, `current_stream()`, `default_stream()`,
`synchronize()`, `empty_pinned(size, dtype=)`, `device`, `name`, `CaptureError`,
`UseAfterFreeError`, `set_scheduler_seed(seed)` (orders independent streams on sim; no-op on cuda),
`take_races()` (the stream races found, as `Race`s: sim's happens-before checker's; on cuda the host
accesses to pinned memory whose copy the harness's delays saw still in flight),
and `active()` / `activate()` / `deactivate()` / `is_active`: a backend changes nothing in the process
until activated (on sim: torch is routed through its dispatch mode while any activation is open, and
restored exactly when the last ends; on cuda only threads started meanwhile are followed by the
harness's delays, cuda_threads.py). Targets and the harness activate it themselves.
`target_scope(name)` is what the harness makes targets in: on sim it adds the drop-in, which makes
plain `torch.cuda` resolve to the sim (docs/backends.md, "Drop-in").
`Backend` is that surface as a typed protocol: annotate a runner's backend with it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from pytest_graphmode.runtime.backends.errors import (
    CaptureError,
    UseAfterFreeError,
    capture_error_of,
)
from pytest_graphmode.runtime.backends.protocol import (
    Backend,
    EventHandle,
    GraphHandle,
    StreamHandle,
)
from pytest_graphmode.runtime.backends.race import Race, RaceSide

BACKEND_NAMES = ("auto", "cuda", "sim")
_instances: dict[str, Backend] = {}


def cuda_available() -> bool:
    """Whether the host has a GPU (the sim's drop-in, which makes `torch.cuda` say so, aside)."""
    from pytest_graphmode.runtime.backends.sim.drop_in import real_cuda_available

    return real_cuda_available()


def target_scope(name: str) -> AbstractContextManager[Backend]:
    """What a target lives in: backend `name` active, and on sim the drop-in (`torch.cuda` resolving
    to the sim), so a runner written against plain `torch.cuda` runs unchanged on either."""
    if resolve(name) == "sim":
        from pytest_graphmode.runtime.backends.sim import drop_in

        return drop_in()
    return get(name).active()


def resolve(name: str) -> str:
    """The concrete backend `name` stands for ("auto" -> "cuda" with a GPU, else "sim")."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        return "cuda" if cuda_available() else "sim"
    return name


def get(name: str = "auto") -> Backend:
    """The backend object for `name`; one instance per process and name."""
    concrete = resolve(name)
    if concrete not in _instances:
        if concrete == "cuda":
            from pytest_graphmode.runtime.backends.cuda import CudaBackend

            _instances[concrete] = CudaBackend()
        else:
            from pytest_graphmode.runtime.backends.sim import current_backend

            _instances[concrete] = current_backend()
    return _instances[concrete]


__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "CaptureError",
    "EventHandle",
    "GraphHandle",
    "Race",
    "RaceSide",
    "StreamHandle",
    "UseAfterFreeError",
    "capture_error_of",
    "cuda_available",
    "get",
    "resolve",
    "target_scope",
]
