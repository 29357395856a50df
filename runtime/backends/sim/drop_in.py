"""Drop-in: plain `torch.cuda` on the sim, for runners that never heard of this package.

`drop_in()` activates the sim backend and, for the duration, rebinds the names of `torch.cuda` a
graph runner calls to the sim's objects: `CUDAGraph` is `SimGraph`, `graph(...)` is the sim's
capture, `Stream` / `Event` / `stream` / `current_stream` / `default_stream` / `synchronize` are
the sim's streams, `is_available()` is True with one device, `cuda:0`. Device placement
(`device="cuda"`, `.to`, `.cuda()`, `pin_memory=True`, `.pin_memory()`, `.is_pinned()`) is the sim
device's, active with the backend, and `torch.Generator(device="cuda")` makes a `SimGenerator`.
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
from torch.utils._pytree import tree_map_only

from pytest_graphmode.runtime.backends.sim.backend import SimBackend, SimGraph, current_backend
from pytest_graphmode.runtime.backends.sim.device import is_sim_device
from pytest_graphmode.runtime.backends.sim.generators import check_reseed
from pytest_graphmode.runtime.backends.sim.limits import SimUnsupportedError
from pytest_graphmode.runtime.backends.sim.streams import SimEvent, SimStream

SIM_MEMORY = 8 << 30
"""The device memory the drop-in reports (`mem_get_info`, `get_device_properties`), in bytes. The
sim does not account device memory: a runner that sizes its KV cache from free memory gets this
much, as plain host memory."""

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


class SimGenerator(torch._C.Generator):
    """`torch.Generator(device="cuda")` on the sim: a CPU generator (the sim's device draws run on
    the CPU) that reports `cuda:0`. A generator for any other device is torch's own."""

    def __new__(cls, device: Any = "cpu") -> Any:
        if device is None or not is_sim_device(device):
            return torch._C.Generator(device if device is not None else "cpu")
        _one_device(device)
        base: Any = torch._C.Generator  # its __new__ takes the device; typeshed says object's
        return base.__new__(cls, "cpu")

    def __init__(self, device: Any = "cpu") -> None:
        # Everything was set up in __new__ (torch's generator takes no __init__ arguments).
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def manual_seed(self, seed: Any) -> SimGenerator:
        check_reseed(current_backend(), self, seed)
        super().manual_seed(seed)
        return self


def _one_device(device: Any = None) -> None:
    """Accept the sim's only device (None, 0, "cuda", "cuda:0", a torch.device of it)."""
    if device is None:
        return
    if isinstance(device, SimStream | SimEvent):
        return
    index = device if isinstance(device, int) else torch.device(device).index
    if not is_sim_device(device) or index not in (None, 0):
        raise ValueError(f"the sim has one device, cuda:0; got {device!r}")


class _SimGraphContext:
    """`torch.cuda.graph(g, pool=, stream=, capture_error_mode=)` on the sim."""

    def __init__(
        self,
        cuda_graph: SimGraph,
        pool: Any = None,
        stream: SimStream | None = None,
        capture_error_mode: str = "global",
    ) -> None:
        self._context = current_backend().graph(cuda_graph, pool, stream, capture_error_mode)

    def __enter__(self) -> SimGraph:
        return self._context.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._context.__exit__(*exc)


