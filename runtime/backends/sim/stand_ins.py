"""The sim's stand-ins for the objects and functions of `torch.cuda` that the drop-in (drop_in.py)
binds while it is active: a generator, graph and device contexts, a memory pool, device
properties, memory queries, nvtx, `_sleep`, and `torch.load` to the device.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from pytest_graphmode.runtime.backends.sim.backend import SimGraph, current_backend
from pytest_graphmode.runtime.backends.sim.device import SIM_MEMORY, is_index, is_sim_device
from pytest_graphmode.runtime.backends.sim.generators import (
    DEFAULT_SEED,
    PhiloxState,
    check_reseed,
    name_device_generator,
    philox_state,
    refuse_in_capture,
)
from pytest_graphmode.runtime.backends.sim.limits import SimUnsupportedError
from pytest_graphmode.runtime.backends.sim.streams import SimEvent, SimStream

"""The device memory the drop-in reports (`mem_get_info`'s total, `get_device_properties`), in
bytes. Free memory is this less what the sim's memory ledger holds reserved (memory_ledger.py): a
runner that sizes its KV cache from free memory gets about this much, as plain host memory."""


class SimGenerator(torch._C.Generator):
    """`torch.Generator(device="cuda")` on the sim: a generator that reports `cuda:0`, with CUDA's
    state (a seed and a philox offset, generators.py), whose draws run on the CPU. A generator
    for any other device is torch's own."""

    _philox: PhiloxState

    def __new__(cls, device: Any = "cpu") -> Any:
        if device is None or not is_sim_device(device):
            return torch._C.Generator(device if device is not None else "cpu")
        one_device(device)
        base: Any = torch._C.Generator  # its __new__ takes the device; typeshed says object's
        made = base.__new__(cls, "cpu")
        made._philox = PhiloxState(DEFAULT_SEED)
        name_device_generator(made)
        return made

    def __init__(self, device: Any = "cpu") -> None:
        # Everything was set up in __new__ (torch's generator takes no __init__ arguments).
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def manual_seed(self, seed: Any) -> SimGenerator:
        seed = _as_uint64(seed)
        check_reseed(current_backend(), self, seed)
        self._philox.seed = seed
        self._philox.offset = 0
        return self

    def initial_seed(self) -> int:
        return self._philox.seed

    def seed(self) -> int:
        refuse_in_capture(current_backend(), "seed")
        fresh = int(torch._C.Generator().seed())
        self._philox.seed, self._philox.offset = fresh, 0
        return fresh

    def get_offset(self) -> int:
        refuse_in_capture(current_backend(), "get_offset")
        return self._philox.offset

    def set_offset(self, offset: int) -> SimGenerator:
        refuse_in_capture(current_backend(), "set_offset")
        self._philox.offset = _checked_offset(offset)
        return self

    def get_state(self) -> torch.Tensor:
        """The seed and offset, 8 bytes each, as CUDA's generator gives them."""
        packed = struct.pack("<QQ", self._philox.seed, self._philox.offset)
        return torch.frombuffer(bytearray(packed), dtype=torch.uint8)

    def set_state(self, new_state: torch.Tensor) -> SimGenerator:
        """A state of `get_state`'s (or its first 8 bytes, the seed alone, offset 0)."""
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
            raise TypeError("expected a torch.ByteTensor, but got " + type(new_state).__name__)
        if new_state.numel() not in (8, 16):
            raise RuntimeError(
                f"RNG state is wrong size: a device generator's state is 16 bytes (seed and "
                f"offset), got {new_state.numel()}"
            )
        raw = bytes(new_state.detach().cpu().contiguous().tolist())
        seed = struct.unpack("<Q", raw[:8])[0]
        offset = struct.unpack("<Q", raw[8:])[0] if len(raw) == 16 else 0
        check_reseed(current_backend(), self, seed)
        self._philox.seed, self._philox.offset = seed, _checked_offset(offset)
        return self

    def clone_state(self) -> SimGenerator:
        """A new device generator holding a copy of this one's seed and offset."""
        refuse_in_capture(current_backend(), "clone_state")
        made = SimGenerator(self.device)
        made._philox = PhiloxState(self._philox.seed, self._philox.offset)
        return made

    def graphsafe_get_state(self) -> SimGenerator:
        """A device generator sharing this one's state: a draw from either moves both."""
        made = SimGenerator(self.device)
        made._philox = self._philox
        return made

    def graphsafe_set_state(self, state: Any) -> SimGenerator:
        """Share the state of `state`, a device generator (`graphsafe_get_state`'s)."""
        shared = philox_state(state)
        if shared is None:
            raise RuntimeError("Expected a CUDA Generator (graphsafe_set_state takes a device one)")
        self._philox = shared
        return self


def _checked_offset(offset: Any) -> int:
    offset = _as_uint64(offset)
    if offset % 4:
        raise RuntimeError(f"offset must be a multiple of 4 (got {offset})")
    return offset


def _as_uint64(value: Any) -> int:
    """A seed or offset as torch's binding reads it: an unsigned 64-bit number, where a negative
    one (down to -2**63) wraps around."""
    value = int(value)
    if not -(2**63) <= value < 2**64:
        raise ValueError("Overflow when unpacking long long")
    return value % 2**64


_TORCH_DEVICE = torch.device


class _DeviceClass(type):
    """Makes `SimTorchDevice` stand for torch's device class: calls, `isinstance` and
    `issubclass` reach torch's (a C type no Python class may subclass)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # torch asks its accelerator what a bare index means, and a host without one raises.
        if len(args) == 1 and not kwargs and is_index(args[0]):
            return _TORCH_DEVICE("cuda", args[0])
        return _TORCH_DEVICE(*args, **kwargs)

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _TORCH_DEVICE)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _TORCH_DEVICE)


class SimTorchDevice(metaclass=_DeviceClass):
    """`torch.device` in the drop-in: `torch.device(0)` (`torch.device(rank)`,
    `torch.device(torch.cuda.current_device())`) is `cuda:0`, as on a host with a GPU; every other
    call, and every device it makes, is torch's own."""


def one_device(device: Any = None) -> None:
    """Accept the sim's only device (None, 0, "cuda", "cuda:0", a torch.device of it)."""
    if device is None:
        return
    if isinstance(device, SimStream | SimEvent):
        return
    index = device if isinstance(device, int) else torch.device(device).index
    if not is_sim_device(device) or index not in (None, 0):
        raise ValueError(f"the sim has one device, cuda:0; got {device!r}")


class SimGraphContext:
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


class SimDeviceContext:
    """`torch.cuda.device(d)`: the sim has one device, so selecting it changes nothing."""

    def __init__(self, device: Any) -> None:
        one_device(device)

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

    def snapshot(self) -> list[Any]:
        """The pool's segments: none, as `torch.cuda.memory_snapshot()` on the sim."""
        return memory_snapshot()

    def __getattr__(self, name: str) -> Any:
        # Asked only for what the class lacks. A public name is a question about the caching
        # allocator's pool (`use_count`); a private one is Python's or a library's probe.
        if name.startswith("_"):
            raise AttributeError(name)
        raise SimUnsupportedError(f"torch.cuda.MemPool().{name}")


@contextlib.contextmanager
def use_mem_pool(pool: SimMemPool, device: Any = None) -> Iterator[None]:
    one_device(device)
    yield


class SimDeviceProperties:
    """`torch.cuda.get_device_properties()` on the sim: the fields a runner sizes itself by, as a
    GPU of compute capability 9.0 (132 multiprocessors) reports them. Any other field (a UUID, a
    PCI bus, clock rates) is a question about a real board, and raises."""

    name = "pytest-graphmode sim"
    major, minor = 9, 0
    total_memory = SIM_MEMORY
    multi_processor_count = 132
    is_integrated = False
    is_multi_gpu_board = False
    # What every GPU of compute capability 9.0 has, which kernels size their launches by.
    warp_size = 32
    max_threads_per_multi_processor = 2048
    regs_per_multiprocessor = 65536
    shared_memory_per_block = 48 * 1024
    shared_memory_per_block_optin = 227 * 1024
    shared_memory_per_multiprocessor = 228 * 1024
    L2_cache_size = 50 * 1024 * 1024

    def __getattr__(self, field: str) -> Any:
        raise SimUnsupportedError(f"torch.cuda.get_device_properties().{field}")

    def __repr__(self) -> str:
        return f"SimDeviceProperties(name={self.name!r}, total_memory={self.total_memory})"


def device_of(obj: Any) -> SimDeviceContext:
    """`torch.cuda.device_of(t)`: the device of a device tensor, else no change of device."""
    return SimDeviceContext(0 if getattr(obj, "is_cuda", False) else None)


def sleep(cycles: int) -> None:
    """`torch.cuda._sleep(cycles)`: a kernel that only takes time. The sim has no kernel time (its
    scheduler decides how far queued work has run), so it queues nothing."""
    if not is_index(cycles):
        raise TypeError(f"_sleep(): argument 'cycles' must be int, not {type(cycles).__name__}")


def loader(host_load: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.load` with `map_location` naming a device, or a dict of locations: to "cuda", torch
    would make CUDA storages, which a host without a GPU cannot; to "cpu", the sim's device
    tensors in the file (their class is saved) would come back on the device; and the file of a
    device tensor names the host as its location. The sim loads on the host, then moves every
    tensor and module of the result where it was asked (tensors that shared storage in the file
    each get their own copy). Without `map_location`, tensors come back where they were."""

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(map_location, dict):
            locations = {str(k): v for k, v in map_location.items()}

            def where(t: torch.Tensor) -> Any:
                saved = "cuda:0" if t.is_cuda else "cpu"
                return locations.get(saved, saved)

        elif is_sim_device(map_location) or (
            isinstance(map_location, str | torch.device)
            and torch.device(map_location).type == "cpu"
        ):

            def where(t: torch.Tensor) -> Any:
                return map_location

        else:
            return host_load(f, map_location, *args, **kwargs)
        loaded = host_load(f, "cpu", *args, **kwargs)
        return tree_map_only((torch.Tensor, torch.nn.Module), _mover(where), loaded)

    return load


def _mover(where: Callable[[torch.Tensor], Any]) -> Callable[[Any], Any]:
    def move_tensor(t: torch.Tensor) -> torch.Tensor:
        target = where(t)
        if is_sim_device(target):
            one_device(target)
            target = "cuda"
        return t.to(target)

    def move(item: Any) -> Any:
        if isinstance(item, torch.nn.Module):
            return item._apply(move_tensor)
        return move_tensor(item)

    return move


def nothing(*args: Any, **kwargs: Any) -> None:
    return None


def memory_snapshot(*args: Any, **kwargs: Any) -> list[Any]:
    return []  # no caching-allocator segments: the sim's device memory is the CPU allocator's


def unsupported(call: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise SimUnsupportedError(call)

    return refuse


class SimNvtx:
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
