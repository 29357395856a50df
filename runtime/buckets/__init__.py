"""Capture sizes at run time: engine schedules and O(1) padded lookup.

The offline planner that chooses capture sizes for a traffic mix is `pytest_graphmode.planner`.
"""

from pytest_graphmode.runtime.buckets._schedules import KINDS, schedule
from pytest_graphmode.runtime.buckets._table import (
    BucketTable,
    IntervalWaste,
    Waste,
    check_histogram,
)

__all__ = [
    "KINDS",
    "BucketTable",
    "IntervalWaste",
    "Waste",
    "check_histogram",
    "schedule",
]
