"""The exact bucket planner: dynamic programming over the sorted candidate sizes.

Sizes are chosen left to right. Position 0 is a virtual size 0, positions 1..n the candidates.
A plan is a path 0 = i_0 < i_1 < ... < i_k = n; the edge i -> j serves every batch in
(v_i, v_j] with the graph of v_j and costs edge[j, i] = sum_{v_i < B <= v_j} p(B) T(B, v_j) +
M(v_j). best_k[j] is the cheapest path to j with k edges, so the optimum over every set of at
most K sizes that contains the top is min_k best_k[n]: O(n^2 * K) work, one k at a time as a
row-wise min over an (n+1) x (n+1) tensor. A must-include size forbids edges that jump over it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping

import torch

from pytest_graphmode.planner._plan import (
    CostModel,
    GraphCost,
    Plan,
    check_latency_table,
    evaluate,
    graph_cost_function,
    step_cost_function,
)
from pytest_graphmode.runtime.buckets import check_histogram

# Two objectives closer than this (relative) are a tie, and the plan with fewer graphs wins.
_TIE = 1e-9


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def _candidates(
    top: int,
    align: int,
    required: set[int],
    observed: Iterable[int],
    cost: CostModel,
    graph_cost: GraphCost,
) -> list[int]:
    if isinstance(cost, Mapping):
        latency = check_latency_table(cost)
        missing = sorted(size for size in required | {top} if size not in latency)
        if missing:
            raise ValueError(
                f"the latency table has no entry for required sizes {missing}; measure them"
            )
        return sorted(
            size for size in latency if size <= top and (size % align == 0 or size == top)
        )
    if cost is None and not callable(graph_cost):
        # With T = C and one price per graph, a size above the largest batch it serves can drop
        # to the smallest allowed size covering that batch at no loss: the aligned ceilings of
        # the observed batches are enough.
        ceilings = {min(-(-batch // align) * align, top) for batch in observed if batch <= top}
        return sorted(ceilings | required | {top})
    # Aligned sizes below the top, plus the top itself (always covered, aligned or not).
    return sorted(set(range(align, top, align)) | required | {top})


def _edge_costs(
    values: list[int],
    probabilities: dict[int, float],
    cost: CostModel,
    graph_cost: GraphCost,
) -> torch.Tensor:
    """edge[j, i] for 0 <= i < j <= n (inf elsewhere); values[0] is the virtual size 0."""
    n = len(values) - 1
    graph_cost_of = graph_cost_function(graph_cost)
    keep = torch.tensor([0.0] + [graph_cost_of(size) for size in values[1:]], dtype=torch.float64)
    if cost is None or isinstance(cost, Mapping):
        # T depends on the size only: edge[j, i] = T(v_j) * P(v_i < B <= v_j) + M(v_j).
        step_cost = step_cost_function(cost)
        run = torch.tensor([0.0] + [step_cost(v, v) for v in values[1:]], dtype=torch.float64)
        density = [0.0] * (values[-1] + 1)
        for batch, p in probabilities.items():
            density[batch] += p
        cumulative = list(itertools.accumulate(density))
        mass = torch.tensor([cumulative[size] for size in values], dtype=torch.float64)
        full = run.unsqueeze(1) * (mass.unsqueeze(1) - mass.unsqueeze(0)) + keep.unsqueeze(1)
        below = torch.ones(n + 1, n + 1, dtype=torch.bool).tril(diagonal=-1)
        return torch.where(below, full, math.inf)
    edge = torch.full((n + 1, n + 1), math.inf, dtype=torch.float64)
    batches = sorted(probabilities)
    for j in range(1, n + 1):
        size = values[j]
        # row[i] = sum over batches in (values[i], size] of p(B) T(B, size), built right to left.
        running = 0.0
        k = len(batches)
        while k > 0 and batches[k - 1] > size:
            k -= 1
        row = [0.0] * j
        for i in range(j - 1, -1, -1):
            while k > 0 and batches[k - 1] > values[i]:
                batch = batches[k - 1]
                running += probabilities[batch] * cost(batch, size)
                k -= 1
            row[i] = running
        edge[j, :j] = torch.tensor(row, dtype=torch.float64) + keep[j]
    return edge


def _forbid_skipping(edge: torch.Tensor, values: list[int], required: set[int]) -> None:
    # An edge i -> j with a must-include size strictly between v_i and v_j would drop that size.
    last_required = 0
    for j in range(1, len(values)):
        edge[j, :last_required] = math.inf
        if values[j] in required:
            last_required = j


def plan(
    histogram: Mapping[int, float],
    *,
    max_graphs: int | None = None,
    cost: CostModel = None,
    graph_cost: GraphCost = 0.0,
    align: int = 1,
    include: Iterable[int] = (),
    max_size: int | None = None,
) -> Plan:
    """The capture sizes that minimise seed 001's objective under `histogram` {batch: count}.

    Exact over every set of at most `max_graphs` sizes (unbounded when None) drawn from the
    multiples of `align` below the top size, where the top is `max_size` or else the largest
    observed batch and is always in the plan. `cost` is T: None for rows executed (T = C), a
    {size: latency} table (only measured sizes are candidates) or a function T(batch, size).
    `graph_cost` is lambda * M(c): a constant or a function of the size. Every size in `include`
    is in the plan. Batches above the top run eagerly and only show in `eager_fraction`.
    On equal objectives the plan with fewer graphs wins.
    """
    counts = check_histogram(histogram)
    align = _positive_int(align, "align")
    top = max(counts) if max_size is None else _positive_int(max_size, "max_size")
    required = {_positive_int(size, "every included size") for size in include}
    if any(size > top for size in required):
        raise ValueError(f"included sizes {sorted(required)} must not exceed the top size {top}")
    unaligned = sorted(size for size in required if size % align and size != top)
    if unaligned:
        raise ValueError(f"included sizes {unaligned} are not multiples of align={align}")
    candidates = _candidates(top, align, required, counts, cost, graph_cost)
    needed = len(required | {top})
    limit = len(candidates) if max_graphs is None else _positive_int(max_graphs, "max_graphs")
    if limit < needed:
        raise ValueError(
            f"max_graphs={limit} cannot hold the {needed} required sizes"
            f" {sorted(required | {top})}; raise max_graphs or include fewer sizes"
        )
    limit = min(limit, len(candidates))

    total = sum(counts.values())
    probabilities = {b: c / total for b, c in counts.items() if b <= top}
    values = [0, *candidates]
    edge = _edge_costs(values, probabilities, cost, graph_cost)
    _forbid_skipping(edge, values, required)

    n = len(candidates)
    best = torch.full((n + 1,), math.inf, dtype=torch.float64)
    best[0] = 0.0
    parents: list[torch.Tensor] = []
    chosen_graphs = 0
    chosen = math.inf
    for graphs in range(1, limit + 1):
        best, parent = (best.unsqueeze(0) + edge).min(dim=1)
        parents.append(parent)
        finish = float(best[n])
        if not math.isfinite(chosen) or finish < chosen - _TIE * max(1.0, abs(chosen)):
            chosen, chosen_graphs = finish, graphs
    if not math.isfinite(chosen):
        raise ValueError("no capture-size set satisfies the constraints")

    sizes = []
    position = n
    for graphs in range(chosen_graphs, 0, -1):
        sizes.append(values[position])
        position = int(parents[graphs - 1][position])
    return evaluate(sorted(sizes), counts, cost=cost, graph_cost=graph_cost)
