"""Item 3: the executor against what a user would pick instead, on the same decoder and inputs:
`torch.compile(backend="cudagraphs")` and `torch.cuda.make_graphed_callables` (cuda only).

The peers get the executor's staged device tensors, so they skip the host-side staging the
executor step includes; the comparison favours them by that much. A peer that cannot take this
decoder is reported (a warning and `extra_info["<peer>_error"]`) and left out of the group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from graph_workloads import decode_batch, make_executor, suite_of

from pytest_graphmode.benchmark import GraphBenchmark
from pytest_graphmode.runtime.buffers import StaticInputs
from pytest_graphmode.runtime.model import Decoder, DecoderInputs, sample

Tensors = tuple[torch.Tensor, ...]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    sizes = suite_of(metafunc.config).executor_sizes
    metafunc.parametrize("batch_size", sizes, ids=[f"bs{size}" for size in sizes])


def _step_args(inputs: StaticInputs, batch_size: int) -> Tensors:
    views = inputs.views(batch_size, batch_size)
    sampling = inputs.sampling_views(batch_size)
    return (*views.tensors().values(), sampling.seeds, sampling.temperatures)


def _tensor_step(decoder: Decoder) -> Callable[..., Tensors]:
    """The executor's step as a function of tensors only, the form both peers take."""

    def step(*tensors: torch.Tensor) -> Tensors:
        inputs = DecoderInputs(*tensors[:7])
        seeds, temperatures = tensors[7:]
        logits = decoder.forward(inputs)
        return logits, sample(logits, seeds, temperatures, inputs.seq_lens)

    return step


def _compiled(decoder: Decoder, args: Tensors) -> Callable[[], object]:
    torch._dynamo.reset()  # one shape per test: no recompilation limit carried over
    # What a user does for persistent buffers: promise stable addresses, so the graphs read the
    # weights, the KV cache and the staged inputs in place instead of copying them in per call.
    for tensor in (*decoder.weights().values(), decoder.kv_cache, *args):
        torch._dynamo.mark_static_address(tensor)
    compiled = torch.compile(_tensor_step(decoder), backend="cudagraphs", dynamic=False)
    for _ in range(3):  # cudagraph trees record on the third call
        compiled(*args)
    return lambda: compiled(*args)


def _graphed(decoder: Decoder, args: Tensors) -> Callable[[], object]:
    graphed = torch.cuda.make_graphed_callables(_tensor_step(decoder), args)
    return lambda: graphed(*args)


def _cudagraph_skips() -> int:
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


PEERS = {"compile_cudagraphs": _compiled, "graphed_callables": _graphed}


def test_executor_vs_peers(
    graphmode_benchmark: GraphBenchmark, graphmode_backend: Any, decoder: Decoder, batch_size: int
) -> None:
    if graphmode_backend.name != "cuda":
        pytest.skip("the peers (torch.compile cudagraphs, make_graphed_callables) need CUDA")
    executor = make_executor(decoder, graphmode_backend, [batch_size])
    try:
        batch = decode_batch(decoder.config, batch_size)
        expected = executor.step(batch).logits
        args = _step_args(executor.inputs, batch_size)
        candidates: dict[str, Callable[[], object]] = {
            "executor_step": lambda: executor.step(batch)
        }
        skips_before = _cudagraph_skips()
        for name, make in PEERS.items():
            try:
                run = make(decoder, args)
                logits = run()[0]  # type: ignore[index]
                torch.testing.assert_close(logits[:batch_size], expected, rtol=1e-2, atol=1e-2)
            except Exception as error:
                warnings.warn(
                    f"peer {name} does not apply at bs {batch_size}: {error}", stacklevel=1
                )
                graphmode_benchmark.extra_info[f"{name}_error"] = f"{type(error).__name__}: {error}"
                continue
            candidates[name] = run
        # A compiled function that cudagraphs skipped (e.g. for a mutated input) runs without
        # graphs; the count says whether the compile peer was graphed at all.
        skips = _cudagraph_skips() - skips_before
        graphmode_benchmark.extra_info.update(batch_size=batch_size, compile_cudagraph_skips=skips)
        medians = graphmode_benchmark.compare(candidates)
        if medians is not None:
            for name in candidates.keys() - {"executor_step"}:
                ratio = medians["executor_step"] / medians[name]
                graphmode_benchmark.extra_info[f"executor_over_{name}"] = ratio
    finally:
        executor.close()
