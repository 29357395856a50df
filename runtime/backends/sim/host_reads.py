"""What the host reads of a device tensor on the sim, as on CUDA: the device mode's handlers for
`.numpy()` and `numpy.asarray` (refused), `.numpy(force=True)`, printing and formatting (reads that
wait for the current stream, as a download does), the legacy type names (`torch.cuda.FloatTensor`),
`torch.get_device`, and sharing memory between processes (which leaves device memory in place).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pytest_graphmode.runtime.backends.sim.device import (
    SIM_DEVICE,
    Handler,
    on_device,
    to_device,
    to_host,
)

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.backend import SimBackend


def _numpy(backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # torch refuses device memory unless `force`, which copies it to the host first (a blocking
    # download that waits for the current stream).
    self = args[0]
    if not on_device(self):
        return func(*args, **kwargs)
    force = args[1] if len(args) > 1 else kwargs.get("force", False)
    if not force:
        raise TypeError(_NO_NUMPY.format(device=self.device))
    return to_host(backend, self.detach(), self.dtype, non_blocking=False).numpy(force=True)


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
        onto_device = target.startswith("torch.cuda.")
        target = getattr(torch, target.rsplit(".", 1)[-1])
    elif isinstance(target, torch.dtype):
        return func(*args, **kwargs)
    else:
        onto_device = bool(target.is_cuda)
    to = to_device if onto_device else to_host
    if onto_device == on_device(self) and target.dtype == self.dtype:
        return self
    return to(backend, self, target.dtype, non_blocking)


_NO_NUMPY = (
    "can't convert {device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
    "host memory first."
)


HANDLERS: dict[Any, Handler] = {
    torch.Tensor.numpy: _numpy,
    torch.Tensor.__array__: _array,
    torch.Tensor.__format__: _format,
    torch.Tensor.__repr__: _repr,
    torch.Tensor.share_memory_: _share_memory,
    torch.Tensor.is_shared: _is_shared,
    torch.Tensor.type: _type,
    torch.get_device: _get_device,
}