class _SimDeviceContext:
    """`torch.cuda.device(d)`: the sim has one device, so selecting it changes nothing."""

    def __init__(self, device: Any) -> None:
        _one_device(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class SimMemPool:
    """`torch.cuda.MemPool()` on the sim: `id` is a graph pool handle, to pass as
    `torch.cuda.graph(..., pool=mem_pool.id)`. Its memory is the graph pool's; allocations made
    under `torch.cuda.use_mem_pool(pool)` outside a capture are ordinary sim device memory."""

    def __init__(self, allocator: Any = None, *args: Any, **kwargs: Any) -> None:
        if allocator is not None:
            raise SimUnsupportedError("torch.cuda.MemPool with a custom allocator")
        self.id = current_backend().graph_pool_handle()


@contextlib.contextmanager
def _use_mem_pool(pool: SimMemPool, device: Any = None) -> Iterator[None]:
    _one_device(device)
    yield


class SimDeviceProperties:
    """`torch.cuda.get_device_properties()` on the sim: the fields a runner sizes itself by. Any
    other field is a question about real hardware, and raises."""

    name = "pytest-graphmode sim"
    major, minor = 9, 0
    total_memory = SIM_MEMORY
    multi_processor_count = 132
    is_integrated = False
    is_multi_gpu_board = False

    def __getattr__(self, field: str) -> Any:
        raise SimUnsupportedError(f"torch.cuda.get_device_properties().{field}")

    def __repr__(self) -> str:
        return f"SimDeviceProperties(name={self.name!r}, total_memory={self.total_memory})"


def _device_of(obj: Any) -> _SimDeviceContext:
    """`torch.cuda.device_of(t)`: the device of a device tensor, else no change of device."""
    return _SimDeviceContext(0 if getattr(obj, "is_cuda", False) else None)


def _sleep(cycles: int) -> None:
    """`torch.cuda._sleep(cycles)`: a kernel that only takes time. The sim has no kernel time (its
    scheduler decides how far queued work has run), so it queues nothing."""
    if not isinstance(cycles, int) or isinstance(cycles, bool):
        raise TypeError(f"_sleep(): argument 'cycles' must be int, not {type(cycles).__name__}")


def _loader(host_load: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.load` with `map_location` naming a device: to "cuda", torch would make CUDA
    storages, which a host without a GPU cannot; to "cpu", the sim's device tensors in the file
    (their class is saved) would come back on the device. The sim loads, then moves every
    tensor and module of the result where it was asked (tensors that shared storage in the
    file each get their own copy). Without `map_location`, tensors come back where they were."""

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(map_location, str | torch.device | int) and is_sim_device(map_location):
            _one_device(map_location)
            target = "cuda"
        elif (
            isinstance(map_location, str | torch.device)
            and torch.device(map_location).type == "cpu"
        ):
            target = "cpu"
        else:
            return host_load(f, map_location, *args, **kwargs)
        loaded = host_load(f, "cpu", *args, **kwargs)
        return tree_map_only((torch.Tensor, torch.nn.Module), lambda item: item.to(target), loaded)

    return load


def _memory_stats(device: Any = None) -> dict[str, int]:
    _one_device(device)
    return {
        "allocated_bytes.all.current": 0,
        "allocated_bytes.all.peak": 0,
        "reserved_bytes.all.current": 0,
        "reserved_bytes.all.peak": 0,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


def _zero(device: Any = None) -> int:
    _one_device(device)
    return 0


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    _one_device(device)
    return "pytest-graphmode sim: device memory is host memory, and the sim does not account it\n"


def _memory_snapshot(*args: Any, **kwargs: Any) -> list[Any]:
    return []  # no caching-allocator segments: the sim's device memory is the CPU allocator's


def _unsupported(call: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise SimUnsupportedError(call)

    return refuse


class _SimNvtx:
    """torch.cuda.nvtx's binding on the sim, with the binding's method names. Ranges and marks
    annotate a profiler's timeline, and the sim has none, so they do nothing (on a CPU build of
    torch, torch's own would raise)."""

    def __init__(self) -> None:
        self._depth = 0
        self._ranges = 0

    def rangePushA(self, msg: str) -> int:
        self._depth += 1
        return self._depth - 1

    def rangePop(self) -> int:
        self._depth = max(self._depth - 1, 0)
        return self._depth

    def rangeStartA(self, msg: str) -> int:
        self._ranges += 1
        return self._ranges

    def rangeEnd(self, range_id: int) -> None:
        return None

    def markA(self, msg: str) -> None:
        return None

    def deviceRangeStart(self, msg: str, stream: int = 0) -> object:
        return object()

    def deviceRangeEnd(self, handle: object, stream: int = 0) -> None:
        return None


def _surface(backend: SimBackend) -> dict[str, Any]:
    def stream_on(device: Any = None) -> SimStream:
        _one_device(device)
        return backend.current_stream()

    def default_on(device: Any = None) -> SimStream:
        _one_device(device)
        return backend.default_stream()

    def synchronize(device: Any = None) -> None:
        _one_device(device)
        backend.synchronize()

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        _one_device(device)
        return SIM_MEMORY, SIM_MEMORY

    def properties(device: Any = None) -> SimDeviceProperties:
        _one_device(device)
        return SimDeviceProperties()

    def device_name(device: Any = None) -> str:
        _one_device(device)
        return SimDeviceProperties.name

    def capability(device: Any = None) -> tuple[int, int]:
        _one_device(device)
        return SimDeviceProperties.major, SimDeviceProperties.minor

    def set_device(device: Any) -> None:
        _one_device(device)

    def capturing() -> bool:
        return backend._active is not None

    # The sim's device draws come from torch's global (CPU) generator: seeding "the GPU" seeds it.
    # (Directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.)
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    def rng_state(device: Any = "cuda") -> torch.Tensor:
        _one_device(device)
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        _one_device(device)
        torch.set_rng_state(state)

    surface: dict[str, Callable[..., Any] | type] = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": _nothing,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": set_device,
        "device": _SimDeviceContext,
        "device_of": _device_of,
        "_sleep": _sleep,
        "ipc_collect": _nothing,
        "get_device_name": device_name,
        "get_device_capability": capability,
        "get_device_properties": properties,
        "CUDAGraph": SimGraph,
        "graph": _SimGraphContext,
        "graph_pool_handle": backend.graph_pool_handle,
        "MemPool": SimMemPool,
        "use_mem_pool": _use_mem_pool,
        "is_current_stream_capturing": capturing,
        "Stream": SimStream,
        "Event": SimEvent,
        "stream": backend.stream,
        "set_stream": backend.set_stream,
        "ExternalStream": _unsupported("torch.cuda.ExternalStream (a stream made outside torch)"),
        "current_stream": stream_on,
        "default_stream": default_on,
        "synchronize": synchronize,
        "empty_cache": _nothing,
        "mem_get_info": mem_get_info,
        "memory_stats": _memory_stats,
        "memory_summary": _memory_summary,
        "memory_snapshot": _memory_snapshot,
        "utilization": _unsupported("torch.cuda.utilization (NVML)"),
        "temperature": _unsupported("torch.cuda.temperature (NVML)"),
        "power_draw": _unsupported("torch.cuda.power_draw (NVML)"),
        "clock_rate": _unsupported("torch.cuda.clock_rate (NVML)"),
        "memory_allocated": _zero,
        "max_memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_reserved": _zero,
        "reset_peak_memory_stats": _nothing,
        "reset_max_memory_allocated": _nothing,
        "reset_accumulated_memory_stats": _nothing,
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
        (torch.cuda.nvtx, "_nvtx", _SimNvtx()),
        # The device's default generator: the global one, which the sim's device draws use.
        (torch.cuda, "default_generators", (torch.default_generator,)),
        # torch.cuda's memory queries are torch.cuda.memory's, and may be called from there.
        *((torch.cuda.memory, name, surface[name]) for name in _MEMORY_MODULE_NAMES),
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
        if isinstance(device, int) and not isinstance(device, bool):
            device = torch.device("cuda", device)
        host_set_default_device(device)

    # torch.accelerator's names for what torch.cuda's drop-in answers: the same objects.
    same_as_cuda = {
        "is_available": "is_available",
        "device_count": "device_count",
        "synchronize": "synchronize",
        "current_stream": "current_stream",
        "set_stream": "set_stream",
        "set_device_index": "set_device",
        "set_device_idx": "set_device",
        "device_index": "device",
        "get_memory_info": "mem_get_info",
        **{name: name for name in _ACCELERATOR_MEMORY_NAMES},
    }
    accelerator = {
        "current_accelerator": current_accelerator,
        "current_device_idx": surface["current_device"],
        "current_device_index": surface["current_device"],
        **{name: surface[cuda_name] for name, cuda_name in same_as_cuda.items()},
    }
    return [
        (torch, "get_device_module", get_device_module),
        (torch, "set_default_device", set_default_device),
        (torch, "load", _loader(torch.load)),
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
