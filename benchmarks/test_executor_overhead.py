"""Item 2: a full executor step (stage + dispatch + replay + copy-out) vs a raw replay of the same
graph with its inputs already staged. The gap is what the executor adds to every step."""

from __future__ import annotations

from typing import Any

import pytest
from graph_workloads import capture_step, decode_batch, make_executor, step_fn, suite_of

from pytest_graphmode.benchmark import GraphBenchmark
from pytest_graphmode.runtime.model import Decoder


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    sizes = suite_of(metafunc.config).executor_sizes
    metafunc.parametrize("batch_size", sizes, ids=[f"bs{size}" for size in sizes])


def test_executor_step_vs_raw_replay(
    graphmode_benchmark: GraphBenchmark, graphmode_backend: Any, decoder: Decoder, batch_size: int
) -> None:
    executor = make_executor(decoder, graphmode_backend, [batch_size])
    try:
        batch = decode_batch(decoder.config, batch_size)
        first = executor.step(batch)  # captures the graph of this batch's key
        assert first.path == "full", first.reason
        # The same graph, recorded from the same step function on the same static inputs; the
        # executor does not hand out its own graphs.
        raw = capture_step(
            graphmode_backend, step_fn(decoder, executor.inputs, batch_size, 1), batch_size, 1
        )
        try:
            executor.inputs.stage(batch, batch_size, batch_size)
            medians = graphmode_benchmark.compare(
                {"executor_step": lambda: executor.step(batch), "raw_replay": raw.graph.replay}
            )
        finally:
            raw.reset()
        graphmode_benchmark.extra_info["batch_size"] = batch_size
        if medians is not None:
            ratio = medians["executor_step"] / medians["raw_replay"]
            graphmode_benchmark.extra_info["executor_over_replay"] = ratio
    finally:
        executor.close()
