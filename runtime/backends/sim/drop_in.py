"""Drop-in: plain `torch.cuda` on the sim, for runners that never heard of this package.

`drop_in()` activates the sim backend and, for the duration, rebinds the names of `torch.cuda` a
graph runner calls to the sim's objects: `CUDAGraph` is `SimGraph`, `graph(...)` is the sim's
capture, `Stream` / `Event` / `stream` / `current_stream` / `default_stream` / `synchronize` are
the sim's streams, `is_available()` is True with one device, `cuda:0`. Device placement
(`device="cuda"`, `.to`, `.cuda()`, `pin_memory=True`, `.pin_memory()`, `.is_pinned()`) is the sim
device's, active with the backend, and `torch.Generator(device="cuda")` makes a `SimGenerator`.
`torch.compile` returns what it is given, whose Python the sim runs, and refuses a compile that
would capture CUDA graphs itself (`compile.py`).
torch's device-generic entry points answer for the sim too: `torch.accelerator.is_available()` is
True with one device, `cuda`, and `torch.get_device_module()` is `torch.cuda`. On exit every
rebound name is put back as it was (the very same objects), so outside the block torch is exactly
as before.

Calls nest (a campaign's twins and its probe each enter it); only the outermost touches `torch.cuda`.
What the sim cannot run fails at first use with `SimUnsupportedError`, which names the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.cuda.graphs
import torch.cuda.nvtx
import torch.cuda.streams

from pytest_graphmode.runtime.backends.sim.autocast import (
    SimAutocast,
    SimCudaAutocast,
    autocast_query,
)
from pytest_graphmode.runtime.backends.sim.backend import SimBackend, SimGraph, current_backend
from pytest_graphmode.runtime.backends.sim.compile import sim_compile
from pytest_graphmode.runtime.backends.sim.device import is_index, is_sim_device
from pytest_graphmode.runtime.backends.sim.memory_queries import (
    MEMORY_MODULE_PRIVATE,
    memory_query_surface,
)
from pytest_graphmode.runtime.backends.sim.stand_ins import (
    SIM_MEMORY,
    SimDeviceContext,
    SimDeviceProperties,
    SimGenerator,
    SimGraphContext,
    SimMemPool,
    SimNvtx,
    SimTorchDevice,
    device_of,
    loader,
    memory_snapshot,
    nothing,
    one_device,
    sleep,
    unsupported,
    use_mem_pool,
)
from pytest_graphmode.runtime.backends.sim.streams import SimEvent, SimStream
from pytest_graphmode.runtime.backends.sim.sync_debug import (
    get_sync_debug_mode,
    set_sync_debug_mode,
)

_ABSENT = object()
_depth = 0
_originals: dict[str, Any] = {}
# (module, name, original) of the names rebound outside torch.cuda
_other_originals: list[tuple[Any, str, Any]] = []


def is_active() -> bool:
    """Whether `torch.cuda` is rebound to the sim now."""
    return _depth > 0


def real_cuda_available() -> bool:
    """`torch.cuda.is_available()` of the host, whether or not the drop-in is active."""
    original = _originals.get("is_available", torch.cuda.is_available)
    return bool(original())


@contextlib.contextmanager
def drop_in() -> Iterator[SimBackend]:
    """Run the block with the sim active and `torch.cuda` resolving to it (module docstring)."""
    global _depth
    backend = current_backend()
    backend.activate()
    try:
        if _depth == 0:
            surface = _surface(backend)
            _install(surface, _submodule_surface(surface) + _device_generic_surface(surface))
        _depth += 1
        try:
            yield backend
        finally:
            _depth -= 1
            if _depth == 0:
                _restore()
    finally:
        backend.deactivate()


def _install(surface: dict[str, Any], others: list[tuple[Any, str, Any]]) -> None:
    _originals["Generator"] = torch.Generator
    torch.Generator = SimGenerator  # type: ignore[misc]
    for name, replacement in surface.items():
        _originals[name] = torch.cuda.__dict__.get(name, _ABSENT)
        setattr(torch.cuda, name, replacement)
    for module, name, replacement in others:
        _other_originals.append((module, name, module.__dict__.get(name, _ABSENT)))
        setattr(module, name, replacement)


def _restore() -> None:
    torch.Generator = _originals.pop("Generator")  # type: ignore[misc]
    for name, original in _originals.items():
        if original is _ABSENT:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, original)
    _originals.clear()
    for module, name, original in reversed(_other_originals):
        if original is _ABSENT:
            delattr(module, name)
        else:
            setattr(module, name, original)
    _other_originals.clear()


def _surface(backend: SimBackend) -> dict[str, Any]:
    def stream_on(device: Any = None) -> SimStream:
        one_device(device)
        return backend.current_stream()

    def default_on(device: Any = None) -> SimStream:
        one_device(device)
        return backend.default_stream()

    def synchronize(device: Any = None) -> None:
        one_device(device)
        backend.synchronize()

    def empty_cache(device: Any = None) -> None:
        one_device(device)
        backend.empty_cache()

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        one_device(device)
        return backend.mem_get_info()

    def properties(device: Any = None) -> SimDeviceProperties:
        one_device(device)
        return SimDeviceProperties()

    def device_name(device: Any = None) -> str:
        one_device(device)
        return SimDeviceProperties.name

    def capability(device: Any = None) -> tuple[int, int]:
        one_device(device)
        return SimDeviceProperties.major, SimDeviceProperties.minor

    def set_device(device: Any) -> None:
        one_device(device)

    # The sim's device draws come from torch's global (CPU) generator: seeding "the GPU" seeds it.
    # (Directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.)
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    def rng_state(device: Any = "cuda") -> torch.Tensor:
        one_device(device)
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        one_device(device)
        torch.set_rng_state(state)

    surface: dict[str, Callable[..., Any] | type] = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": nothing,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": set_device,
        "device": SimDeviceContext,
        "device_of": device_of,
        "_sleep": sleep,
        "ipc_collect": nothing,
        "get_device_name": device_name,
        "get_device_capability": capability,
        "get_device_properties": properties,
        "CUDAGraph": SimGraph,
        "graph": SimGraphContext,
        "graph_pool_handle": backend.graph_pool_handle,
        "MemPool": SimMemPool,
        "use_mem_pool": use_mem_pool,
        "is_current_stream_capturing": backend.is_current_stream_capturing,
        "Stream": SimStream,
        "Event": SimEvent,
        "stream": backend.stream,
        "set_stream": backend.set_stream,
        "ExternalStream": unsupported("torch.cuda.ExternalStream (a stream made outside torch)"),
        "current_stream": stream_on,
        "default_stream": default_on,
        "synchronize": synchronize,
        "set_sync_debug_mode": set_sync_debug_mode,
        "get_sync_debug_mode": get_sync_debug_mode,
        "empty_cache": empty_cache,
        "mem_get_info": mem_get_info,
        **memory_query_surface(backend.memory),
        "memory_snapshot": memory_snapshot,
        "utilization": unsupported("torch.cuda.utilization (NVML)"),
        "temperature": unsupported("torch.cuda.temperature (NVML)"),
        "power_draw": unsupported("torch.cuda.power_draw (NVML)"),
        "clock_rate": unsupported("torch.cuda.clock_rate (NVML)"),
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed,
        "seed": torch.seed,
        "seed_all": torch.seed,
        "initial_seed": torch.initial_seed,
        "get_rng_state": rng_state,
        "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [torch.get_rng_state()],
        "set_rng_state_all": lambda states: torch.set_rng_state(states[0]),
    }
    return surface


# The names of torch.cuda.memory that resolve to the sim with torch.cuda's.
_MEMORY_MODULE_NAMES = (
    "empty_cache",
    "mem_get_info",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "set_per_process_memory_fraction",
    "get_per_process_memory_fraction",
    "get_allocator_backend",
    "caching_allocator_alloc",
    "caching_allocator_delete",
    "memory_summary",
    "memory_snapshot",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "reset_accumulated_memory_stats",
)
# The memory queries torch.accelerator shares with torch.cuda, by the same names.
_ACCELERATOR_MEMORY_NAMES = (
    "empty_cache",
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
)
# The names of torch.cuda.graphs that resolve to the sim with torch.cuda's.
_GRAPHS_MODULE_NAMES = ("CUDAGraph", "graph", "graph_pool_handle", "is_current_stream_capturing")


def _submodule_surface(surface: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """The names of torch.cuda's submodules that must resolve to the sim with torch.cuda's own:
    torch's helpers look them up there (make_graphed_callables calls its module's
    graph_pool_handle, nvtx calls its binding), and a runner may name
    torch.cuda.graphs.CUDAGraph or torch.cuda.streams.Stream directly."""
    return [
        *((torch.cuda.graphs, name, surface[name]) for name in _GRAPHS_MODULE_NAMES),
        (torch.cuda.streams, "Stream", SimStream),
        (torch.cuda.streams, "Event", SimEvent),
        (torch.cuda.nvtx, "_nvtx", SimNvtx()),
        # The device's default generator: the global one, which the sim's device draws use.
        (torch.cuda, "default_generators", (torch.default_generator,)),
        # torch.cuda's memory queries are torch.cuda.memory's, and may be called from there.
        *((torch.cuda.memory, name, surface[name]) for name in _MEMORY_MODULE_NAMES),
        *((torch.cuda.memory, name, call) for name, call in MEMORY_MODULE_PRIVATE.items()),
        # vLLM's sleep-mode allocator names its pool there (only the names this torch has).
        *(
            (torch.cuda.memory, name, surface[name])
            for name in ("MemPool", "use_mem_pool")
            if hasattr(torch.cuda.memory, name)
        ),
    ]


def _device_generic_surface(surface: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """The names outside `torch.cuda` that runners written for any accelerator ask (transformers
    5.19 onwards does): without them, a host without a GPU answers "no accelerator, the CPU"."""
    host_device_module = torch.get_device_module

    def get_device_module(device: Any = None) -> Any:
        # No device means the current accelerator, which is the sim's cuda:0 inside the block.
        if device is None or is_sim_device(device):
            return torch.cuda
        return host_device_module(device)

    def current_accelerator(check_available: bool = False) -> torch.device:
        return torch.device("cuda")

    host_set_default_device = torch.set_default_device

    def set_default_device(device: Any) -> None:
        # torch makes a bare index a device of the host's accelerator, and a host without one
        # raises: it names the sim's device here.
        if is_index(device):
            device = torch.device("cuda", device)
        host_set_default_device(device)

    # torch.accelerator's names for what torch.cuda's drop-in answers: the same objects.
    same_as_cuda = {
        "is_available": "is_available",
        "device_count": "device_count",
        "synchronize": "synchronize",
        "current_stream": "current_stream",
        "set_stream": "set_stream",
        "current_device_index": "current_device",
        "current_device_idx": "current_device",
        "set_device_index": "set_device",
        "set_device_idx": "set_device",
        "device_index": "device",
        "get_memory_info": "mem_get_info",
        **{name: name for name in _ACCELERATOR_MEMORY_NAMES},
    }
    accelerator = {
        "current_accelerator": current_accelerator,
        **{name: surface[cuda_name] for name, cuda_name in same_as_cuda.items()},
    }
    return [
        (torch, "get_device_module", get_device_module),
        (torch, "set_default_device", set_default_device),
        (torch, "load", loader(torch.load)),
        (torch, "device", SimTorchDevice),
        (torch, "autocast", SimAutocast),
        (torch.amp, "autocast", SimAutocast),
        (torch.cuda.amp, "autocast", SimCudaAutocast),
        (torch, "is_autocast_enabled", autocast_query(torch.is_autocast_enabled)),
        # Dynamo skips every frame under the sim's modes (compile.py says what that hid).
        (torch, "compile", sim_compile(torch.compile)),
        # Only the names this torch has: a name the sim added would be one a GPU host lacks.
        *(
            (torch.accelerator, name, value)
            for name, value in accelerator.items()
            if hasattr(torch.accelerator, name)
        ),
    ]


__all__ = [
    "SIM_MEMORY",
    "SimDeviceProperties",
    "SimGenerator",
    "SimMemPool",
    "drop_in",
    "is_active",
    "real_cuda_available",
]
