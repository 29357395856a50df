"""CUDA driver access for the VMM pool, through `cuda.bindings`, with errors that name the call.

Imported only when the `vmm` strategy runs on CUDA; every missing piece becomes a
`VmmUnsupportedError` whose reason says what to install or change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from .errors import PoolError, VmmUnsupportedError

MIN_TORCH = (2, 8)  # MemPool(allocator) usable as a graph pool: torch.cuda.graph(g, pool=pool.id)


class CudaDriverError(PoolError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def load_driver() -> ModuleType:
    """The `cuda.bindings.driver` module, once everything the VMM pool needs is known to exist."""
    if _torch_version() < MIN_TORCH:
        raise VmmUnsupportedError(
            f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}, the first"
            " release whose MemPool with a pluggable allocator can be a graph pool; upgrade torch"
        )
    if not torch.cuda.is_available():
        raise VmmUnsupportedError("CUDA is not available (no GPU, or a CPU-only torch build)")
    if not (hasattr(torch.cuda, "MemPool") and hasattr(torch._C, "_cuda_customAllocator")):
        raise VmmUnsupportedError(
            f"torch {torch.__version__} lacks torch.cuda.MemPool or pluggable allocators"
        )
    try:
        from cuda.bindings import driver
    except ImportError as error:
        raise VmmUnsupportedError(
            f"cuda.bindings is not importable ({error}); install cuda-bindings matching your"
            " driver: pip install 'pytest-graphmode[cuda]'"
        ) from error
    check(driver, driver.cuInit(0), "cuInit")
    return driver


def require_vmm_device(driver: ModuleType, device: int) -> None:
    handle = check(driver, driver.cuDeviceGet(device), "cuDeviceGet")
    attribute = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    if not check(driver, driver.cuDeviceGetAttribute(attribute, handle), "cuDeviceGetAttribute"):
        raise VmmUnsupportedError(
            f"CUDA device {device} does not support virtual memory management"
        )


def check(driver: ModuleType, result: Any, call: str) -> Any:
    """Unpack a cuda.bindings result tuple `(error, *values)`, raising `CudaDriverError`."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if error != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(error)
        _, text = driver.cuGetErrorString(error)
        raise CudaDriverError(f"{call} failed: {_decode(name)}: {_decode(text)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _decode(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@contextmanager
def relaxed_capture_mode(driver: ModuleType) -> Iterator[None]:
    """Let this thread make driver calls that a capture in global mode would forbid (PyTorch does
    the same around its own cudaMalloc during capture). The calls are not captured: they take
    effect now, and the graph only records the addresses they produce."""
    relaxed = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    previous = check(
        driver,
        driver.cuThreadExchangeStreamCaptureMode(relaxed),
        "cuThreadExchangeStreamCaptureMode",
    )
    try:
        yield
    finally:
        check(
            driver,
            driver.cuThreadExchangeStreamCaptureMode(previous),
            "cuThreadExchangeStreamCaptureMode",
        )


def make_current(driver: ModuleType, device: int) -> Any:
    """Retain `device`'s primary context (the one PyTorch uses) and make it current if this thread
    has none, so that addresses the driver hands out are valid for PyTorch's kernels."""
    handle = check(driver, driver.cuDeviceGet(device), "cuDeviceGet")
    context = check(driver, driver.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
    current = check(driver, driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if current is None or int(current) == 0:
        check(driver, driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return handle


def allocation_prop(driver: ModuleType, device: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    return prop


def read_write_access(driver: ModuleType, device: int) -> Any:
    access = driver.CUmemAccessDesc()
    access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return access


def minimum_granularity(driver: ModuleType, prop: Any) -> int:
    option = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(
        check(
            driver,
            driver.cuMemGetAllocationGranularity(prop, option),
            "cuMemGetAllocationGranularity",
        )
    )
