"""The device memory torch.cuda's caching allocator would count, kept for the sim's device tensors.

The sim's device tensors live in host memory, yet serving engines size their KV cache and check
their start-up from the allocator's counts: vLLM takes the weights' footprint from
`memory_allocated()`, the activations' from the peak of `memory_stats()`, and (up to 0.11) asserts
that the driver's free memory fell while it profiled. The ledger counts what CUDA would:

- **Allocated**: every device storage an operation makes, from the operation until torch frees it,
  rounded up to 512 bytes as the caching allocator rounds (a storage of no bytes takes none), in
  the small pool up to 1 MiB and the large pool above; a storage that `resize_` grows counts its
  new size. Views, aliases and in-place writes allocate nothing. A capture's outputs are blocks
  of the graph's pool: each counts while the program holds it.
- **Peak**: the most allocated at once since the last `reset_peak_memory_stats()`.
- **Reserved**, in the allocator's segments: small blocks come out of 2 MiB segments, blocks
  under 10 MiB out of 20 MiB ones, larger ones out of segments of their own rounded up to 2 MiB.
  A segment is added when the live blocks no longer fit the pool's segments packed (freed
  blocks' room is reused first); `empty_cache()` gives back the segments no live block needs.
  Fragmentation is not modelled: the segments are taken as packed.
- **Free** (`mem_get_info`): the device's total (`SIM_MEMORY`) less what is reserved.

The ledger counts from the program's first question about memory (a count, `mem_get_info`,
`empty_cache`, a reset): what was allocated before is not in the counts, where CUDA's would hold
it, so counts start at 0 and differences (what an engine measures) are exact. Counting costs an
operation of the sim's device that allocates about a seventh more time (docs/backends.md), which
runners that never ask, the harness's own among them, do not pay.

A storage is forgotten when torch frees it (a weak reference's callback). Callbacks may come from
any thread, so they only queue what they free, and the ledger settles the queue before it counts.
A storage resized by its own method (`untyped_storage().resize_(0)`, how FSDP and sleep modes
free memory under live tensors) passes no operation the sim sees: each question looks at the
sizes of the storages counted, and counts a changed one anew (a peak between two questions that
only such a resize made is missed).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch

from pytest_graphmode.runtime.backends.sim.device import SIM_MEMORY

# torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp): block sizes round up to this,
_ROUND = 512
# blocks up to this size come from the small pool, out of segments of this size,
_SMALL, _SMALL_SEGMENT = 1 << 20, 2 << 20
# larger blocks below this size from segments of this size, and the rest from segments of their
# own, rounded up to this.
_MID, _MID_SEGMENT, _LARGE_ROUND = 10 << 20, 20 << 20, 2 << 20
_POOLS = ("all", "small_pool", "large_pool")
# A pool's counts, one list each: bytes, requested bytes and blocks now (0-2), at their peak since
# the last reset (3-5), and allocated (6-8) and freed (9-11) since the last reset of the
# accumulated counts. One list, not objects: every allocation of the sim's device updates two.
_KINDS = ("allocated_bytes", "requested_bytes", "allocation")
# torch's names of the four counts; reserved bytes are one list of them per pool.
_COUNTS = ("current", "peak", "allocated", "freed")


class _Held(weakref.ref):  # type: ignore[type-arg]
    """A device storage (or a graph pool's block) the ledger counts: its key, the size asked for
    and its size rounded as the allocator rounds it (which decides its pool and segment)."""

    __slots__ = ("key", "requested", "size")

    key: int
    requested: int
    size: int


def _own_segment(size: int) -> int:
    """The segment a large block has to itself (10 MiB or more), else 0: it shares one."""
    return -(-size // _LARGE_ROUND) * _LARGE_ROUND if size >= _MID else 0


def _allocate(counts: list[int], size: int, requested: int) -> None:
    now, asked, blocks = counts[0] + size, counts[1] + requested, counts[2] + 1
    counts[0], counts[1], counts[2] = now, asked, blocks
    if now > counts[3]:
        counts[3] = now
    if asked > counts[4]:
        counts[4] = asked
    if blocks > counts[5]:
        counts[5] = blocks
    counts[6] += size
    counts[7] += requested
    counts[8] += 1


def _free(counts: list[int], size: int, requested: int) -> None:
    counts[0] -= size
    counts[1] -= requested
    counts[2] -= 1
    counts[9] += size
    counts[10] += requested
    counts[11] += 1


class DeviceMemory:
    """The sim device's memory counts (module docstring)."""

    def __init__(self) -> None:
        # Off until the program first asks (module docstring); the dispatcher reads it.
        self.counting = False
        self._live: dict[int, _Held] = {}
        self._freed: deque[_Held] = deque()
        # Counted storages resized to nothing in place, watched for growing again.
        self._emptied: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._all, self._small, self._large = [0] * 12, [0] * 12, [0] * 12
        self._reserved = {pool: [0] * 4 for pool in _POOLS}
        # The large pool's live bytes in shared 20 MiB segments, and in segments of their own.
        self._mid = self._own = 0

    # -- what operations do ---------------------------------------------------------------------

    def made(self, result: Any) -> None:
        """The device tensors in `result` (a tensor, a tuple or a list of them) are an
        operation's fresh outputs: count their storages."""
        if self._freed:
            self._settle()
        if isinstance(result, torch.Tensor):
            self._count(result.untyped_storage())
        elif isinstance(result, tuple | list):
            for t in result:
                if isinstance(t, torch.Tensor):
                    self._count(t.untyped_storage())

    def resized(self, t: torch.Tensor) -> None:
        """`t`'s storage may have grown in place (`resize_`): CUDA allocates the larger block."""
        if self._freed:
            self._settle()
        storage = t.untyped_storage()
        held = self._live.get(storage._cdata)
        if held is None or held() is not storage:
            self._count(storage)
        elif storage.nbytes() > held.requested:
            self._recount(held, storage)

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        held = self._live.get(key)
        if held is not None:
            if held() is storage:
                return
            self._settle()  # a storage freed at this address: its callback is queued
        requested = storage.nbytes()
        if requested:
            self._add(storage, key, requested)

    def pooled(self, storage: torch.UntypedStorage, block: torch.Tensor, nbytes: int) -> None:
        """A capture handed out `block`, `nbytes` of a graph pool's `storage`: the block counts
        as allocated while `block` lives (the pool takes it back then), the pool's storage never
        (CUDA counts a graph pool's blocks, not its segments, as allocated)."""
        if self._freed:
            self._settle()
        key = storage._cdata
        held = self._live.get(key)
        if held is None or held() is not storage:
            marker = self._live[key] = _Held(storage, self._freed.append)
            marker.key, marker.requested, marker.size = key, 0, 0
        if nbytes:
            self._add(block, -id(block), nbytes)

    def _add(self, owner: Any, key: int, requested: int) -> None:
        held = _Held(owner, self._freed.append)
        held.key = key
        held.requested = requested
        held.size = size = -(-requested // _ROUND) * _ROUND
        self._live[key] = held
        _allocate(self._all, size, requested)
        if size <= _SMALL:
            _allocate(self._small, size, requested)
            self._grow_reserved("small_pool")
            return
        _allocate(self._large, size, requested)
        own = _own_segment(size)
        if own:
            self._own += own
        else:
            self._mid += size
        self._grow_reserved("large_pool")

    def _recount(self, held: _Held, storage: torch.UntypedStorage) -> None:
        """`storage` has another size than `held` counted: count it anew (no longer, if none)."""
        del self._live[held.key]
        self._forget(held)
        requested = storage.nbytes()
        if requested:
            self._add(storage, held.key, requested)
        else:
            self._emptied[held.key] = weakref.ref(storage)

    def _segments(self, pool: str) -> int:
        """The least the pool's segments can hold its live blocks in: small blocks packed into
        2 MiB segments, blocks under 10 MiB into 20 MiB ones, larger blocks in their own."""
        if pool == "small_pool":
            return -(-self._small[0] // _SMALL_SEGMENT) * _SMALL_SEGMENT
        return -(-self._mid // _MID_SEGMENT) * _MID_SEGMENT + self._own

    def _grow_reserved(self, pool: str) -> None:
        """A new segment when the live blocks no longer fit the pool's: freed blocks' room is
        reused first, as the allocator reuses cached blocks."""
        more = self._segments(pool) - self._reserved[pool][0]
        if more > 0:
            _reserve(self._reserved[pool], more)
            _reserve(self._reserved["all"], more)

    def _settle(self) -> None:
        self.counting = True  # every question settles first
        freed = self._freed
        while freed:
            held = freed.popleft()
            if self._live.get(held.key) is held:
                del self._live[held.key]
                self._forget(held)

    def _forget(self, held: _Held) -> None:
        if not held.requested:
            return  # a graph pool's storage (`pooled`): its blocks count
        size = held.size
        _free(self._all, size, held.requested)
        if size <= _SMALL:
            _free(self._small, size, held.requested)
            return
        _free(self._large, size, held.requested)
        own = _own_segment(size)
        if own:
            self._own -= own
        else:
            self._mid -= size

    def _resized_in_place(self) -> None:
        """Count anew the storages whose size changed since they were counted (module
        docstring): asked before each answer, never on an operation's path."""
        self._settle()
        for held in list(self._live.values()):
            storage = held()
            if not held.requested or not isinstance(storage, torch.UntypedStorage):
                continue  # a graph pool's storage or block
            if storage.nbytes() != held.requested:
                self._recount(held, storage)
        for key, ref in list(self._emptied.items()):
            storage = ref()
            if storage is None or storage._cdata != key or storage.nbytes():
                del self._emptied[key]
                if storage is not None and storage._cdata == key and key not in self._live:
                    self._add(storage, key, storage.nbytes())  # grown again

    # -- what the program asks ------------------------------------------------------------------

    def allocated(self) -> int:
        self._resized_in_place()
        return self._all[0]

    def max_allocated(self) -> int:
        self._resized_in_place()
        return self._all[3]

    def reserved(self) -> int:
        self._resized_in_place()
        return self._reserved["all"][0]

    def max_reserved(self) -> int:
        self._resized_in_place()
        return self._reserved["all"][1]

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes, as the driver answers `cudaMemGetInfo`."""
        return SIM_MEMORY - self.reserved(), SIM_MEMORY

    def empty_cache(self) -> None:
        """Give back the segments no live block needs."""
        self._resized_in_place()
        for pool in ("small_pool", "large_pool"):
            unused = self._reserved[pool][0] - self._segments(pool)
            if unused > 0:
                _release(self._reserved[pool], unused)
                _release(self._reserved["all"], unused)

    def reset_peaks(self) -> None:
        self._resized_in_place()
        for counts in self._by_pool().values():
            counts[3:6] = counts[0:3]
        for reserved in self._reserved.values():
            reserved[1] = reserved[0]

    def reset_accumulated(self) -> None:
        self._resized_in_place()
        for counts in self._by_pool().values():
            counts[6:12] = [0] * 6
        for reserved in self._reserved.values():
            reserved[2] = reserved[3] = 0

    def _by_pool(self) -> dict[str, list[int]]:
        return {"all": self._all, "small_pool": self._small, "large_pool": self._large}

    def nested_stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """The pooled statistics this ledger keeps, in `memory_stats_as_nested_dict`'s shape
        ("active" as "allocation", "active_bytes" as "allocated_bytes": no block is allocated
        and inactive on the sim)."""
        self._resized_in_place()
        nested: dict[str, dict[str, dict[str, int]]] = {}
        for i, kind in enumerate(_KINDS):
            nested[kind] = {
                pool: dict(zip(_COUNTS, counts[i::3], strict=True))
                for pool, counts in self._by_pool().items()
            }
        nested["active"] = nested["allocation"]
        nested["active_bytes"] = nested["allocated_bytes"]
        nested["reserved_bytes"] = {
            pool: dict(zip(_COUNTS, reserved, strict=True))
            for pool, reserved in self._reserved.items()
        }
        return nested


def _reserve(reserved: list[int], more: int) -> None:
    reserved[0] += more
    reserved[2] += more
    if reserved[0] > reserved[1]:
        reserved[1] = reserved[0]


def _release(reserved: list[int], less: int) -> None:
    reserved[0] -= less
    reserved[3] += less


__all__ = ["DeviceMemory"]
