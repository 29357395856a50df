"""The sim's torch function mode: it sees every Python-level torch call while the sim is active
and hands the calls that name the sim device or pinned memory (placement.py) and the host's reads
of device tensors (host_reads.py) to their handlers. Every other call passes straight through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _device as torch_default_device

from pytest_graphmode.runtime.backends.sim import attention, host_reads, placement
from pytest_graphmode.runtime.backends.sim.device import (
    Handler,
    SimDeviceTensor,
    call_through,
    is_sim_device,
)
from pytest_graphmode.runtime.backends.sim.generators import check_draw

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.backend import SimBackend


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
                return placement.factory(self.backend, func, args, dict(kwargs, device=default))
        if kwargs and ("device" in kwargs or "pin_memory" in kwargs):
            return placement.factory(self.backend, func, args, kwargs)
        return call_through(self.backend, func, args, kwargs)


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


_HANDLERS: dict[Any, Handler] = {
    **placement.HANDLERS,
    **host_reads.HANDLERS,
    **attention.HANDLERS,
}
