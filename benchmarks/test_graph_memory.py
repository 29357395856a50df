"""Items 5 and 6: capture time per bucket and in total, and graph memory (physical and virtual)
against the number of captured shapes, per memory strategy and capture order; then replay latency
per strategy.

A sweep captures the schedule's sizes one by one through `GraphExecutor.step` (a miss captures),
reading the executor's statistics after each capture. Its benchmark entry is the sweep's wall time;
the per-bucket capture seconds and the memory table go to `extra_info` and, with
`--graph-memory-json`, to the file `plot.py` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from graph_workloads import Suite, append_json, decode_batch, make_executor

from pytest_graphmode.benchmark import GraphBenchmark
from pytest_graphmode.runtime.executor import GraphExecutor
from pytest_graphmode.runtime.memory import VmmUnsupportedError, make_graph_memory
from pytest_graphmode.runtime.model import Decoder

SWEEPS = [
    ("separate", "largest_first"),
    ("shared", "largest_first"),
    ("shared", "ascending"),
    ("vmm", "ascending"),
    ("vmm", "largest_first"),
]
REPLAY_BATCH = 8


def _sweep(
    executor: GraphExecutor, decoder: Decoder, sizes: list[int], strategy: str
) -> dict[str, list[Any]]:
    table: dict[str, list[Any]] = {
        "size": [],
        "capture_s": [],
        "physical_bytes": [],
        "virtual_bytes": [],
    }
    captured_seconds = 0.0
    for size in sizes:
        result = executor.step(decode_batch(decoder.config, size))
        if result.path != "full":
            raise AssertionError(f"bs {size} ran {result.path}, not a graph: {result.reason}")
        stats = executor.stats()
        views = executor.address_views()
        if strategy == "vmm" and not views:
            raise AssertionError("a vmm executor reports no address views: it used another pool")
        table["size"].append(size)
        table["capture_s"].append(stats.capture_seconds - captured_seconds)
        table["physical_bytes"].append(stats.pool_bytes)
        # Pools without views (separate, shared) map every byte they reserve exactly once.
        table["virtual_bytes"].append(sum(v.size for v in views) if views else stats.pool_bytes)
        captured_seconds = stats.capture_seconds
    return table


def _vmm_granularity(backend: Any) -> int:
    """The vmm pool's chunk size; skips the test where vmm cannot run (e.g. no cuda-bindings)."""
    try:
        memory = make_graph_memory("vmm", backend)
    except VmmUnsupportedError as error:
        pytest.skip(f"vmm is unavailable here: {error.reason}")
    try:
        return int(memory.pool.granularity)  # type: ignore[attr-defined]
    finally:
        memory.close()


@pytest.mark.parametrize(("strategy", "order"), SWEEPS, ids=[f"{s}-{o}" for s, o in SWEEPS])
def test_capture_sweep(
    benchmark: Any,
    graphmode_backend: Any,
    decoder: Decoder,
    suite: Suite,
    memory_json: Path | None,
    strategy: str,
    order: str,
) -> None:
    granularity = {"granularity": _vmm_granularity(graphmode_backend)} if strategy == "vmm" else {}
    sizes = sorted(suite.capture_schedule, reverse=order == "largest_first")
    executors: list[GraphExecutor] = []

    def setup() -> tuple[tuple[GraphExecutor], dict[str, Any]]:
        executor = make_executor(decoder, graphmode_backend, sizes, memory=strategy)
        executors.append(executor)
        return (executor,), {}

    try:
        table = benchmark.pedantic(
            lambda executor: _sweep(executor, decoder, sizes, strategy), setup=setup, rounds=1
        )
    finally:
        for executor in executors:
            executor.close()
    record = {
        "strategy": strategy,
        "order": order,
        "backend": graphmode_backend.name,
        **granularity,
        "capture_total_s": sum(table["capture_s"]),
        **table,
    }
    benchmark.group = "5-6 capture sweep"
    benchmark.extra_info.update(record)
    if memory_json is not None:
        append_json(memory_json, record)


@pytest.mark.parametrize("strategy", ["separate", "shared", "vmm"])
def test_replay_latency_by_strategy(
    graphmode_benchmark: GraphBenchmark,
    graphmode_backend: Any,
    decoder: Decoder,
    suite: Suite,
    strategy: str,
) -> None:
    if strategy == "vmm":
        _vmm_granularity(graphmode_backend)
    executor = make_executor(decoder, graphmode_backend, suite.capture_schedule, memory=strategy)
    try:
        executor.capture_all()
        batch = decode_batch(decoder.config, REPLAY_BATCH)
        graphmode_benchmark.extra_info.update(strategy=strategy, batch_size=REPLAY_BATCH)
        graphmode_benchmark.compare(
            {"executor_step": lambda: executor.step(batch)}, group="6 replay by memory strategy"
        )
    finally:
        executor.close()
