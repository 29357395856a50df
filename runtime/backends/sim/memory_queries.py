"""torch.cuda's questions about the caching allocator, answered on the sim.

The sim's device memory is host memory, which it does not account (`SIM_MEMORY` free of
`SIM_MEMORY`), so every count is 0. The answers keep torch's shapes all the same: a runner that
reads `memory_stats()["requested_bytes.all.current"]`, sets a memory fraction or records the
allocator's history before it profiles, as serving engines do, runs on; a raw allocation from the
allocator, which hands out an address, is refused by name.
"""

from __future__ import annotations

from typing import Any

from pytest_graphmode.runtime.backends.sim.stand_ins import one_device, unsupported

# torch's statistics of the caching allocator (torch.cuda.memory_stats' documentation).
_POOLED = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
_UNPOOLED = ("oversize_allocations", "oversize_segments")
_COUNTS = ("current", "peak", "allocated", "freed")
_SCALARS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "max_split_size",
)


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    one_device(device)
    counts = dict.fromkeys(_COUNTS, 0)
    pools = {pool: dict(counts) for pool in ("all", "large_pool", "small_pool")}
    nested: dict[str, Any] = {name: {p: dict(c) for p, c in pools.items()} for name in _POOLED}
    nested.update({name: dict(counts) for name in _UNPOOLED})
    nested.update(dict.fromkeys(_SCALARS, 0))
    return nested


def memory_stats(device: Any = None) -> dict[str, int]:
    """The nested statistics flattened as torch flattens them ("allocated_bytes.all.peak")."""
    flat: dict[str, int] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else key, inner)
        else:
            flat[prefix] = value

    add("", memory_stats_as_nested_dict(device))
    return dict(sorted(flat.items()))


class MemoryFraction:
    """The per-process memory fraction, kept as torch checks it; the sim has no limit to apply."""

    def __init__(self) -> None:
        self.fraction = 1.0

    def set(self, fraction: float, device: Any = None) -> None:
        one_device(device)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fraction = fraction

    def get(self, device: Any = None) -> float:
        one_device(device)
        return self.fraction


def allocator_backend() -> str:
    return "native"  # torch's own caching allocator, the one the sim stands in for


def record_memory_history(*args: Any, **kwargs: Any) -> None:
    """Recording starts and stops: the sim allocates nothing on a device to record."""


def allocator_snapshot(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"segments": [], "device_traces": [[]]}


def memory_query_surface() -> dict[str, Any]:
    """torch.cuda's names of these (torch.cuda.memory holds the same ones)."""
    fraction = MemoryFraction()
    return {
        "memory_stats": memory_stats,
        "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
        "set_per_process_memory_fraction": fraction.set,
        "get_per_process_memory_fraction": fraction.get,
        "get_allocator_backend": allocator_backend,
        "caching_allocator_alloc": unsupported(
            "torch.cuda.caching_allocator_alloc (a raw device address)"
        ),
        "caching_allocator_delete": unsupported(
            "torch.cuda.caching_allocator_delete (a raw device address)"
        ),
    }


# torch.cuda.memory's private names that serving engines call around their memory profiling.
MEMORY_MODULE_PRIVATE = {
    "_record_memory_history": record_memory_history,
    "_snapshot": allocator_snapshot,
}
