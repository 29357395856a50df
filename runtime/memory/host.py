"""The host pool: one physical pool (a memfd that only grows) and one virtual view per capture.

Every view is its own reserved address range; the file's pages are mapped into it from offset 0 as
its capture needs them, so all views alias the same physical pages exactly as CUDA VMM views alias
the same physical chunks: a write through one view is visible through every other view, and the
physical size is the largest view's need, whatever order the captures came in.

Inside a view, blocks the capture releases are reused by its later allocations, as in a CUDA
graph's private pool (replay keeps the order in which the capture used them).

Lifetime: a tensor handed out by a view keeps that view's mapping alive (its storage references
the view's address range). Closing or discarding a view therefore never invalidates live tensors:
the range is unmapped once the view is closed *and* the last tensor over it is gone. The physical
pages go back to the kernel when the last mapping of the file goes.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import weakref
from collections.abc import Hashable

import torch

from pytest_graphmode.contract import AddressView

from . import _libc
from .errors import PoolError, PoolExhaustedError, VmmUnsupportedError
from .ledger import Ledger, MemoryStats, align_up

DEFAULT_GRANULARITY = 2 << 20
DEFAULT_VIEW_CAPACITY = 4 << 30
BLOCK_ALIGNMENT = 256  # what CUDA guarantees for device allocations; the sim carves typed tensors
_pool_ids = itertools.count()


def _reserve_view(size: int) -> ctypes.Array[ctypes.c_uint8]:
    """Reserve `size` bytes of address space as a byte array that tensors can be made over; the
    range is unmapped when the last reference to the array goes (the view's or a tensor's)."""
    base = _libc.reserve(size)
    buffer = (ctypes.c_uint8 * size).from_address(base)
    weakref.finalize(buffer, _libc.unmap, base, size)
    return buffer


class HostView:
    """One capture's virtual view. Implements the sim backend's capture-pool protocol
    (`allocate`, `release`): blocks come from offset 0 upwards, best fit among released ones."""

    def __init__(self, pool: HostPool, key: Hashable, capacity: int) -> None:
        self.key = key
        self.capacity = capacity
        self.mapped_bytes = 0
        self.sealed = False
        self._pool: HostPool | None = pool
        self._buffer: ctypes.Array[ctypes.c_uint8] | None = _reserve_view(capacity)
        self.base = ctypes.addressof(self._buffer)
        self._cursor = 0  # everything at or above it is free
        self._free: list[tuple[int, int]] = []  # released [start, end) below the cursor, sorted

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly `nbytes` at a 256-byte aligned address inside this view.
        A zero-byte block still owns an aligned byte (its storage's address), though PyTorch
        reports `data_ptr() == 0` for every empty tensor."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes: the size must be >= 0")
        pool, buffer = self._open()
        if self.sealed:
            raise PoolError(
                f"the capture of graph {self.key!r} has ended; its view takes no new allocations"
                " (memory allocated after capture is not part of the graph: allocate it before)"
            )
        size = align_up(max(nbytes, 1), BLOCK_ALIGNMENT)  # a zero-byte block has an address too
        start = self._take_free(size)
        if start is None:
            start = self._cursor
            if start + size > self.capacity:
                raise PoolExhaustedError(
                    f"the view of graph {self.key!r} needs {start + size} bytes but reserves"
                    f" {self.capacity}; make the pool with a larger view_capacity"
                )
            pool._map_through(self, start + size)
            self._cursor = start + size
        # The tensor's storage references `buffer`, which keeps the whole range mapped.
        block = torch.frombuffer(buffer, dtype=torch.uint8, count=size, offset=start)
        return block[:nbytes]

    def release(self, block: torch.Tensor) -> None:
        """The program freed `block`: later allocations of this capture may reuse its bytes."""
        storage = block.untyped_storage()  # a zero-byte block reports data_ptr() == 0
        start = storage.data_ptr() - self.base
        end = start + storage.nbytes()
        if not 0 <= start < end <= self._cursor:
            raise PoolError(
                f"block at {storage.data_ptr():#x} is not a live block of the view of graph"
                f" {self.key!r} [{self.base:#x}, {self.base + self._cursor:#x}): it belongs"
                " elsewhere or was released already"
            )
        if any(s < end and start < e for s, e in self._free):
            raise PoolError(
                f"block at {storage.data_ptr():#x} of graph {self.key!r} was released twice"
            )
        self._free.append((start, end))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, e in self._free:
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
        if merged and merged[-1][1] == self._cursor:
            self._cursor = merged.pop()[0]
        self._free = merged

    def _take_free(self, size: int) -> int | None:
        """Best fit among released ranges: the start of a `size`-byte hole, now taken."""
        fits = [(e - s, i) for i, (s, e) in enumerate(self._free) if e - s >= size]
        if not fits:
            return None
        _, index = min(fits)
        start, end = self._free[index]
        if end - start == size:
            del self._free[index]
        else:
            self._free[index] = (start + size, end)
        return start

    def seal(self) -> None:
        self.sealed = True

    @property
    def closed(self) -> bool:
        return self._buffer is None

    def _open(self) -> tuple[HostPool, ctypes.Array[ctypes.c_uint8]]:
        if self._pool is None or self._buffer is None:
            raise PoolError(f"the view of graph {self.key!r} is closed")
        return self._pool, self._buffer

    def _close(self) -> None:
        self._pool = None
        self._buffer = None


class HostPool:
    """A physical memfd pool with one `HostView` per graph key.

    `granularity`: the chunk the physical pool grows by and views map by (a multiple of the page
    size); `view_capacity`: the address space each view reserves (nothing is committed for it).
    """

    def __init__(
        self, granularity: int = DEFAULT_GRANULARITY, view_capacity: int = DEFAULT_VIEW_CAPACITY
    ) -> None:
        if not sys.platform.startswith("linux"):
            raise VmmUnsupportedError(
                f"the host pool needs Linux (memfd_create, fixed mappings), not {sys.platform}"
            )
        if granularity <= 0 or granularity % _libc.PAGE_SIZE:
            raise ValueError(
                f"granularity {granularity} must be a positive multiple of the page size"
                f" ({_libc.PAGE_SIZE})"
            )
        if view_capacity < granularity:
            raise ValueError(f"view_capacity {view_capacity} is below granularity {granularity}")
        self.granularity = granularity
        self.view_capacity = align_up(view_capacity, granularity)
        name = f"graph-pool-{os.getpid()}-{next(_pool_ids)}"
        self._fd: int | None = os.memfd_create(name, os.MFD_CLOEXEC)
        # A pool dropped without close() still gives its descriptor back; mappings keep the file
        # alive for tensors that outlive the pool.
        self._release_fd = weakref.finalize(self, os.close, self._fd)
        self.physical_bytes = 0
        self._ledger = Ledger(f"host:{name}")
        self._views: dict[Hashable, HostView] = {}

    @property
    def name(self) -> str:
        return self._ledger.physical

    def new_view(self, key: Hashable) -> HostView:
        self._require_open()
        if key in self._views:
            raise PoolError(
                f"graph key {key!r} already has a view; discard it before capturing again"
            )
        view = HostView(self, key, self.view_capacity)
        self._ledger.open(key, view.base)
        self._views[key] = view
        return view

    def __contains__(self, key: object) -> bool:
        return key in self._views

    def view(self, key: Hashable) -> HostView:
        if key not in self._views:
            raise KeyError(f"no view for graph key {key!r}; known: {list(self._views)}")
        return self._views[key]

    def discard(self, key: Hashable) -> None:
        """Forget `key`'s view; its range is unmapped once no tensor over it is alive. The
        physical pool keeps its size (it only grows)."""
        self.view(key)._close()
        del self._views[key]
        self._ledger.close(key)

    def views(self) -> list[AddressView]:
        return self._ledger.views()

    def stats(self) -> MemoryStats:
        return MemoryStats(self.physical_bytes, self._ledger.virtual_bytes(), len(self._ledger))

    def close(self) -> None:
        """Close every view and the file; memory still used by live tensors goes when they do."""
        for key in list(self._views):
            self.discard(key)
        self._release_fd()
        self._fd = None
        self.physical_bytes = 0

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _require_open(self) -> int:
        if self._fd is None:
            raise PoolError(f"host pool {self.name} is closed")
        return self._fd

    def _map_through(self, view: HostView, end: int) -> None:
        """Make `[0, end)` of `view` usable: grow the file if no view reached this far yet, then
        map the chunks this view lacks."""
        fd = self._require_open()
        needed = align_up(end, self.granularity)
        if needed <= view.mapped_bytes:
            return
        if needed > self.physical_bytes:
            os.ftruncate(fd, needed)
            self.physical_bytes = needed
        start = view.mapped_bytes
        _libc.map_shared(view.base + start, needed - start, fd, start)
        view.mapped_bytes = needed
        self._ledger.grow(view.key, needed)
