"""The sim device: tensors that say they live on the GPU, over ordinary CPU storage.

A `SimDeviceTensor` is a plain subclass of `torch.Tensor` (no `__torch_function__` of its own, so
the class costs nothing per operation): C++ sees a CPU tensor and runs every kernel natively, while
Python sees `device == cuda:0`, `is_cuda`, `get_device() == 0`. The sim's dispatch mode keeps the
distinction alive: an operation with a device tensor argument is device work, and its new outputs
are made device tensors; an operation without one is host work.

Python calls that name a device never reach the dispatcher with it: torch's argument parser would
initialise CUDA (and fail without it) before any dispatch mode is asked. `DeviceMode`
(device_mode.py), a `TorchFunctionMode` entered and left with the sim's activation, sees them
first and rewrites them (placement.py), and answers what the host reads of a device tensor as CUDA
does (host_reads.py). Crossings between host and device become a fresh tensor on the other side
and a `copy_` into it (`to_device`, `to_host`), so the dispatch mode judges every crossing in one
place (`SimBackend._cross`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.backend import SimBackend

SIM_DEVICE = torch.device("cuda", 0)
"""What sim tensors report as their device (`SimBackend.device`)."""

SIM_MEMORY = 8 << 30
"""The device memory the sim reports as its total; free memory is this less what its memory
ledger holds reserved (memory_ledger.py)."""

CPU = torch.device("cpu")
# not exported by torch.nn.parameter, so its stubs do not name it
_UNINITIALIZED: type = torch.nn.parameter.UninitializedTensorMixin  # type: ignore[attr-defined]
# torch's device class itself: the drop-in rebinds `torch.device` to a stand-in (stand_ins.py)
_DEVICE_CLASS = torch.device


POOLED, VIEW_OF, POOL_BLOCK = "_sim_pooled", "_sim_view_of", "_sim_pool_block"
"""Attributes the sim sets on a capture's outputs and their views (capture.keep_bases_of_views),
and on an output alone: its block (pool.BlockReturns)."""
SIM_ATTRIBUTES = (POOLED, VIEW_OF, POOL_BLOCK)


class SimDeviceTensor(torch.Tensor):
    """A tensor on the simulated GPU: CPU storage that reports `SIM_DEVICE`."""

    # Operations on it are plain CPU operations: no Python code of the class runs per operation.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return SIM_DEVICE

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:
        return 0

    def record_stream(self, stream: Any) -> None:
        """On CUDA: keep the caching allocator from handing this tensor's block to other work
        until what `stream` has queued up to the free is done. On the sim: the free tracker
        (frees.py) takes `stream`'s uses of this memory as ordered before its reuse. (torch's own
        method would refuse the sim's stream before any mode saw the call.)"""
        from pytest_graphmode.runtime.backends.sim.streams import SimStream

        if not isinstance(stream, SimStream):
            raise TypeError(f"record_stream: expected a stream of the sim, got {stream!r}")
        stream._backend.record_stream(self, stream)

    def __reduce_ex__(self, proto: Any) -> Any:
        """Saving or pickling reads the values on the host, as a download does: wait for the
        current stream first (torch reads the storage directly, beneath every mode). The file
        names this class, so a load (weights only, too: the module allows it below) gives a
        device tensor back, as CUDA's does."""
        from pytest_graphmode.runtime.backends.sim.backend import current_backend

        backend = current_backend()
        if backend.is_active:
            backend.host_read("saving a device tensor", self)
        # The sim's own references (capture.keep_bases_of_views) are not the tensor's to save.
        own = {name: self.__dict__.pop(name) for name in SIM_ATTRIBUTES if name in self.__dict__}
        try:
            return super().__reduce_ex__(proto)
        finally:
            self.__dict__.update(own)


class SimDeviceParameter(SimDeviceTensor, torch.nn.Parameter):
    """A module's parameter moved to the simulated GPU (`module.to("cuda")` sets its `.data`)."""


# A runner's own parameter classes (vLLM's carry a weight loader) keep their class on the device:
# each gets a device twin, made at its first use, that is both the runner's class and a device
# tensor. The runner's class comes first, so its methods win over the sim's, as they would over
# torch's on CUDA; `device`, `is_cuda` and `record_stream` come from the sim's.
_DEVICE_PARAMETERS: dict[type, type] = {torch.nn.Parameter: SimDeviceParameter}
_HOST_PARAMETERS: dict[type, type] = {SimDeviceParameter: torch.nn.Parameter}


