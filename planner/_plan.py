"""A capture-size set judged under a batch-size histogram: the Plan record and `evaluate`.

The objective is seed 001's: sum_B p(B) * T(B, C(B)) + sum_{c in C} M(c), where C(B) is the
smallest capture size >= B, T the cost of running batch B in the graph of C and M the cost of
keeping one graph. p(B) is the share of all steps; steps above the largest size run eagerly
whatever the plan, so they add nothing to the objective and are reported as `eager_fraction`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from pytest_graphmode.runtime.buckets import BucketTable, check_histogram

StepCost = Callable[[int, int], float]
CostModel = Mapping[int, float] | StepCost | None
GraphCost = float | Callable[[int], float]


@dataclass(frozen=True, slots=True)
class IntervalStat:
    """Batches `low..size` run in the graph of `size`."""

    low: int
    size: int
    step_share: float  # share of all steps that land in this interval
    padded_rows: float  # expected padded rows per step contributed by this interval
    cost: float  # expected step cost contributed by this interval
    worst_rows: int  # padding of a batch of `low`
    worst_ratio: float


@dataclass(frozen=True, slots=True)
class Plan:
    sizes: tuple[int, ...]
    expected_cost: float  # sum_B p(B) T(B, C(B)); rows executed per step under the default T = C
    graph_cost: float  # sum_c M(c)
    expected_padded_rows: float  # sum_B p(B) (C(B) - B)
    padding_ratio: float  # padded rows / rows executed in graphs
    eager_fraction: float
    intervals: tuple[IntervalStat, ...]

    @property
    def graphs(self) -> int:
        return len(self.sizes)

    @property
    def objective(self) -> float:
        return self.expected_cost + self.graph_cost

    @property
    def worst_rows(self) -> int:
        """Most padded rows any batch up to the top can get (the widest interval's smallest)."""
        return max(interval.worst_rows for interval in self.intervals)

    @property
    def worst_ratio(self) -> float:
        """Largest share of a graph that padding can fill, over every batch up to the top."""
        return max(interval.worst_ratio for interval in self.intervals)


def step_cost_function(cost: CostModel) -> StepCost:
    """T(B, C) for a cost model: rows executed (T = C) by default, a latency per size, or a
    function. A latency table must cover every size it is asked about (`evaluate` checks)."""
    if cost is None:
        return lambda batch, size: float(size)
    if isinstance(cost, Mapping):
        latency = check_latency_table(cost)
        return lambda batch, size: latency[size]
    if callable(cost):
        return cost
    raise TypeError(
        f"cost must be None, a {{size: latency}} mapping or T(batch, size); got {cost!r}"
    )


def check_latency_table(latency: Mapping[int, float]) -> dict[int, float]:
    checked: dict[int, float] = {}
    for size, value in latency.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"latency table sizes must be positive ints, got {size!r}")
        if not value >= 0:
            raise ValueError(f"latency for size {size} must be >= 0, got {value!r}")
        checked[size] = float(value)
    if not checked:
        raise ValueError("the latency table is empty")
    return checked


def graph_cost_function(graph_cost: GraphCost) -> Callable[[int], float]:
    if callable(graph_cost):
        return graph_cost
    if isinstance(graph_cost, bool) or not isinstance(graph_cost, int | float) or graph_cost < 0:
        raise ValueError(f"graph_cost must be a number >= 0 or M(size), got {graph_cost!r}")
    constant = float(graph_cost)
    return lambda size: constant


def evaluate(
    sizes: Iterable[int],
    histogram: Mapping[int, float],
    *,
    cost: CostModel = None,
    graph_cost: GraphCost = 0.0,
) -> Plan:
    """Judge a capture-size set under `histogram` {batch_size: count}; the Plan of any schedule."""
    counts = check_histogram(histogram)
    table = BucketTable(sizes)
    if isinstance(cost, Mapping):
        unmeasured = [size for size in table.sizes if size not in cost]
        if unmeasured:
            raise ValueError(
                f"the latency table has no entry for capture sizes {unmeasured}; measure them"
                " or leave them out of the schedule"
            )
    step_cost = step_cost_function(cost)
    graph_cost_of = graph_cost_function(graph_cost)
    total = sum(counts.values())
    share = dict.fromkeys(table.sizes, 0.0)
    padded = dict.fromkeys(table.sizes, 0.0)
    run_cost = dict.fromkeys(table.sizes, 0.0)
    eager = executed = 0.0
    for batch, count in counts.items():
        graph = table.padded(batch)
        if graph is None:
            eager += count
            continue
        p = count / total
        share[graph] += p
        padded[graph] += p * (graph - batch)
        run_cost[graph] += p * step_cost(batch, graph)
        executed += p * graph
    intervals = tuple(
        IntervalStat(
            low=w.low,
            size=w.size,
            step_share=share[w.size],
            padded_rows=padded[w.size],
            cost=run_cost[w.size],
            worst_rows=w.worst_rows,
            worst_ratio=w.worst_ratio,
        )
        for w in table.worst_waste()
    )
    padded_rows = sum(padded.values())
    return Plan(
        sizes=table.sizes,
        expected_cost=sum(run_cost.values()),
        graph_cost=sum(graph_cost_of(size) for size in table.sizes),
        expected_padded_rows=padded_rows,
        padding_ratio=padded_rows / executed if executed else 0.0,
        eager_fraction=eager / total,
        intervals=intervals,
    )
