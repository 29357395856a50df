"""The sim device: tensors that say they live on the GPU, over ordinary CPU storage.

A `SimDeviceTensor` is a plain subclass of `torch.Tensor` (no `__torch_function__` of its own, so
the class costs nothing per operation): C++ sees a CPU tensor and runs every kernel natively, while
Python sees `device == cuda:0`, `is_cuda`, `get_device() == 0`. The sim's dispatch mode keeps the
distinction alive: an operation with a device tensor argument is device work, and its new outputs
are made device tensors; an operation without one is host work.

Python calls that name a device never reach the dispatcher with it: torch's argument parser would
initialise CUDA (and fail without it) before any dispatch mode is asked. `DeviceMode`, a
`TorchFunctionMode` entered and left with the sim's activation, sees them first and rewrites them:
factories with `device=` the sim device, `torch.tensor(data, device=)` (an upload from the host),
`.to(...)`, `.cuda()`, `.cpu()`, `.type_as(...)`, `pin_memory=True`, `.pin_memory()`, `.is_pinned()`,
`.record_stream(...)`, factories under `torch.set_default_device("cuda")`, and `x.data = y` (how
`nn.Module.to` moves a parameter: it becomes a `SimDeviceParameter`). Crossings
between host and device become a fresh tensor on the other side and a `copy_` into it, so the
dispatch mode judges every crossing in one place (`SimBackend._cross`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _device as torch_default_device

from pytest_graphmode.runtime.backends.sim.generators import check_draw

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.backend import SimBackend

SIM_DEVICE = torch.device("cuda", 0)
"""What sim tensors report as their device (`SimBackend.device`)."""

_CPU = torch.device("cpu")


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
        if backend.is_active and not backend._passthrough:
            backend.host_read("saving a device tensor", self)
        return super().__reduce_ex__(proto)


class SimDeviceParameter(SimDeviceTensor, torch.nn.Parameter):
    """A module's parameter moved to the simulated GPU (`module.to("cuda")` sets its `.data`)."""


def patch_parameter_new() -> Callable[[], None]:
    """`nn.Parameter(data)` of a device tensor or parameter makes a `SimDeviceParameter`, as
    `nn.Parameter` of a CUDA tensor makes a parameter. (torch's own takes the sim's classes for
    tensor subclasses: it wants `detach()` to return the parameter's class, and refuses a device
    parameter, so `nn.Parameter(module.weight)` and weight-norm parametrizations failed.) Returns
    what puts torch's back."""
    original = torch.nn.Parameter.__dict__["__new__"]

    def new(cls: type, data: Any = None, requires_grad: bool = True) -> Any:
        if cls in _PARAMETER_CLASSES and isinstance(data, SimDeviceTensor):
            return torch.Tensor._make_subclass(SimDeviceParameter, data, requires_grad)
        return original.__func__(cls, data, requires_grad)

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


