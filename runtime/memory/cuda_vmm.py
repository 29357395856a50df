"""The CUDA VMM pool: one physical pool of chunks that only grows, one virtual view per capture.

Each view is its own reserved address range with its own `torch.cuda.MemPool`, whose pluggable
allocator bump-allocates segments from the view's offset 0 and maps the pool's physical chunks
into the view as far as its segments reach. Capturing graph `k` with
`torch.cuda.graph(g, pool=pool.new_view(k).pool_id)` routes every allocation of that capture into
`k`'s view: every graph keeps its own stable addresses (no allocator record is ever overwritten)
while all graphs share one set of physical chunks, so physical memory is the largest capture's
need whatever the capture order. Graphs sharing the pool must never run concurrently.

Lifetime: a closed view unmaps itself once PyTorch has handed back all its segments (after its
graphs and tensors are gone and the cache is emptied); until then its callbacks stay alive. The
physical chunks are released on `close()`; the driver frees each one when its last mapping goes.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch

from pytest_graphmode.contract import AddressView

from . import _driver
from .errors import PoolError, PoolExhaustedError
from .ledger import Ledger, MemoryStats, align_up

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

SEGMENT_ALIGNMENT = 512  # PyTorch's smallest block size; segments start on it
_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_pool_ids = itertools.count()
# Closed views that PyTorch still holds segments of: their callbacks must outlive the pool object.
_unreleased_views: set[CudaView] = set()


class CudaView:
    """One capture's view: a reserved range, its MemPool, and the callbacks that feed it."""

    def __init__(self, pool: CudaVmmPool, key: Hashable, capacity: int) -> None:
        self.key = key
        self.capacity = capacity
        self.mapped_bytes = 0
        self.accessible_bytes = 0
        self.sealed = False
        self.closed = False
        self.unmapped = False
        self.error: BaseException | None = None
        self._pool = pool
        self._cursor = 0
        self._segments: dict[int, int] = {}
        driver = pool._driver
        # Relaxed: a global-mode capture on any thread forbids reserving address space otherwise.
        with _driver.relaxed_capture_mode(driver):
            address = _driver.check(
                driver,
                driver.cuMemAddressReserve(capacity, pool.granularity, 0, 0),
                "cuMemAddressReserve",
            )
        self.base = int(address)
        # PyTorch keeps only the raw function pointers: these objects must stay alive.
        self._alloc_fn = _ALLOC_FN(self._malloc)
        self._free_fn = _FREE_FN(self._free)
        try:
            self._allocator = torch._C._cuda_customAllocator(
                _function_address(self._alloc_fn), _function_address(self._free_fn)
            )
            with torch.cuda.device(pool.device):
                self.mempool: torch.cuda.MemPool | None = torch.cuda.MemPool(self._allocator)
        except BaseException:
            _driver.check(driver, driver.cuMemAddressFree(self.base, capacity), "cuMemAddressFree")
            raise
        self.pool_id = self.mempool.id

    def seal(self) -> None:
        self.sealed = True

    def _malloc(self, size: int, device: int, stream: int | None) -> int | None:
        try:
            with _driver.relaxed_capture_mode(self._pool._driver):
                return self._allocate_segment(size, device)
        except BaseException as error:  # a callback cannot raise: PyTorch sees NULL and OOMs
            self.error = error
            return None

    def _allocate_segment(self, size: int, device: int) -> int:
        if self.closed:
            raise PoolError(f"the view of graph {self.key!r} is closed")
        if device != self._pool.device:
            raise PoolError(
                f"the view of graph {self.key!r} lives on cuda:{self._pool.device},"
                f" not cuda:{device}"
            )
        if self.sealed:
            raise PoolError(
                f"the capture of graph {self.key!r} has ended; its view takes no new allocations"
                " (memory allocated after capture is not part of the graph: allocate it before)"
            )
        start = align_up(self._cursor, SEGMENT_ALIGNMENT)
        end = start + size
        if end > self.capacity:
            raise PoolExhaustedError(
                f"the view of graph {self.key!r} needs {end} bytes but reserves {self.capacity};"
                " make the pool with a larger view_capacity"
            )
        self._pool._map_through(self, end)
        self._cursor = end
        self._segments[self.base + start] = size
        return self.base + start

    def _free(self, ptr: int | None, size: int, device: int, stream: int | None) -> None:
        try:
            self._segments.pop(ptr or 0)
            self._unmap_if_unused()
        except BaseException as error:  # a callback cannot raise
            self.error = error

    def _close(self) -> None:
        self.closed = True
        # Registered before the pool goes: dropping it hands segments back through _free, which
        # unregisters the view once the last one is gone.
        _unreleased_views.add(self)
        self.mempool = None
        # Segments nothing uses any more come back through _free now; the rest when they die.
        torch.cuda.empty_cache()
        self._unmap_if_unused()

    def _unmap_if_unused(self) -> None:
        if not self.closed or self._segments or self.unmapped:
            return
        driver = self._pool._driver
        with _driver.relaxed_capture_mode(driver):
            if self.mapped_bytes:
                _driver.check(driver, driver.cuMemUnmap(self.base, self.mapped_bytes), "cuMemUnmap")
            _driver.check(
                driver, driver.cuMemAddressFree(self.base, self.capacity), "cuMemAddressFree"
            )
        self.mapped_bytes = self.accessible_bytes = 0
        self.unmapped = True
        _unreleased_views.discard(self)


