"""BucketTable: O(1) padded lookup from a batch size to its capture size, and waste statistics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class IntervalWaste:
    """Batches `low..size` run in the graph of `size`; the worst case is a batch of `low`."""

    low: int
    size: int
    worst_rows: int
    worst_ratio: float


@dataclass(frozen=True, slots=True)
class Waste:
    """Padding under a batch-size histogram. Steps above the largest size run eagerly."""

    mean_padded_rows: float  # per step; eager steps count as 0
    padding_ratio: float  # padded rows / rows executed in graphs
    eager_fraction: float  # share of steps with no graph large enough


def check_histogram(histogram: Mapping[int, float]) -> dict[int, float]:
    """Validate {batch_size: count} and drop zero counts; raise before anything is computed."""
    cleaned: dict[int, float] = {}
    for size, count in histogram.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"histogram batch sizes must be positive ints, got {size!r}")
        if not count >= 0:
            raise ValueError(f"histogram count for batch size {size} must be >= 0, got {count!r}")
        if count > 0:
            cleaned[size] = float(count)
    if not cleaned:
        raise ValueError("histogram has no steps: every count is zero or it is empty")
    return cleaned


class BucketTable:
    """Sorted capture sizes with a precomputed lookup array: padded(n) is one list index."""

    __slots__ = ("_lookup", "_sizes")

    def __init__(self, sizes: Iterable[int]) -> None:
        checked = list(sizes)
        for size in checked:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"capture sizes must be positive ints, got {size!r}")
        if not checked:
            raise ValueError("a BucketTable needs at least one capture size")
        self._sizes = tuple(sorted(set(checked)))
        lookup = [0] * (self._sizes[-1] + 1)
        low = 1
        for size in self._sizes:
            lookup[low : size + 1] = [size] * (size + 1 - low)
            low = size + 1
        self._lookup = lookup

    @property
    def sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def max_size(self) -> int:
        return self._sizes[-1]

    def __len__(self) -> int:
        return len(self._sizes)

    def __repr__(self) -> str:
        return f"BucketTable({list(self._sizes)})"

    def padded(self, n: int) -> int | None:
        """The smallest capture size >= n, or None when n exceeds max_size (run eagerly)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"batch size must be a positive int, got {n!r}")
        if n >= len(self._lookup):
            return None
        return self._lookup[n]

    def worst_waste(self) -> tuple[IntervalWaste, ...]:
        """Per interval, the padding of its smallest batch: rows and share of the graph."""
        intervals = []
        low = 1
        for size in self._sizes:
            rows = size - low
            intervals.append(IntervalWaste(low, size, rows, rows / size))
            low = size + 1
        return tuple(intervals)

    def expected_waste(self, histogram: Mapping[int, float]) -> Waste:
        """Expected padding per step when batch sizes follow `histogram` {batch_size: count}."""
        counts = check_histogram(histogram)
        total = sum(counts.values())
        padded_rows = executed_rows = eager_steps = 0.0
        for size, count in counts.items():
            graph = self.padded(size)
            if graph is None:
                eager_steps += count
            else:
                padded_rows += (graph - size) * count
                executed_rows += graph * count
        return Waste(
            mean_padded_rows=padded_rows / total,
            padding_ratio=padded_rows / executed_rows if executed_rows else 0.0,
            eager_fraction=eager_steps / total,
        )
