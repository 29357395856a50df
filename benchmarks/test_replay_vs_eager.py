"""Item 1: eager vs graph replay of the same decode step, per bucket (decode and speculative
decode). The inputs are staged once; eager runs the step function, replay runs its graph."""

from __future__ import annotations

from typing import Any

import pytest
from graph_workloads import (
    SPEC_QUERY_LEN,
    capture_step,
    check_same_step,
    decode_batch,
    make_executor,
    step_fn,
    suite_of,
)

from pytest_graphmode.benchmark import GraphBenchmark
from pytest_graphmode.runtime.model import Decoder


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    suite = suite_of(metafunc.config)
    cases = [pytest.param("decode", 1, size, id=f"decode-bs{size}") for size in suite.decode_sizes]
    cases += [
        pytest.param("spec", SPEC_QUERY_LEN, size, id=f"spec-bs{size}") for size in suite.spec_sizes
    ]
    metafunc.parametrize(("phase", "query_len", "batch_size"), cases)


def test_replay_vs_eager(
    graphmode_benchmark: GraphBenchmark,
    graphmode_backend: Any,
    decoder: Decoder,
    phase: str,
    query_len: int,
    batch_size: int,
) -> None:
    executor = make_executor(decoder, graphmode_backend, [batch_size], query_len=query_len)
    try:
        batch = decode_batch(decoder.config, batch_size, query_len)
        executor.inputs.stage(batch, batch_size, batch_size * query_len)
        run = step_fn(decoder, executor.inputs, batch_size, query_len)
        graph = capture_step(graphmode_backend, run, batch_size, query_len)
        try:
            check_same_step(graphmode_backend, run, graph)
            info = {"phase": phase, "batch_size": batch_size, "query_len": query_len}
            graphmode_benchmark.extra_info.update(info)
            graphmode_benchmark(eager=run, replay=graph.graph.replay)
        finally:
            graph.reset()  # return the graph's pool now, not when the collector gets to it
    finally:
        executor.close()
