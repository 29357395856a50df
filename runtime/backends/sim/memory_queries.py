"""torch.cuda's questions about the caching allocator, answered on the sim.

The counts come from the sim's memory ledger (memory_ledger.py): what CUDA's allocator would hold
for the device tensors alive, reserved memory, peaks and the driver's free memory. The answers keep
torch's names and shapes: a runner that reads `memory_stats()["allocated_bytes.all.peak"]`, sets a
memory fraction or records the allocator's history before it profiles, as serving engines do, runs
on; a raw allocation from the allocator, which hands out an address, is refused by name. Segments,
splits, retries and out-of-memory events are not modelled: their counts stay 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pytest_graphmode.runtime.backends.sim.memory_ledger import DeviceMemory
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


class MemoryQueries:
    """torch.cuda's memory queries over one ledger."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory

    def stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        one_device(device)
        counts = dict.fromkeys(_COUNTS, 0)
        pools = {pool: dict(counts) for pool in ("all", "large_pool", "small_pool")}
        nested: dict[str, Any] = {name: {p: dict(c) for p, c in pools.items()} for name in _POOLED}
        nested.update(self.memory.nested_stats())
        nested.update({name: dict(counts) for name in _UNPOOLED})
        nested.update(dict.fromkeys(_SCALARS, 0))
        return nested

    def stats(self, device: Any = None) -> dict[str, int]:
        """The nested statistics flattened as torch flattens them ("allocated_bytes.all.peak")."""
        flat: dict[str, int] = {}

        def add(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for key, inner in value.items():
                    add(f"{prefix}.{key}" if prefix else key, inner)
            else:
                flat[prefix] = value

        add("", self.stats_as_nested_dict(device))
        return dict(sorted(flat.items()))

    def summary(self, device: Any = None, abbreviated: bool = False) -> str:
        """The counts torch's summary opens with; the sim has no segments to list."""
        one_device(device)
        memory = self.memory
        mib = 1 << 20
        return (
            "pytest-graphmode sim: device memory is host memory, counted as CUDA's caching "
            "allocator would count it\n"
            f"Allocated memory: {memory.allocated() / mib:.2f} MiB "
            f"(peak {memory.max_allocated() / mib:.2f} MiB)\n"
            f"Reserved memory: {memory.reserved() / mib:.2f} MiB "
            f"(peak {memory.max_reserved() / mib:.2f} MiB)\n"
        )


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


def _on_the_device(answer: Callable[[], Any]) -> Callable[..., Any]:
    """torch.cuda's form of a ledger's answer: one optional argument, the sim's one device."""

    def ask(device: Any = None) -> Any:
        one_device(device)
        return answer()

    return ask


def memory_query_surface(memory: DeviceMemory) -> dict[str, Any]:
    """torch.cuda's names of these (torch.cuda.memory holds the same ones)."""
    fraction = MemoryFraction()
    queries = MemoryQueries(memory)
    return {
        "memory_stats": queries.stats,
        "memory_stats_as_nested_dict": queries.stats_as_nested_dict,
        "memory_allocated": _on_the_device(memory.allocated),
        "max_memory_allocated": _on_the_device(memory.max_allocated),
        "memory_reserved": _on_the_device(memory.reserved),
        "max_memory_reserved": _on_the_device(memory.max_reserved),
        "reset_peak_memory_stats": _on_the_device(memory.reset_peaks),
        "reset_max_memory_allocated": _on_the_device(memory.reset_peaks),
        "reset_accumulated_memory_stats": _on_the_device(memory.reset_accumulated),
        "memory_summary": queries.summary,
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
