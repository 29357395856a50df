"""`graphmode_benchmark`: time eager and graph replay of the same step with pytest-benchmark.

    def test_decode(graphmode_benchmark):
        comparison = graphmode_benchmark(eager=run_step, replay=graph.replay)
        # comparison.speedup == eager median / replay median

Each call adds one pytest-benchmark entry per candidate (`test_decode[eager]`,
`test_decode[replay]`) to one group, so the table shows them side by side, and fills the shared
`extra_info` (`eager_median_s`, `replay_median_s`, `speedup`) that `--benchmark-json` writes.

Why pedantic mode with a device clock: a replay only *launches* work, so a host timer around it
measures launch cost, not the step. pytest-benchmark reads its timer before and after a round of
`iterations` back-to-back calls; here that timer is an event clock: it records an event on the
current stream, waits for it and returns its time since a reference event. A round therefore
spans from the moment the device finished earlier work to the moment it finished the round's
last call, on the device's timeline (CUDA events on `cuda`; on `sim` the events are stamped with the host's
wall clock when the simulated stream reaches them). Pedantic mode keeps the rounds and iterations
explicit, so eager and replay run the same number of times, with no calibration that would time
one of them more often than the other.

pytest-benchmark switches itself off under xdist (and with `--benchmark-disable`): the candidates
then run once each as a smoke test, and the call still returns a `Comparison`, made from that one
call each on the device clock; `enabled` is False, and its figures are no measurement. Run
benchmarks with `-p no:xdist`.

The fixture needs pytest-benchmark (`pip install pytest-graphmode[bench]`); this module imports
neither torch nor pytest-benchmark at import time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from pytest_graphmode._benchmark_private import sibling_fixture, use_timer

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends import Backend

Step = Callable[[], object]


@dataclass(frozen=True, slots=True)
class Timing:
    """How often each candidate runs: `rounds` timed rounds of `iterations` calls each, after
    `warmup_rounds` untimed rounds."""

    rounds: int
    iterations: int
    warmup_rounds: int

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.iterations < 1 or self.warmup_rounds < 0:
            raise ValueError(
                f"Timing needs rounds >= 1, iterations >= 1 and warmup_rounds >= 0; got "
                f"{self.rounds}, {self.iterations}, {self.warmup_rounds}"
            )


# A replay on an H200 takes tens of microseconds: 20 calls per round keep the event clock's
# resolution (about half a microsecond) out of the result. A sim step takes milliseconds
# to tenths of a second, and its timings only show that the code paths work.
DEFAULT_TIMING = {
    "cuda": Timing(rounds=30, iterations=20, warmup_rounds=3),
    "sim": Timing(rounds=10, iterations=2, warmup_rounds=1),
}


@dataclass(frozen=True, slots=True)
class Comparison:
    """Median seconds per call of eager and replay; `speedup` = eager / replay."""

    eager_median_s: float
    replay_median_s: float

    @property
    def speedup(self) -> float:
        return self.eager_median_s / self.replay_median_s


def event_clock(backend: Backend) -> Callable[[], float]:
    """A pytest-benchmark timer in seconds read from device events on `backend`'s current stream.

    Reading it waits until the device has finished everything issued before, so the difference of
    two readings is the device-timeline time of the work issued between them, idle gaps included:
    a step that keeps the device waiting for its launches is as slow as its launches.
    """
    origin = backend.Event(enable_timing=True)
    origin.record()
    origin.synchronize()
    # One event, recorded again at every reading: making an event costs host time that would
    # otherwise land inside a round when the device is idle.
    mark = backend.Event(enable_timing=True)

    def device_event_clock() -> float:
        mark.record()
        mark.synchronize()
        return float(origin.elapsed_time(mark)) / 1e3

    return device_event_clock


class GraphBenchmark:
    """The value of the `graphmode_benchmark` fixture; see the module docstring."""

    def __init__(self, benchmark: Any, backend: Backend, node: pytest.Item) -> None:
        self._benchmark = benchmark
        self._backend = backend
        self._node = node
        self._used = False
        self.extra_info: dict[str, Any] = benchmark.extra_info
        """Shared by every entry of this test; add your own fields before or after timing."""

    @property
    def enabled(self) -> bool:
        """False under xdist or `--benchmark-disable`: candidates then run once, and the figures
        come from that one call."""
        return not self._benchmark.disabled

    def __call__(
        self,
        *,
        eager: Step,
        replay: Step,
        timing: Timing | None = None,
        group: str | None = None,
    ) -> Comparison:
        """Time `eager` and `replay` (each runs the same step: check they agree before timing),
        record both medians and the speedup in `extra_info`, and return them."""
        medians = self.compare({"eager": eager, "replay": replay}, timing=timing, group=group)
        comparison = Comparison(medians["eager"], medians["replay"])
        self.extra_info.update(
            eager_median_s=comparison.eager_median_s,
            replay_median_s=comparison.replay_median_s,
            speedup=comparison.speedup,
        )
        return comparison

    def compare(
        self,
        candidates: Mapping[str, Step],
        *,
        timing: Timing | None = None,
        group: str | None = None,
    ) -> dict[str, float]:
        """Time every candidate as its own entry `<test>[<name>]` in one group (default: the
        test's name); return the median seconds per call by name (disabled: the seconds of the
        one call each candidate made)."""
        if self._used:
            raise RuntimeError(
                "graphmode_benchmark was already used in this test: time every candidate in one "
                "call, or parametrize the test"
            )
        if not candidates:
            raise ValueError("compare() needs at least one candidate to time")
        bad = [name for name in candidates if not name or "[" in name or "]" in name]
        if bad:
            raise ValueError(f"candidate names {bad} must be non-empty and free of '[' and ']'")
        self._used = True
        timing = timing or DEFAULT_TIMING[self._backend.name]
        group = group or self._node.name
        clock = event_clock(self._backend)
        medians: dict[str, float] = {}
        for index, (name, step) in enumerate(candidates.items()):
            fixture = (
                self._benchmark if index == 0 else sibling_fixture(self._node, self.extra_info)
            )
            self._label(fixture, name, group, clock)
            started = clock()
            fixture.pedantic(
                step,
                rounds=timing.rounds,
                iterations=timing.iterations,
                warmup_rounds=timing.warmup_rounds,
            )
            # Disabled, pytest-benchmark calls the step once and keeps no statistics: that one
            # call, on the device clock, is the figure.
            medians[name] = (
                clock() - started if fixture.stats is None else float(fixture.stats.stats.median)
            )
        self.extra_info["timer"] = "cuda events" if self._backend.name == "cuda" else "sim events"
        self.extra_info["backend"] = self._backend.name
        return medians

    def _label(self, fixture: Any, name: str, group: str, clock: Callable[[], float]) -> None:
        callspec = getattr(self._node, "callspec", None)
        fixture.name = _with_param(self._node.name, name)
        fixture.fullname = _with_param(self._node.nodeid, name)
        fixture.param = name if callspec is None else f"{callspec.id}-{name}"
        fixture.params = {**({} if callspec is None else callspec.params), "candidate": name}
        fixture.group = group
        # A call that only launches work needs the device clock, not a host timer.
        use_timer(fixture, clock)


def _with_param(name: str, param: str) -> str:
    """`test[8]` -> `test[8-eager]`; `test` -> `test[eager]`."""
    if name.endswith("]") and "[" in name:
        return f"{name[:-1]}-{param}]"
    return f"{name}[{param}]"


@pytest.fixture
def graphmode_benchmark(
    benchmark: Any, graphmode_backend: Backend, request: pytest.FixtureRequest
) -> GraphBenchmark:
    """Time eager and replay of the same step; see `pytest_graphmode.benchmark`."""
    node = request.node
    if not isinstance(node, pytest.Item):
        raise TypeError("graphmode_benchmark is a function-scoped fixture of a test item")
    return GraphBenchmark(benchmark, graphmode_backend, node)
