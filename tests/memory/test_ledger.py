import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.contract import AddressView
from pytest_graphmode.runtime.memory import Ledger, PoolError, find_overlaps


def _intersect(a: AddressView, b: AddressView) -> bool:
    return a.size > 0 and b.size > 0 and a.base < b.end and b.base < a.end


views = st.lists(
    st.builds(
        AddressView,
        graph_key=st.integers(0, 5),
        base=st.integers(0, 1000),
        size=st.integers(0, 200),
    ),
    max_size=8,
)


@given(views)
def test_find_overlaps_reports_exactly_the_intersecting_pairs_of_different_graphs(views):
    expected = {
        frozenset((id(a), id(b)))
        for i, a in enumerate(views)
        for b in views[i + 1 :]
        if a.graph_key != b.graph_key and _intersect(a, b)
    }
    found = {frozenset((id(a), id(b))) for a, b in find_overlaps(views)}
    assert found == expected


def test_adjacent_views_do_not_overlap():
    assert find_overlaps([AddressView("a", 0, 64), AddressView("b", 64, 64)]) == []


def test_ledger_view_starts_empty_at_offset_zero_and_grows():
    ledger = Ledger("pool")
    ledger.open("k", 4096)
    ledger.grow("k", 8192)
    assert ledger.views() == [AddressView("k", 4096, 8192, "pool", 0)]
    assert ledger.virtual_bytes() == 8192


def test_ledger_refuses_a_second_view_for_one_key():
    ledger = Ledger("pool")
    ledger.open("k", 0)
    with pytest.raises(PoolError, match="already has an address view"):
        ledger.open("k", 4096)


def test_ledger_view_cannot_shrink():
    ledger = Ledger("pool")
    ledger.open("k", 0)
    ledger.grow("k", 100)
    with pytest.raises(PoolError, match="cannot shrink"):
        ledger.grow("k", 50)
