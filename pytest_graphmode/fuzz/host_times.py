"""How long a delayed step's sleep must hold its stream back on cuda: long enough to outlast the
host.

A race between a step's asynchronous work and the host shows only while that work is still queued
when the host gets to its side: a pinned staging buffer rewritten by the next step's preparation,
a download read without waiting. A delay (`Stress.delay_cycles`) queues a sleep ahead of that work,
but the sleep runs from the moment it is queued, and the host's own part of a step after it
(launching an eager forward of a few hundred kernels, some milliseconds) can outlast a fixed
delay; the device then catches up and the race is hidden. On the H200 a runner's eager prefill
took 5 ms of host time, against the 1 ms of `DELAY_CYCLES`: its staging race with the replay
after it never showed.

So the harness measures the host time of every step each twin runs and holds a delayed step's
stream back for four times the time of the steps it must outlast (its own, and for a pipelined pair's
first step, the second's too), from the latest step of the same phase on the graph and eager twins
(the references run a pair's steps before the graph twin, so a pair has that figure even the
first time), up to `MAX_HOLD_SECONDS`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from pytest_graphmode.contract import Batch
from pytest_graphmode.strategies.stream_delays import sleep_cycles_per_second

# Four times the host time: the estimate comes from steps run without delays, and a delayed step's
# host is slower (its scope's dispatch mode sees every operation: on the H200 a split runner's
# mixed step took 5 ms delayed against 2.7 ms without, and a hold of twice the latter ended before
# the host read the download it held back); the eager twin's step is an estimate of the graph
# twin's, and the sleep's clock rate one of the SM clock's.
HOLD_FACTOR = 4.0
# A step whose host waits for the device (a blocking copy) measures as long as its device work;
# holding a stream back for more than four times this (100 ms) only slows the campaign.
MAX_HOLD_SECONDS = 0.025

T = TypeVar("T")


class HostTimes:
    """The latest host time of a step of each phase, per twin; `measure=False` times nothing
    (every estimate is then 0)."""

    def __init__(self, measure: bool = True) -> None:
        self.measure = measure
        self._seconds: dict[tuple[str, str], float] = {}

    def timed(self, twin: str, batch: Batch, run: Callable[[], T]) -> T:
        """`run()`, its host time noted as `twin`'s for a batch of `batch`'s phase."""
        if not self.measure:
            return run()
        start = time.perf_counter()
        try:
            return run()
        finally:
            self._seconds[(twin, batch.phase)] = time.perf_counter() - start

    def estimate(self, batch: Batch) -> float:
        """The host seconds a step of `batch` takes, as the twins last took for its phase (0: none
        seen yet)."""
        return max(
            (seconds for (_, phase), seconds in self._seconds.items() if phase == batch.phase),
            default=0.0,
        )

    def hold_cycles(self, device: torch.device, batches: Iterable[Batch]) -> int:
        """The sleep cycles that outlast the host through `batches`' steps on cuda `device`."""
        seconds = min(sum(self.estimate(b) for b in batches), MAX_HOLD_SECONDS)
        if seconds <= 0:
            return 0
        index = torch.cuda.current_device() if device.index is None else device.index
        return math.ceil(HOLD_FACTOR * seconds * sleep_cycles_per_second(index))
