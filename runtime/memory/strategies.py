"""Executor memory strategies: where each captured graph's memory comes from.

- `separate`: a private pool per graph; physical memory grows with the sum of all graphs' needs.
- `shared`: one pool for all graphs (capture largest first); reuse depends on capture order.
- `vmm`: one physical pool, one virtual view per graph (`HostPool` on sim, `CudaVmmPool` on
  cuda); physical memory is the largest graph's need in any capture order.

The executor holds one `GraphMemory`, passes `pool_for(key)` as `backend.graph(g, pool=...)` right
before capturing `key`, then calls `captured(key)` or, if the capture failed or was invalidated,
`discard(key)`. None of these may be called while a capture is in progress.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, cast

import torch

from pytest_graphmode.contract import AddressView

from .cuda_vmm import CudaVmmPool
from .errors import PoolError
from .host import DEFAULT_GRANULARITY, HostPool
from .ledger import MemoryStats

STRATEGIES = ("separate", "shared", "vmm")


class PoolBackend(Protocol):
    """The part of `pytest_graphmode.runtime.backends.Backend` the strategies use."""

    @property
    def name(self) -> str: ...

    def graph_pool_handle(self) -> object: ...


class GraphMemory(Protocol):
    strategy: str

    def pool_for(self, key: Hashable) -> object: ...

    def holds(self, key: Hashable) -> bool:
        """Whether `key` has a pool: from `pool_for(key)` until `discard(key)`."""
        ...

    def captured(self, key: Hashable) -> None: ...

    def discard(self, key: Hashable) -> None: ...

    def views(self) -> list[AddressView]: ...

    def stats(self) -> MemoryStats: ...

    def close(self) -> None: ...

    def allocation_error(self, key: Hashable) -> BaseException | None:
        """Why an allocation of `key`'s capture failed, when the backend reports only a generic
        out-of-memory error (the CUDA VMM allocator runs as a callback and cannot raise)."""
        ...


def make_graph_memory(
    strategy: str, backend: PoolBackend, *, granularity: int | None = None
) -> GraphMemory:
    """The memory strategy `strategy` on `backend` ("sim" or "cuda").

    `granularity` (vmm only): the physical pool's chunk size; default 2 MiB on sim, the device's
    VMM granularity on cuda. Raises `VmmUnsupportedError` (with `.reason`) where vmm cannot run.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown graph memory strategy {strategy!r}; choose one of {STRATEGIES}")
    if backend.name not in ("sim", "cuda"):
        raise ValueError(f"unknown backend {backend.name!r}; expected 'sim' or 'cuda'")
    if strategy != "vmm":
        if granularity is not None:
            raise ValueError(
                f"granularity applies to the vmm strategy only, not to {strategy!r}: drop it"
            )
        return HandlePoolMemory(backend, shared=strategy == "shared")
    if backend.name == "sim":
        return VmmMemory(HostPool(DEFAULT_GRANULARITY if granularity is None else granularity))
    return VmmMemory(CudaVmmPool(granularity=granularity))


class HandlePoolMemory:
    """Graph pools managed by the backend's own allocator and addressed by pool handles: a fresh
    handle per graph (`separate`) or one handle for every graph (`shared`)."""

    def __init__(self, backend: PoolBackend, *, shared: bool) -> None:
        self.strategy = "shared" if shared else "separate"
        self._backend = backend
        self._shared = shared
        self._handles: dict[Hashable, object] = {}
        self._shared_handle: object | None = None

    def pool_for(self, key: Hashable) -> object:
        if key in self._handles:
            raise PoolError(
                f"graph key {key!r} already has a pool; discard it before capturing again"
            )
        if not self._shared:
            handle = self._backend.graph_pool_handle()
        else:
            if self._shared_handle is None:
                self._shared_handle = self._backend.graph_pool_handle()
            handle = self._shared_handle
        self._handles[key] = handle
        return handle

    def holds(self, key: Hashable) -> bool:
        return key in self._handles

    def captured(self, key: Hashable) -> None:
        self._require(key)

    def discard(self, key: Hashable) -> None:
        self._require(key)
        del self._handles[key]

    def views(self) -> list[AddressView]:
        """Not tracked: graphs of a shared pool legitimately reuse each other's addresses."""
        return []

    def stats(self) -> MemoryStats:
        if self._shared:
            pools = [] if self._shared_handle is None else [self._shared_handle]
        else:
            pools = list(self._handles.values())
        if self._backend.name == "cuda":
            reserved = _cuda_pool_bytes(pools)
        else:
            reserved = sum(_sim_reserved_bytes(handle) for handle in pools)
        return MemoryStats(reserved, reserved, len(self._handles))

    def close(self) -> None:
        """Forget the pools; the allocator frees their memory once their graphs are gone."""
        self._handles.clear()
        self._shared_handle = None

    def allocation_error(self, key: Hashable) -> BaseException | None:
        return None

    def _require(self, key: Hashable) -> None:
        if key not in self._handles:
            raise KeyError(f"no pool for graph key {key!r}; call pool_for({key!r}) first")


class VmmMemory:
    """One virtual view per graph over one physical pool (`HostPool` or `CudaVmmPool`)."""

    strategy = "vmm"

    def __init__(self, pool: HostPool | CudaVmmPool) -> None:
        self.pool = pool
        self._errors: dict[Hashable, BaseException] = {}

    def pool_for(self, key: Hashable) -> object:
        """A `HostView` (the sim's capture pool) or, on cuda, the view's MemPool id."""
        self._errors.pop(key, None)
        if isinstance(self.pool, HostPool):
            return self.pool.new_view(key)
        return self.pool.new_view(key).pool_id

    def holds(self, key: Hashable) -> bool:
        return key in self.pool

    def captured(self, key: Hashable) -> None:
        self.pool.view(key).seal()

    def discard(self, key: Hashable) -> None:
        error = self.allocation_error(key)
        if error is not None:
            self._errors[key] = error
        self.pool.discard(key)

    def views(self) -> list[AddressView]:
        return self.pool.views()

    def stats(self) -> MemoryStats:
        return self.pool.stats()

    def close(self) -> None:
        self.pool.close()
        self._errors.clear()

    def allocation_error(self, key: Hashable) -> BaseException | None:
        if isinstance(self.pool, CudaVmmPool) and key in self.pool:
            return self.pool.allocation_error(key)
        return self._errors.get(key)


def _sim_reserved_bytes(handle: object) -> int:
    reserved = getattr(handle, "reserved_bytes", None)
    if not isinstance(reserved, int):
        raise PoolError(
            f"pool handle {handle!r} has no integer reserved_bytes; pass handles made by the sim"
            " backend's graph_pool_handle()"
        )
    return reserved


def _cuda_pool_bytes(pool_ids: list[object]) -> int:
    """Bytes of the caching allocator's segments that belong to the graph pools `pool_ids`."""
    wanted = {tuple(cast("tuple[int, int]", pool_id)) for pool_id in pool_ids}
    return sum(
        segment["total_size"]
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment["segment_pool_id"]) in wanted
    )