def device_parameter_class(cls: type) -> type:
    """The class a parameter of class `cls` has on the sim device."""
    cls = host_parameter_class(cls)
    twin = _DEVICE_PARAMETERS.get(cls)
    if twin is None:
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        twin = type(cls.__name__, (cls, SimDeviceTensor), namespace)
        _DEVICE_PARAMETERS[cls] = twin
        _HOST_PARAMETERS[twin] = cls
    return twin


def host_parameter_class(cls: type) -> type:
    """The class a parameter of class `cls` has on the host."""
    return _HOST_PARAMETERS.get(cls, cls)


def is_movable_parameter(t: Any) -> bool:
    """A parameter whose class follows its side. Not a lazy module's uninitialized one: torch
    swaps its class itself when it is materialized."""
    return isinstance(t, torch.nn.Parameter) and not isinstance(t, _UNINITIALIZED)


def patch_parameter_new() -> Callable[[], None]:
    """`nn.Parameter(data)` (or a runner's subclass of it) of a device tensor or parameter makes
    the class's device twin, as `nn.Parameter` of a CUDA tensor makes a parameter on CUDA. (torch's
    own takes the sim's classes for tensor subclasses: it wants `detach()` to return the
    parameter's class, and refuses a device parameter, so `nn.Parameter(module.weight)` and
    weight-norm parametrizations failed, and a subclass came back as a plain device tensor.)
    Returns what puts torch's back."""
    original = torch.nn.Parameter.__dict__["__new__"]

    def new(cls: type, data: Any = None, requires_grad: bool = True) -> Any:
        if issubclass(cls, _UNINITIALIZED):
            return original.__func__(cls, data, requires_grad)
        if isinstance(data, SimDeviceTensor):
            return torch.Tensor._make_subclass(device_parameter_class(cls), data, requires_grad)
        return original.__func__(host_parameter_class(cls), data, requires_grad)

    torch.nn.Parameter.__new__ = staticmethod(new)  # type: ignore[assignment]

    def restore() -> None:
        torch.nn.Parameter.__new__ = original  # type: ignore[method-assign]

    return restore


# `torch.load(weights_only=True)`, torch's default, rebuilds only the classes it is told are safe.
torch.serialization.add_safe_globals([SimDeviceTensor, SimDeviceParameter])


def on_device(t: torch.Tensor) -> bool:
    return isinstance(t, SimDeviceTensor)


def mark_device(result: Any) -> Any:
    """Make the plain tensors in `result` (a tensor, or a tuple or list of them) device tensors,
    in place: a class assignment, no copy and no new Python object."""
    if type(result) is torch.Tensor:
        result.__class__ = SimDeviceTensor
    elif isinstance(result, tuple | list):
        for item in result:
            if type(item) is torch.Tensor:
                item.__class__ = SimDeviceTensor
    return result


def call_through(
    backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run a torch call the device mode lets through. While a builtin runs, the sim keeps its
    arguments (`_call_args`): the tensors its C++ makes inside with its inputs' options (the
    causal mask of SDPA's math kernel, `combinations`' mask) are CPU tensors to the dispatcher,
    and device tensors on CUDA when an input is one. A Python function's own
    calls pass no mode, so what it makes stays where its code puts it."""
    previous = backend._call_args
    backend._call_args = None if type(func) is FunctionType else (args, kwargs)
    try:
        return func(*args, **kwargs)
    finally:
        backend._call_args = previous


def is_sim_device(device: Any) -> bool:
    """Whether a `device=` argument names the simulated GPU (any CUDA device, or a bare index)."""
    if isinstance(device, _DEVICE_CLASS):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    return is_index(device)


def is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def to_device(backend: SimBackend, t: torch.Tensor, dtype: torch.dtype, non_blocking: bool) -> Any:
    with backend.placing(True):
        out = mark_device(torch.empty_like(t, dtype=dtype, device=CPU))
    return out.copy_(t, non_blocking=non_blocking)


def to_host(backend: SimBackend, t: torch.Tensor, dtype: torch.dtype, non_blocking: bool) -> Any:
    # As torch does on CUDA: a non_blocking download lands in pinned memory, so it can be async.
    with backend.placing(False):
        out = torch.empty_like(t, dtype=dtype, device=CPU)
    if non_blocking:
        backend.register_pinned(out)
    return out.copy_(t, non_blocking=non_blocking)


Handler = Callable[["SimBackend", Any, tuple[Any, ...], dict[str, Any]], Any]
"""A call's stand-in: (backend, the torch function, its args, its kwargs) -> its result."""
