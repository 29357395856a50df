"""Trace replay: hits per bucket, padding ratio and eager fallbacks."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.planner import replay
from pytest_graphmode.runtime.buckets import BucketTable


def test_replay_counts_hits_padding_and_fallbacks():
    report = replay([1, 3, 4, 9, 2], BucketTable([1, 4, 8]))
    assert report.hits == {1: 1, 4: 3, 8: 0}
    assert report.eager_steps == 1
    assert report.valid_rows == 1 + 3 + 4 + 2
    assert report.padded_rows == 1 + 2
    assert report.padding_ratio == pytest.approx(3 / 13)
    assert report.eager_fraction == pytest.approx(1 / 5)


def test_empty_trace_is_rejected():
    with pytest.raises(ValueError, match="no steps"):
        replay([], BucketTable([4]))


@given(trace=st.lists(st.integers(1, 80), min_size=1, max_size=60))
def test_every_step_is_a_hit_or_a_fallback(trace):
    report = replay(trace, BucketTable([1, 2, 4, 8, 16, 32, 64]))
    assert sum(report.hits.values()) + report.eager_steps == len(trace)
    assert report.eager_steps == sum(1 for size in trace if size > 64)
