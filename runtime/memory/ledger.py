"""Bookkeeping of virtual address views: which graph owns which range over which physical pool."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

from pytest_graphmode.contract import AddressView

from .errors import PoolError


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """`physical_bytes`: memory actually backing the pool(s); `virtual_bytes`: address space the
    graphs can touch, summed over views (it counts shared physical memory once per view)."""

    physical_bytes: int
    virtual_bytes: int
    views: int


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class Ledger:
    """One `AddressView` per graph key over one physical pool.

    A view starts empty at its reserved base and grows as its graph's capture maps more of the
    physical pool; its offset into the physical pool is always 0 (bump allocation from the start).
    """

    def __init__(self, physical: str) -> None:
        self.physical = physical
        self._views: dict[Hashable, AddressView] = {}

    def open(self, key: Hashable, base: int) -> None:
        if key in self._views:
            raise PoolError(
                f"graph key {key!r} already has an address view; discard it before capturing again"
            )
        self._views[key] = AddressView(key, base, 0, self.physical, 0)

    def grow(self, key: Hashable, size: int) -> None:
        view = self._views[key]
        if size < view.size:
            raise PoolError(f"view of {key!r} cannot shrink from {view.size} to {size} bytes")
        self._views[key] = replace(view, size=size)

    def close(self, key: Hashable) -> AddressView:
        return self._views.pop(key)

    def views(self) -> list[AddressView]:
        return list(self._views.values())

    def virtual_bytes(self) -> int:
        return sum(view.size for view in self._views.values())

    def __contains__(self, key: object) -> bool:
        return key in self._views

    def __len__(self) -> int:
        return len(self._views)


def find_overlaps(views: Sequence[AddressView]) -> list[tuple[AddressView, AddressView]]:
    """Every pair of views of different graphs whose virtual ranges intersect (empty views never
    intersect anything)."""
    ordered = sorted((v for v in views if v.size > 0), key=lambda v: v.base)
    overlaps = []
    for i, first in enumerate(ordered):
        for second in ordered[i + 1 :]:
            if second.base >= first.end:
                break
            if second.graph_key != first.graph_key:
                overlaps.append((first, second))
    return overlaps
