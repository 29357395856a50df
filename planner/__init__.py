"""The offline capture-size planner: an exact planner for a traffic mix, evaluation of any size
set, trace replay and a continuous-batching simulation of request traffic.

The runtime never imports it: it reads the sizes it chooses (`runtime.buckets` holds the table
and the engine schedules they are compared with). `python -m pytest_graphmode.planner
plan|replay|simulate` drives the same API from files; docs/planner.md has the formats and a worked
example on Azure's production traces.
"""

from pytest_graphmode.planner._files import (
    read_histogram,
    read_latency,
    read_sizes,
    read_trace,
    write_histogram,
)
from pytest_graphmode.planner._plan import IntervalStat, Plan, evaluate
from pytest_graphmode.planner._search import plan
from pytest_graphmode.planner._trace import ReplayReport, replay
from pytest_graphmode.planner._traffic import (
    TraceRequest,
    decode_runs,
    halves,
    read_azure_trace,
    simulate,
)

__all__ = [
    "IntervalStat",
    "Plan",
    "ReplayReport",
    "TraceRequest",
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
    "simulate",
    "write_histogram",
]
