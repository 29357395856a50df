"""Graph memory pools on host memory, and the poison written into fresh capture outputs.

A pool hands out blocks from chunks it never returns while it lives, like a CUDA graph pool: blocks a
capture frees (its temporaries) are reused later in that capture and by later captures sharing the
pool, which is exactly what makes pool sharing safe only when replays never overlap.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Protocol, runtime_checkable

import torch

ALIGNMENT = 512
DEFAULT_CHUNK = 1 << 20

_pool_ids = itertools.count(1)


@runtime_checkable
class SimCapturePool(Protocol):
    """What `graph(g, pool=...)` accepts on sim besides a handle: allocation for one capture."""

    def allocate(self, nbytes: int) -> torch.Tensor: ...

    def release(self, block: torch.Tensor) -> None: ...


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class SimPoolHandle:
    """A graph memory pool: best-fit blocks carved from chunks that only grow.

    `id` is a tuple like the `(int, int)` pool ids of torch.cuda, so handles print and hash alike.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK) -> None:
        self.id = (0, next(_pool_ids))
        self._chunk_bytes = chunk_bytes
        self._chunks: list[torch.Tensor] = []
        # per chunk: sorted list of free (start, end) byte ranges
        self._free: list[list[tuple[int, int]]] = []
        self._streams: list[int | None] = []  # per chunk: the stream it serves
        # The graphs captured (or capturing) into this pool and not reset since: CUDA's use
        # count of a pool. Once it falls to zero, CUDA frees the pool as soon as none of its
        # blocks is in use; until then it refuses a capture into it (`refuses_captures`).
        self._graphs: weakref.WeakSet[Any] = weakref.WeakSet()
        self._held_forever = False  # a capture failed: CUDA never gives back its use

    def refuses_captures(self) -> bool:
        """Whether CUDA would refuse a capture into this pool now: every graph that captured
        into it was reset or destroyed, and a block of it is still in use (an output alive).
        Such a pool with no block in use is CUDA's to free: the next capture starts afresh."""
        if self._held_forever or self._graphs or not self._chunks:
            return False
        return any(
            ranges != [(0, c.numel())] for c, ranges in zip(self._chunks, self._free, strict=True)
        )

    def held_by(self, graph: Any) -> None:
        """A capture into this pool begins."""
        self._graphs.add(graph)

    def let_go(self, graph: Any, *, failed: bool = False) -> None:
        """`graph` was reset, or its capture `failed` (CUDA keeps a failed capture's use)."""
        if failed:
            self._held_forever = True
        self._graphs.discard(graph)

    @property
    def reserved_bytes(self) -> int:
        return sum(c.numel() for c in self._chunks)

    def allocate(self, nbytes: int, stream: int | None = None) -> torch.Tensor:
        """A block of `nbytes` for work on `stream` (a stream id). As in CUDA's caching
        allocator, a chunk serves the stream that first allocated from it only: a block freed
        by one stream of a capture is never handed to another, which would order their work."""
        size = _round_up(max(nbytes, 1), ALIGNMENT)
        best: tuple[int, int, int] | None = None  # (waste, chunk, index in free list)
        for c, ranges in enumerate(self._free):
            if self._streams[c] != stream:
                continue
            for i, (start, end) in enumerate(ranges):
                waste = end - start - size
                if waste >= 0 and (best is None or waste < best[0]):
                    best = (waste, c, i)
        if best is None:
            chunk = torch.empty(_round_up(size, self._chunk_bytes), dtype=torch.uint8)
            self._chunks.append(chunk)
            self._free.append([(0, chunk.numel())])
            self._streams.append(stream)
            best = (chunk.numel() - size, len(self._chunks) - 1, 0)
        _, c, i = best
        start, end = self._free[c][i]
        if start + size == end:
            del self._free[c][i]
        else:
            self._free[c][i] = (start + size, end)
        return self._chunks[c][start : start + nbytes]

    def release(self, block: torch.Tensor) -> None:
        # Found by its storage and offset: an empty block (a 0-byte allocation, which still
        # reserves one alignment unit) reports no data pointer.
        where = block.untyped_storage().data_ptr()
        for c, chunk in enumerate(self._chunks):
            if where == chunk.untyped_storage().data_ptr():
                start = int(block.storage_offset())
                size = _round_up(max(block.numel(), 1), ALIGNMENT)
                self._insert_free(c, start, start + size)
                return
        raise ValueError("block does not belong to this pool")

    def _insert_free(self, c: int, start: int, end: int) -> None:
        ranges = self._free[c]
        ranges.append((start, end))
        ranges.sort()
        merged: list[tuple[int, int]] = []
        for s, e in ranges:
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
        self._free[c] = merged

    def __repr__(self) -> str:
        return f"<sim graph pool {self.id} reserved={self.reserved_bytes}>"


class BlockReturns:
    """The blocks one capture hands out, given back to its pool as their tensors die.

    A block that another stream's work was recorded on during the capture (`record_stream`)
    comes back only when the capture ends: CUDA's caching allocator cannot query an event
    recorded in a capture, so it defers freeing such a block until no capture is under way, and
    no later allocation of the capture is handed it."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._recorded: set[int] = set()  # ids of live blocks recorded on another stream
        self._deferred: list[torch.Tensor] = []

    def recorded(self, block: torch.Tensor) -> None:
        """Work of a stream other than the block's own was recorded on `block` (the capture is
        under way)."""
        self._recorded.add(id(block))

    def give_back(self, block: torch.Tensor) -> None:
        """The last tensor over `block` died."""
        if id(block) in self._recorded:  # only before the end: `end` empties it
            self._recorded.discard(id(block))
            self._deferred.append(block)
        else:
            self._pool.release(block)

    def end(self) -> None:
        """The capture ended (or was aborted): the deferred blocks come back now."""
        self._recorded.clear()
        deferred, self._deferred = self._deferred, []
        for block in deferred:
            self._pool.release(block)


_INT_POISON = {
    torch.int64: -0x5A5A5A5A5A5A5A5B,
    torch.int32: -0x5A5A5A5B,
    torch.int16: -0x5A5B,
    torch.int8: -0x5B,
    torch.uint8: 0xA5,
}


def _poison_value(dtype: torch.dtype) -> float | bool | int:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return _INT_POISON.get(dtype, -1)


# The poison of each dtype met so far: every fresh output of a capture or of queued work is
# poisoned, and a dtype's properties are Python calls.
_POISON: dict[torch.dtype, float | bool | int] = {}


def poison_(t: torch.Tensor) -> None:
    """Fill with values no correct computation produces, so reading before a replay is visible."""
    dtype = t.dtype
    value = _POISON.get(dtype)
    if value is None:
        value = _POISON[dtype] = _poison_value(dtype)
    t.fill_(value)
