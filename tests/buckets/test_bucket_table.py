"""BucketTable: padded lookup properties and waste statistics."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.runtime.buckets import BucketTable, IntervalWaste

size_lists = st.lists(st.integers(1, 600), min_size=1, max_size=40)


@given(sizes=size_lists, data=st.data())
def test_padded_is_monotone(sizes, data):
    table = BucketTable(sizes)
    a = data.draw(st.integers(1, table.max_size))
    b = data.draw(st.integers(a, table.max_size))
    assert table.padded(a) <= table.padded(b)


@given(sizes=size_lists, data=st.data())
def test_padded_is_covering_and_minimal(sizes, data):
    table = BucketTable(sizes)
    n = data.draw(st.integers(1, table.max_size))
    graph = table.padded(n)
    assert graph in table.sizes and graph >= n
    assert not [s for s in table.sizes if n <= s < graph]


@given(sizes=size_lists)
def test_every_size_maps_to_itself(sizes):
    table = BucketTable(sizes)
    assert [table.padded(s) for s in table.sizes] == list(table.sizes)


@given(sizes=size_lists, over=st.integers(1, 1000))
def test_batches_above_the_largest_size_fall_back_to_eager(sizes, over):
    table = BucketTable(sizes)
    assert table.padded(table.max_size + over) is None


@pytest.mark.parametrize("bad", [0, -1, 1.0, True])
def test_padded_rejects_non_positive_or_non_int(bad):
    with pytest.raises(ValueError, match="positive int"):
        BucketTable([1, 8]).padded(bad)


def test_empty_table_is_rejected():
    with pytest.raises(ValueError, match="at least one"):
        BucketTable([])


def test_worst_waste_is_the_smallest_batch_of_each_interval():
    assert BucketTable([1, 4, 16]).worst_waste() == (
        IntervalWaste(1, 1, 0, 0.0),
        IntervalWaste(2, 4, 2, 0.5),
        IntervalWaste(5, 16, 11, 11 / 16),
    )


def test_expected_waste_weights_padding_by_counts():
    waste = BucketTable([4, 8]).expected_waste({3: 2, 8: 1, 5: 1})
    # 3 -> 4 twice (2 rows), 8 -> 8 (0), 5 -> 8 (3 rows): 5 padded rows over 4 steps, 24 executed.
    assert waste.mean_padded_rows == pytest.approx(5 / 4)
    assert waste.padding_ratio == pytest.approx(5 / 24)
    assert waste.eager_fraction == 0.0


def test_expected_waste_counts_eager_steps_without_padding():
    waste = BucketTable([4]).expected_waste({4: 3, 9: 1})
    assert waste.eager_fraction == pytest.approx(0.25)
    assert waste.mean_padded_rows == 0.0


def test_expected_waste_rejects_an_empty_histogram():
    with pytest.raises(ValueError, match="no steps"):
        BucketTable([4]).expected_waste({4: 0})
