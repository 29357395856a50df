"""The sim backend: CUDA graph semantics on the CPU, so graph bugs fail in GPU-free CI."""

from pytest_graphmode.runtime.backends.sim.backend import SimBackend, SimGraph, current_backend
from pytest_graphmode.runtime.backends.sim.drop_in import SimDeviceProperties, drop_in
from pytest_graphmode.runtime.backends.sim.limits import SimUnsupportedError
from pytest_graphmode.runtime.backends.sim.pool import SimCapturePool, SimPoolHandle
from pytest_graphmode.runtime.backends.sim.streams import SimEvent, SimStream

__all__ = [
    "SimBackend",
    "SimCapturePool",
    "SimDeviceProperties",
    "SimEvent",
    "SimGraph",
    "SimPoolHandle",
    "SimStream",
    "SimUnsupportedError",
    "current_backend",
    "drop_in",
]
