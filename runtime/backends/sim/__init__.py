"""The sim backend: CUDA graph semantics on the CPU, so graph bugs fail in GPU-free CI."""

from pytest_graphmode.runtime.backends.sim.backend import SimBackend, SimGraph, current_backend
from pytest_graphmode.runtime.backends.sim.pool import SimCapturePool, SimPoolHandle
from pytest_graphmode.runtime.backends.sim.streams import SimEvent, SimStream

__all__ = [
    "SimBackend",
    "SimCapturePool",
    "SimEvent",
    "SimGraph",
    "SimPoolHandle",
    "SimStream",
    "current_backend",
]
