"""Where a Python call puts its tensors on the sim: the device mode's handlers for the calls that
name the sim device or pinned memory (device.py's docstring says why they cannot reach the
dispatcher): factories with `device=` the sim device, `torch.tensor(data, device=)` (an upload from
the host), `.to(...)` and the argument parsing `Tensor.to` and `nn.Module.to` share, `.cuda()`,
`.cpu()`, `.type_as(...)`, `pin_memory=True`, `.pin_memory()`, `.is_pinned()`,
`x.new_tensor(...)`, `one_hot` of device ids, and `x.data = y` (how `nn.Module.to` moves a
parameter: it takes its class's device twin, device.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pytest_graphmode.runtime.backends.sim.device import (
    CPU,
    SIM_DEVICE,
    Handler,
    SimDeviceTensor,
    device_parameter_class,
    host_parameter_class,
    is_index,
    is_movable_parameter,
    is_sim_device,
    mark_device,
    on_device,
    to_device,
    to_host,
)

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.backend import SimBackend


def factory(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call with `device=` or `pin_memory=`: made on the CPU, then placed where it was asked."""
    device = kwargs.get("device")
    if device is not None and is_sim_device(device):
        if func in _UPLOADS and not (args and on_device(args[0])):
            return _upload(backend, func, args, kwargs)
        with backend.placing(True):
            return mark_device(func(*args, **dict(kwargs, device=CPU)))
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
    host_kwargs = dict(kwargs, device=CPU)
    host_kwargs.pop("pin_memory", None)
    with backend.placing(False):
        host = func(*args, **host_kwargs)
    return to_device(backend, host, host.dtype, non_blocking=False)


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
    onto_device = on_device(self) if target is None else is_sim_device(target)
    if onto_device == on_device(self):
        # No crossing: torch sees a CPU tensor going to the CPU.
        rest = tuple(CPU if is_sim_device(a) else a for a in rest)
        if "device" in kwargs:
            kwargs = dict(kwargs, device=CPU)
        return func(self, *rest, **kwargs)
    dtype = dtype if dtype is not None else self.dtype
    if onto_device:
        return to_device(backend, self, dtype, non_blocking)
    return to_host(backend, self, dtype, non_blocking)


def _parse_to(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # How `Tensor.to` and `nn.Module.to` parse their arguments. Not a factory: its `device=` is
    # the answer, which must stay the sim device. torch asks its accelerator what a bare index
    # (`module.to(device=rank)`, `x.to(0)`) means, and a host without one raises: name the
    # sim device instead.
    if args and is_index(args[0]):
        args = (torch.device("cuda", args[0]), *args[1:])
    if is_index(kwargs.get("device")):
        kwargs = dict(kwargs, device=torch.device("cuda", kwargs["device"]))
    return func(*args, **kwargs)


def _cuda(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if on_device(self):
        return self
    return to_device(backend, self, self.dtype, non_blocking)


def _cpu(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    if not on_device(self):
        return func(*args, **kwargs)
    return to_host(backend, self, self.dtype, non_blocking=False)


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
    return factory(backend, torch.tensor, args[1:], kwargs)


def _set_data(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # `x.data = y` keeps x's Python object (nn.Module.to moves parameters so): x takes y's side.
    target, value = args
    func(target, value)
    device = on_device(value)
    if is_movable_parameter(target):
        host = host_parameter_class(type(target))
        target.__class__ = device_parameter_class(host) if device else host
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


_UPLOADS = {torch.tensor, torch.as_tensor, torch.asarray}


HANDLERS: dict[Any, Handler] = {
    torch.Tensor.to: _to,
    torch._C._nn._parse_to: _parse_to,
    torch.Tensor.cuda: _cuda,
    torch.Tensor.cpu: _cpu,
    torch.Tensor.pin_memory: _pin_memory,
    torch.Tensor.is_pinned: _is_pinned,
    torch.Tensor.new_tensor: _new_tensor,
    torch.Tensor.type_as: _type_as,
    torch.nn.functional.one_hot: _one_hot,
    # `x.data = y`: the property's setter, as torch function modes see it
    torch._C.TensorBase.__dict__["data"].__set__: _set_data,
}
