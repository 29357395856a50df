"""Capture sizes: engine schedules, O(1) padded lookup, and an exact planner for a traffic mix.

`python -m pytest_graphmode.runtime.buckets plan|replay|simulate` drives the same API from files;
docs/planner.md has the formats and a worked example on Azure's production traces.
"""

from pytest_graphmode.runtime.buckets._files import (
    read_histogram,
    read_latency,
    read_sizes,
    read_trace,
    write_histogram,
)
from pytest_graphmode.runtime.buckets._plan import IntervalStat, Plan, evaluate
from pytest_graphmode.runtime.buckets._planner import plan
from pytest_graphmode.runtime.buckets._schedules import KINDS, schedule
from pytest_graphmode.runtime.buckets._table import BucketTable, IntervalWaste, Waste
from pytest_graphmode.runtime.buckets._trace import ReplayReport, replay
from pytest_graphmode.runtime.buckets._traffic import (
    TraceRequest,
    decode_runs,
    halves,
    read_azure_trace,
    simulate,
)

__all__ = [
    "KINDS",
    "BucketTable",
    "IntervalStat",
    "IntervalWaste",
    "Plan",
    "ReplayReport",
    "TraceRequest",
    "Waste",
    "decode_runs",
    "evaluate",
    "halves",
    "plan",
    "read_azure_trace",
    "read_histogram",
    "read_latency",
    "read_sizes",
    "read_trace",
    "replay",
    "schedule",
    "simulate",
    "write_histogram",
]