def _function_address(function: CFuncPtr) -> int:
    address = ctypes.cast(function, ctypes.c_void_p).value
    if address is None:
        raise PoolError("ctypes returned a NULL pointer for an allocator callback")
    return int(address)


class CudaVmmPool:
    """Physical chunks of `granularity` bytes on one device, and one `CudaView` per graph key.

    `granularity` defaults to (and must be a multiple of) the device's minimum VMM granularity;
    `view_capacity` (the address space each view reserves, rounded up to whole chunks) defaults
    to the device's memory size.
    """

    def __init__(
        self,
        device: int | None = None,
        *,
        granularity: int | None = None,
        view_capacity: int | None = None,
    ) -> None:
        driver = _driver.load_driver()
        self.device = torch.cuda.current_device() if device is None else device
        _driver.require_vmm_device(driver, self.device)
        self._driver = driver
        self._prop = _driver.allocation_prop(driver, self.device)
        self._access = _driver.read_write_access(driver, self.device)
        self._device_handle = _driver.make_current(driver, self.device)
        try:
            self.granularity = self._checked_granularity(granularity)
            if view_capacity is None:
                view_capacity = torch.cuda.get_device_properties(self.device).total_memory
            if view_capacity <= 0:
                raise ValueError(f"view_capacity {view_capacity} must be positive")
        except BaseException:
            driver.cuDevicePrimaryCtxRelease(self._device_handle)
            raise
        self.view_capacity = align_up(view_capacity, self.granularity)
        self._chunks: list[Any] = []
        self._closed = False
        self._ledger = Ledger(f"cuda-vmm:{self.device}:{next(_pool_ids)}")
        self._views: dict[Hashable, CudaView] = {}

    @property
    def name(self) -> str:
        return self._ledger.physical

    @property
    def physical_bytes(self) -> int:
        return len(self._chunks) * self.granularity

    def _checked_granularity(self, granularity: int | None) -> int:
        minimum = _driver.minimum_granularity(self._driver, self._prop)
        if granularity is None:
            return minimum
        if granularity <= 0 or granularity % minimum:
            raise ValueError(
                f"granularity {granularity} must be a positive multiple of cuda:{self.device}'s"
                f" VMM granularity {minimum}"
            )
        return granularity

    def new_view(self, key: Hashable) -> CudaView:
        if self._closed:
            raise PoolError(f"CUDA VMM pool {self.name} is closed")
        if key in self._views:
            raise PoolError(
                f"graph key {key!r} already has a view; discard it before capturing again"
            )
        view = CudaView(self, key, self.view_capacity)
        self._ledger.open(key, view.base)
        self._views[key] = view
        return view

    def __contains__(self, key: object) -> bool:
        return key in self._views

    def view(self, key: Hashable) -> CudaView:
        if key not in self._views:
            raise KeyError(f"no view for graph key {key!r}; known: {list(self._views)}")
        return self._views[key]

    def allocation_error(self, key: Hashable) -> BaseException | None:
        """The real cause of the last failed allocation of `key`'s capture (PyTorch only reports
        a generic out-of-memory error)."""
        return self.view(key).error

    def discard(self, key: Hashable) -> None:
        view = self.view(key)
        del self._views[key]
        self._ledger.close(key)
        view._close()

    def views(self) -> list[AddressView]:
        return self._ledger.views()

    def stats(self) -> MemoryStats:
        return MemoryStats(self.physical_bytes, self._ledger.virtual_bytes(), len(self._ledger))

    def close(self) -> None:
        """Close every view, then release the physical chunks (freed by the driver once no view
        maps them any more)."""
        if self._closed:
            return
        for key in list(self._views):
            self.discard(key)
        # Views discarded earlier may have lost their last tensors since: hand those segments back.
        torch.cuda.empty_cache()
        if any(view._pool is self for view in _unreleased_views):
            # Graphs caught in reference cycles (torch's capture context can keep some) hold
            # their segments until the cycle collector runs. Collected only when a view is still
            # held: a full collection walks every object of the process.
            gc.collect()
            torch.cuda.empty_cache()
        driver = self._driver
        with _driver.relaxed_capture_mode(driver):
            while self._chunks:
                _driver.check(driver, driver.cuMemRelease(self._chunks.pop()), "cuMemRelease")
        _driver.check(
            driver,
            driver.cuDevicePrimaryCtxRelease(self._device_handle),
            "cuDevicePrimaryCtxRelease",
        )
        self._closed = True

    def __enter__(self) -> CudaVmmPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _map_through(self, view: CudaView, end: int) -> None:
        """Make `[0, end)` of `view` usable: create the chunks no view reached yet, map the ones
        this view lacks, and grant the device access to them."""
        driver = self._driver
        needed = align_up(end, self.granularity)
        while self.physical_bytes < needed:
            self._chunks.append(
                _driver.check(
                    driver, driver.cuMemCreate(self.granularity, self._prop, 0), "cuMemCreate"
                )
            )
        while view.mapped_bytes < needed:
            chunk = self._chunks[view.mapped_bytes // self.granularity]
            address = view.base + view.mapped_bytes
            _driver.check(
                driver, driver.cuMemMap(address, self.granularity, 0, chunk, 0), "cuMemMap"
            )
            view.mapped_bytes += self.granularity
        if view.accessible_bytes < needed:
            start = view.accessible_bytes
            _driver.check(
                driver,
                driver.cuMemSetAccess(view.base + start, needed - start, [self._access], 1),
                "cuMemSetAccess",
            )
            view.accessible_bytes = needed
            self._ledger.grow(view.key, needed)
