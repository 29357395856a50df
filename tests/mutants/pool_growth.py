"""Class 9, pool accounting: each captured graph maps its own, fresh stretch of the physical pool
instead of aliasing the same physical memory from offset 0.

Mirrors graph runners that give every captured shape a private memory pool (or a shared-pool
allocator that never reuses across graphs): graph memory grows with the number of captured
shapes, and a few dozen buckets take gigabytes from the KV cache. The runtime's `vmm` memory
strategy on a pool with that bug.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable
from typing import Any, Literal

from pytest_graphmode.contract import AddressView
from pytest_graphmode.runtime.executor import GraphExecutor
from pytest_graphmode.runtime.memory import HostPool, HostView, VmmMemory, _libc
from pytest_graphmode.runtime.memory.ledger import align_up
from pytest_graphmode.runtime.target import RuntimeTarget
from tests.mutants._runtime import with_executor

BUG_CLASS = 9
EXPECTED_CHECK = "pool_within_bound"


class GrowingHostPool(HostPool):
    """Maps each view at the end of the file, so views never share physical pages."""

    def __init__(self) -> None:
        super().__init__()
        self.offsets: dict[Hashable, int] = {}

    def _map_through(self, view: HostView, end: int) -> None:
        needed = align_up(end, self.granularity)
        if needed <= view.mapped_bytes:
            return
        fd = self._require_open()
        offset = self.offsets.setdefault(view.key, self.stats().physical_bytes)
        os.ftruncate(fd, offset + needed)
        self.physical_bytes = offset + needed
        start = view.mapped_bytes
        _libc.map_shared(view.base + start, needed - start, fd, offset + start)
        view.mapped_bytes = needed
        self._ledger.grow(view.key, needed)

    def views(self) -> list[AddressView]:
        return [
            dataclasses.replace(v, offset=self.offsets.get(v.graph_key, 0)) for v in super().views()
        ]


class GrowingPoolExecutor(GraphExecutor):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._memory = VmmMemory(GrowingHostPool())


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RuntimeTarget:
    return with_executor(GrowingPoolExecutor, mode, seed=seed, backend=backend)
