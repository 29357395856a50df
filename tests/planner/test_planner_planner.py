"""The planner is exact: it matches brute force and never loses to an engine's schedule."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.planner import evaluate, plan
from pytest_graphmode.runtime.buckets import KINDS, schedule

small_histograms = st.dictionaries(st.integers(1, 12), st.integers(1, 50), min_size=1, max_size=8)


def brute_force(histogram, *, max_graphs, align=1, include=(), cost=None, graph_cost=0.0):
    top = max(histogram)
    allowed = sorted(set(range(align, top, align)) | set(include) | {top})
    if isinstance(cost, dict):
        allowed = [size for size in allowed if size in cost]
    forced = set(include) | {top}
    free = [size for size in allowed if size not in forced]
    best = None
    for extra in range(max_graphs - len(forced) + 1):
        for chosen in itertools.combinations(free, extra):
            result = evaluate(forced | set(chosen), histogram, cost=cost, graph_cost=graph_cost)
            if best is None or result.objective < best:
                best = result.objective
    return best


@given(histogram=small_histograms, max_graphs=st.integers(1, 5))
def test_plan_matches_brute_force_on_padded_rows(histogram, max_graphs):
    result = plan(histogram, max_graphs=max_graphs)
    assert result.graphs <= max_graphs
    assert result.objective == pytest.approx(brute_force(histogram, max_graphs=max_graphs))


@given(
    histogram=small_histograms,
    max_graphs=st.integers(2, 5),
    align=st.integers(1, 4),
    graph_cost=st.floats(0, 3),
    data=st.data(),
)
def test_plan_matches_brute_force_with_constraints_and_graph_cost(
    histogram, max_graphs, align, graph_cost, data
):
    top = max(histogram)
    aligned = [size for size in range(align, top, align)]
    include = data.draw(st.lists(st.sampled_from(aligned), max_size=1)) if aligned else []
    result = plan(
        histogram, max_graphs=max_graphs, align=align, include=include, graph_cost=graph_cost
    )
    expected = brute_force(
        histogram, max_graphs=max_graphs, align=align, include=include, graph_cost=graph_cost
    )
    assert result.objective == pytest.approx(expected)


@given(
    histogram=small_histograms,
    max_graphs=st.integers(1, 4),
    latencies=st.lists(st.floats(0.5, 20), min_size=12, max_size=12),
    measured=st.sets(st.integers(1, 12), max_size=12),
)
def test_plan_matches_brute_force_on_a_latency_table(histogram, max_graphs, latencies, measured):
    top = max(histogram)
    table = {size: latencies[size - 1] for size in measured | {top} if size <= top}
    result = plan(histogram, max_graphs=max_graphs, cost=table)
    assert set(result.sizes) <= set(table)
    expected = brute_force(histogram, max_graphs=max_graphs, cost=table)
    assert result.objective == pytest.approx(expected)


@given(histogram=small_histograms, max_graphs=st.integers(1, 4))
def test_plan_matches_brute_force_on_a_cost_function(histogram, max_graphs):
    def cost(batch, size):
        # A fixed overhead per graph launch plus work that grows with padded rows.
        return 3.0 + size + 0.5 * (size - batch) ** 2

    result = plan(histogram, max_graphs=max_graphs, cost=cost)
    expected = brute_force(histogram, max_graphs=max_graphs, cost=cost)
    assert result.objective == pytest.approx(expected)


@given(
    histogram=st.dictionaries(st.integers(1, 160), st.integers(1, 100), min_size=1, max_size=40),
    kind=st.sampled_from(KINDS),
)
def test_plan_never_loses_to_an_engine_schedule_with_as_many_graphs(histogram, kind):
    fixed = schedule(kind, max(histogram), clamp=True)
    planned = plan(histogram, max_graphs=len(fixed))
    assert planned.graphs <= len(fixed)
    assert planned.expected_cost <= evaluate(fixed, histogram).expected_cost + 1e-9


@given(histogram=small_histograms, align=st.integers(2, 4), max_graphs=st.integers(1, 6))
def test_aligned_plan_uses_only_multiples_besides_the_top(histogram, align, max_graphs):
    result = plan(histogram, align=align, max_graphs=max_graphs)
    assert all(size % align == 0 for size in result.sizes[:-1])
    assert result.sizes[-1] == max(histogram)


@given(histogram=small_histograms, include=st.sets(st.integers(1, 12), max_size=3))
def test_included_sizes_are_always_planned(histogram, include):
    include = {size for size in include if size <= max(histogram)}
    result = plan(histogram, include=include, max_graphs=len(include) + 1)
    assert include <= set(result.sizes)


def test_largest_observed_size_is_always_covered():
    assert plan({3: 100, 40: 1}, max_graphs=1).sizes == (40,)


def test_max_size_is_the_top_and_larger_batches_run_eagerly():
    result = plan({3: 3, 40: 1}, max_size=16, max_graphs=2)
    assert result.sizes == (3, 16)
    assert result.eager_fraction == pytest.approx(0.25)


def test_equal_objectives_prefer_fewer_graphs():
    assert plan({4: 10}).sizes == (4,)


def test_unbounded_plan_without_graph_cost_captures_every_observed_size():
    assert plan({2: 1, 5: 1, 9: 1}).sizes == (2, 5, 9)


def test_graph_cost_trades_padding_for_fewer_graphs():
    assert plan({2: 1, 5: 1, 9: 1}, graph_cost=10.0).sizes == (9,)


def test_plan_reports_padding_and_intervals():
    result = plan({1: 1, 3: 1}, max_graphs=1)
    assert result.sizes == (3,)
    assert result.expected_padded_rows == pytest.approx(1.0)
    assert result.padding_ratio == pytest.approx(2 / 6)
    assert [(i.low, i.size, i.step_share) for i in result.intervals] == [(1, 3, 1.0)]


def test_plan_at_512_with_51_graphs_beats_vllm_default():
    histogram = {size: 1 + (size * 37) % 11 for size in range(1, 513)}
    planned = plan(histogram, max_graphs=51)
    vllm = evaluate(schedule("vllm", 512), histogram)
    assert planned.graphs == 51
    assert planned.expected_padded_rows < vllm.expected_padded_rows


def test_too_few_graphs_for_the_required_sizes_is_rejected():
    with pytest.raises(ValueError, match="max_graphs=1 cannot hold"):
        plan({8: 1}, include=[2], max_graphs=1)


def test_included_size_above_the_top_is_rejected():
    with pytest.raises(ValueError, match="must not exceed"):
        plan({8: 1}, include=[9])


def test_unaligned_included_size_is_rejected():
    with pytest.raises(ValueError, match="not multiples of align=4"):
        plan({8: 1}, include=[2], align=4)


def test_latency_table_without_the_top_size_is_rejected():
    with pytest.raises(ValueError, match=r"no entry for required sizes \[8\]"):
        plan({8: 1}, cost={4: 1.0})


def test_evaluate_rejects_sizes_missing_from_the_latency_table():
    with pytest.raises(ValueError, match=r"no entry for capture sizes \[2\]"):
        evaluate([2, 8], {8: 1}, cost={8: 1.0})
