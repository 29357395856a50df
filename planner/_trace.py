"""Trace replay: run a recorded sequence of batch sizes through a bucket table."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pytest_graphmode.runtime.buckets import BucketTable


@dataclass(frozen=True, slots=True)
class ReplayReport:
    steps: int
    hits: dict[int, int]  # capture size -> steps replayed in its graph (every size, zeros too)
    eager_steps: int  # steps above the largest size
    valid_rows: int  # rows of real requests in graph steps
    padded_rows: int  # rows added to reach the graph size

    @property
    def padding_ratio(self) -> float:
        executed = self.valid_rows + self.padded_rows
        return self.padded_rows / executed if executed else 0.0

    @property
    def eager_fraction(self) -> float:
        return self.eager_steps / self.steps


def replay(batch_sizes: Iterable[int], table: BucketTable) -> ReplayReport:
    hits = dict.fromkeys(table.sizes, 0)
    steps = eager = valid = padded = 0
    for batch in batch_sizes:
        graph = table.padded(batch)
        steps += 1
        if graph is None:
            eager += 1
            continue
        hits[graph] += 1
        valid += batch
        padded += graph - batch
    if steps == 0:
        raise ValueError("the trace has no steps")
    return ReplayReport(steps, hits, eager, valid, padded)