def is_sim_device(device: Any) -> bool:
    """Whether a `device=` argument names the simulated GPU (any CUDA device, or a bare index)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


_Handler = Callable[["SimBackend", Any, tuple[Any, ...], dict[str, Any]], Any]


class DeviceMode(TorchFunctionMode):
    """Rewrites the Python calls that name the sim device or pinned memory (module docstring).
    Every other call passes straight through."""

    def __init__(self, backend: SimBackend) -> None:
        super().__init__()
        self.backend = backend

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        threads = self.backend.threads
        if threads.alive:
            with threads.lock:
                return self._handle(func, args, kwargs or {})
        return self._handle(func, args, kwargs or {})

    def _handle(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs.get("generator") is not None and _on_the_device(func, args, kwargs):
            check_draw(self.backend, kwargs["generator"])
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(self.backend, func, args, kwargs)
        # `torch.set_default_device("cuda")` puts torch's own mode beneath this one, so a factory
        # without a device reaches it only after this mode let it through: name the device here.
        if torch_default_device.CURRENT_DEVICE is not None and kwargs.get("device") is None:
            default = _default_sim_device(func)
            if default is not None:
                return _factory(self.backend, func, args, dict(kwargs, device=default))
        if kwargs and ("device" in kwargs or "pin_memory" in kwargs):
            return _factory(self.backend, func, args, kwargs)
        return func(*args, **kwargs)


class FollowerDeviceMode(DeviceMode):
    """The device mode in a thread the sim started (threads.py): it passes every call through
    while the sim is not active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not self.backend.is_active:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def _on_the_device(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call runs on the sim device: it names the device, or torch's default device is
    the sim's and `func` makes tensors, or a tensor argument lives there."""
    device = kwargs.get("device")
    if device is not None:
        return is_sim_device(device)
    if torch_default_device.CURRENT_DEVICE is not None and _default_sim_device(func) is not None:
        return True
    return any(isinstance(a, SimDeviceTensor) for a in args)


def _default_sim_device(func: Any) -> torch.device | None:
    """torch's default device (`torch.set_default_device`), where it is a CUDA device and `func`
    is one of the factories that default applies to; else None."""
    default = torch_default_device.CURRENT_DEVICE
    if not is_sim_device(default) or func not in torch_default_device._device_constructors():
        return None
    return default


def _factory(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call with `device=` or `pin_memory=`: made on the CPU, then placed where it was asked."""
    device = kwargs.get("device")
    if device is not None and is_sim_device(device):
        if func in _UPLOADS and not (args and on_device(args[0])):
            return _upload(backend, func, args, kwargs)
        with backend.placing(True):
            return mark_device(func(*args, **dict(kwargs, device=_CPU)))
    if kwargs.get("pin_memory"):
        with backend.placing(False):
            made = func(*args, **dict(kwargs, pin_memory=False))
        backend.register_pinned(made)
        return made
    if device is None:
        return func(*args, **kwargs)
    with backend.placing(False):
        return func(*args, **kwargs)


def _upload(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`torch.tensor(data, device=gpu)` and friends: the data is made on the host, then copied to
    the device with a blocking copy, as torch does on CUDA (so a capture refuses it)."""
    host_kwargs = dict(kwargs, device=_CPU)
    host_kwargs.pop("pin_memory", None)
    with backend.placing(False):
        host = func(*args, **host_kwargs)
    return _to_device(backend, host, host.dtype, non_blocking=False)


def _to_device(backend: SimBackend, t: torch.Tensor, dtype: torch.dtype, non_blocking: bool) -> Any:
    with backend.placing(True):
        out = mark_device(torch.empty_like(t, dtype=dtype, device=_CPU))
    return out.copy_(t, non_blocking=non_blocking)


def _to_host(backend: SimBackend, t: torch.Tensor, dtype: torch.dtype, non_blocking: bool) -> Any:
    # As torch does on CUDA: a non_blocking download lands in pinned memory, so it can be async.
    with backend.placing(False):
        out = torch.empty_like(t, dtype=dtype, device=_CPU)
    if non_blocking:
        backend.register_pinned(out)
    return out.copy_(t, non_blocking=non_blocking)


def _to(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self, rest = args[0], args[1:]
    if rest and isinstance(rest[0], torch.Tensor):
        other = rest[0]
        target: Any = other.device
        dtype = other.dtype
        non_blocking = bool(rest[1]) if len(rest) > 1 else bool(kwargs.get("non_blocking", False))
        rest = (target, dtype, *rest[1:])
    else:
        # `copy` is no concern of where the result goes (a crossing always copies)
        parsed = {k: v for k, v in kwargs.items() if k != "copy"}
        target, dtype, non_blocking, _ = _parse_to(backend, torch._C._nn._parse_to, rest, parsed)
    to_device = on_device(self) if target is None else is_sim_device(target)
    if to_device == on_device(self):
        # No crossing: torch sees a CPU tensor going to the CPU.
        rest = tuple(_CPU if is_sim_device(a) else a for a in rest)
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_CPU)
        return func(self, *rest, **kwargs)
    dtype = dtype if dtype is not None else self.dtype
    if to_device:
        return _to_device(backend, self, dtype, non_blocking)
    return _to_host(backend, self, dtype, non_blocking)


def _parse_to(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # How `Tensor.to` and `nn.Module.to` parse their arguments. Not a factory: its `device=` is
    # the answer, which must stay the sim device. torch asks its accelerator what a bare index
    # (`module.to(device=rank)`, `x.to(0)`) means, and a host without one raises: name the
    # sim device instead.
    if args and _is_index(args[0]):
        args = (torch.device("cuda", args[0]), *args[1:])
    if _is_index(kwargs.get("device")):
        kwargs = dict(kwargs, device=torch.device("cuda", kwargs["device"]))
    return func(*args, **kwargs)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cuda(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if on_device(self):
        return self
    return _to_device(backend, self, self.dtype, non_blocking)


def _cpu(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    if not on_device(self):
        return func(*args, **kwargs)
    return _to_host(backend, self, self.dtype, non_blocking=False)


def _pin_memory(
    backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    self = args[0]
    if on_device(self):
        raise RuntimeError(f"cannot pin '{self.device}' memory: only host memory can be pinned")
    if backend.is_pinned(self):
        return self
    with backend.placing(False):
        pinned = torch.empty_like(self)
    backend.register_pinned(pinned)
    return pinned.copy_(self)


def _is_pinned(
    backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    self = args[0]
    return not on_device(self) and backend.is_pinned(self)


def _new_tensor(
    backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    # `x.new_tensor(data)` builds on x's device: for a device x, an upload from the host.
    self = args[0]
    kwargs = dict(kwargs)
    if on_device(self):
        kwargs.setdefault("device", SIM_DEVICE)
    kwargs.setdefault("dtype", self.dtype)
    return _factory(backend, torch.tensor, args[1:], kwargs)


def _set_data(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # `x.data = y` keeps x's Python object (nn.Module.to moves parameters so): x takes y's side.
    target, value = args
    func(target, value)
    device = on_device(value)
    if isinstance(target, torch.nn.Parameter) and type(target) in _PARAMETER_CLASSES:
        target.__class__ = SimDeviceParameter if device else torch.nn.Parameter
    elif type(target) in (torch.Tensor, SimDeviceTensor):
        target.__class__ = SimDeviceTensor if device else torch.Tensor
    return None


def _type_as(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # torch reads the target from `other.type()`, a CPU type name for a sim tensor: it is `.to`
    # with other's dtype and side.
    other = args[1] if len(args) > 1 else kwargs["other"]
    return _to(backend, torch.Tensor.to, (args[0], other), {})


def _one_hot(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # torch's one_hot checks the class values on the host, with .item(), on every device but
    # CUDA, which leaves them to the scatter's device-side assert. For a device input the sim
    # does what CUDA does: a capture takes it with num_classes given; without, CUDA too reads
    # the largest value on the host. (torch's own version would also make its output on the
    # host: the sim device's tensors are CPU tensors to C++.)
    index = args[0] if args else kwargs["input"]
    classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if not on_device(index):
        return func(*args, **kwargs)
    if index.dtype != torch.int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if classes == -1:
        classes = int(index.max()) + 1  # a host read, as on CUDA
    return index.new_zeros((*index.shape, classes)).scatter_(-1, index.unsqueeze(-1), 1)


def _numpy(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # torch refuses device memory unless `force`, which copies it to the host first (a blocking
    # download that waits for the current stream).
    self = args[0]
    if not on_device(self):
        return func(*args, **kwargs)
    force = args[1] if len(args) > 1 else kwargs.get("force", False)
    if not force:
        raise TypeError(_NO_NUMPY.format(device=self.device))
    return _to_host(backend, self.detach(), self.dtype, non_blocking=False).numpy(force=True)


def _array(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # `numpy.asarray(t)`: torch's `__array__` calls `t.numpy()`, which refuses device memory.
    if on_device(args[0]):
        raise TypeError(_NO_NUMPY.format(device=args[0].device))
    return func(*args, **kwargs)


def _format(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # torch formats a plain 0-dim tensor as its number (read with `.item()`, a host read); it
    # tells a subclass apart by its class, which would make `f"{loss:.3f}"` raise on the sim.
    self, spec = args[0], args[1] if len(args) > 1 else kwargs["format_spec"]
    if not on_device(self):
        return func(*args, **kwargs)
    if self.dim() == 0:
        return self.item().__format__(spec)
    if spec:
        raise TypeError("unsupported format string passed to Tensor.__format__")
    return _repr(backend, torch.Tensor.__repr__, (self,), {})


def _repr(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Printing reads the values, as a download does: it waits for the current stream (torch's
    # printing turns every mode off, so it would show memory as queued work left it). torch
    # names a subclass by its class and indents by that name: the sim's classes print as
    # `tensor(`, as CUDA's tensors do.
    self = args[0]
    if not on_device(self):
        return func(*args, **kwargs)
    if not backend._passthrough:
        backend.host_read("Tensor.__repr__", self)
    cls = type(self)
    name = cls.__name__
    cls.__name__ = "tensor"
    try:
        text = func(*args, **kwargs)
    finally:
        cls.__name__ = name
    # `Parameter.__repr__` adds "Parameter containing:" itself; torch also wraps a subclass's
    # parameter in "Parameter(...)".
    if isinstance(self, torch.nn.Parameter) and text.startswith("Parameter("):
        text = text[len("Parameter(") : -1]
    return text


def _share_memory(
    backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    # Device memory is shared between processes by IPC handles, not moved: torch leaves a CUDA
    # tensor as it is. (The sim's CPU storage would move into shared memory, away from the
    # addresses captured graphs hold.)
    return args[0] if on_device(args[0]) else func(*args, **kwargs)


def _is_shared(
    backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    # torch answers True for every CUDA tensor: device memory can always be shared by IPC.
    return True if on_device(args[0]) else func(*args, **kwargs)


def _get_device(
    backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    return SIM_DEVICE.index if on_device(args[0]) else func(*args, **kwargs)


def _type(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # The legacy type names: a device tensor's is `torch.cuda.FloatTensor`, and converting to a
    # `torch.cuda.*` type (a name or torch's type object) moves to the device, to a CPU type to
    # the host.
    self = args[0]
    target = args[1] if len(args) > 1 else kwargs.get("dtype")
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if target is None:
        name = func(self)
        return name.replace("torch.", "torch.cuda.", 1) if on_device(self) else name
    if isinstance(target, str):
        if not target.startswith("torch."):
            return func(*args, **kwargs)
        to_device = target.startswith("torch.cuda.")
        target = getattr(torch, target.rsplit(".", 1)[-1])
    elif isinstance(target, torch.dtype):
        return func(*args, **kwargs)
    else:
        to_device = bool(target.is_cuda)
    to = _to_device if to_device else _to_host
    if to_device == on_device(self) and target.dtype == self.dtype:
        return self
    return to(backend, self, target.dtype, non_blocking)


_NO_NUMPY = (
    "can't convert {device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
    "host memory first."
)


_PARAMETER_CLASSES = (torch.nn.Parameter, SimDeviceParameter)
_UPLOADS = {torch.tensor, torch.as_tensor, torch.asarray}

_HANDLERS: dict[Any, _Handler] = {
    torch.Tensor.to: _to,
    torch._C._nn._parse_to: _parse_to,
    torch.Tensor.cuda: _cuda,
    torch.Tensor.cpu: _cpu,
    torch.Tensor.pin_memory: _pin_memory,
    torch.Tensor.is_pinned: _is_pinned,
    torch.Tensor.new_tensor: _new_tensor,
    torch.Tensor.type_as: _type_as,
    torch.nn.functional.one_hot: _one_hot,
    torch.Tensor.numpy: _numpy,
    torch.Tensor.__array__: _array,
    torch.Tensor.__format__: _format,
    torch.Tensor.__repr__: _repr,
    torch.Tensor.share_memory_: _share_memory,
    torch.Tensor.is_shared: _is_shared,
    torch.Tensor.type: _type,
    torch.get_device: _get_device,
    # `x.data = y`: the property's setter, as torch function modes see it
    torch._C.TensorBase.__dict__["data"].__set__: _set_data,
}
