"""Address-view oracles: captured graphs never share virtual addresses, and a shared physical
pool costs no more than its largest graph (plus one allocation granularity)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from pytest_graphmode.contract import AddressView
from pytest_graphmode.fuzz.violation import Violation

ADDRESS_VIEWS_DISJOINT = "address_views_disjoint"
POOL_WITHIN_BOUND = "pool_within_bound"
GRANULARITY = 2 << 20
"""Physical allocation granularity: 2 MiB, the CUDA VMM granularity (and a multiple of a page)."""


def address_views_disjoint(views: Sequence[AddressView]) -> list[Violation]:
    """Address views of different graphs never share virtual addresses."""
    ordered = sorted(views, key=lambda v: (v.base, v.end))
    for i, view in enumerate(ordered):
        for other in ordered[i + 1 :]:
            if other.base >= view.end:
                break
            if other.graph_key != view.graph_key:
                return [
                    Violation(
                        ADDRESS_VIEWS_DISJOINT,
                        f"graphs {view.graph_key!r} and {other.graph_key!r} share virtual "
                        "addresses",
                        expected=f"disjoint from [{view.base:#x}, {view.end:#x})",
                        actual=f"[{other.base:#x}, {other.end:#x})",
                    )
                ]
    return []


def pool_within_bound(
    views: Sequence[AddressView], granularity: int = GRANULARITY
) -> list[Violation]:
    """Views of one shared physical pool need no more than its largest graph (plus one
    allocation granularity)."""
    pools: dict[str, list[AddressView]] = defaultdict(list)
    for view in views:
        if view.physical is not None:
            pools[view.physical].append(view)
    for physical, members in sorted(pools.items()):
        used = max(v.offset + v.size for v in members)
        largest = max(v.size for v in members)
        if used > largest + granularity:
            return [
                Violation(
                    POOL_WITHIN_BOUND,
                    f"physical pool {physical!r} spans {used} bytes for {len(members)} views; the "
                    f"largest graph needs {largest}: views should map the same physical memory",
                    expected=f"<= {largest + granularity} bytes",
                    actual=f"{used} bytes",
                )
            ]
    return []
