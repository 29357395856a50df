"""What the benchmarks run: the suite's configuration per backend, decode batches, and steps.

`cuda` runs the launch-bound `DecoderConfig.gpu_bench()`; `sim` runs `DecoderConfig.tiny()` on a
few small buckets, so the whole suite also runs on a CPU in a few minutes (sim timings show the
code paths work, not GPU performance).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.buckets import schedule
from pytest_graphmode.runtime.buffers import StaticInputs
from pytest_graphmode.runtime.captured_steps import FullGraph, StepFn, capture_full
from pytest_graphmode.runtime.executor import GraphExecutor
from pytest_graphmode.runtime.keys import GraphKey
from pytest_graphmode.runtime.memory import make_graph_memory
from pytest_graphmode.runtime.model import Decoder, DecoderConfig, sample

SPEC_QUERY_LEN = 4  # speculative decoding with 3 draft tokens
BACKEND_ENV = "GRAPHMODE_BACKEND"


@dataclass(frozen=True)
class Suite:
    """Sizes the suite runs on one backend."""

    config: DecoderConfig
    decode_sizes: tuple[int, ...]  # item 1, decode
    spec_sizes: tuple[int, ...]  # item 1, speculative decoding (size * SPEC_QUERY_LEN tokens)
    executor_sizes: tuple[int, ...]  # items 2 and 3
    capture_schedule: tuple[int, ...]  # items 5 and 6
    fuzz_examples: int
    fuzz_steps: int


SUITES = {
    "cuda": Suite(
        config=DecoderConfig.gpu_bench(),
        decode_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        spec_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
        executor_sizes=(1, 8, 64),
        capture_schedule=tuple(schedule("vllm", 512)),
        fuzz_examples=20,
        fuzz_steps=12,
    ),
    "sim": Suite(
        config=DecoderConfig.tiny(),
        decode_sizes=(1, 2, 4, 8, 16, 32),
        spec_sizes=(1, 2, 4, 8),
        executor_sizes=(1, 8, 16),
        capture_schedule=tuple(schedule("vllm", 32)),
        fuzz_examples=5,
        fuzz_steps=8,
    ),
}


def backend_name(config: pytest.Config) -> str:
    """`--graphmode-backend`, else `GRAPHMODE_BACKEND`, else auto; resolved to sim or cuda."""
    asked = config.getoption("graphmode_backend") or os.environ.get(BACKEND_ENV) or "auto"
    try:
        return backends.resolve(asked)
    except ValueError as error:
        raise pytest.UsageError(f"--graphmode-backend / {BACKEND_ENV}: {error}") from error


def suite_of(config: pytest.Config) -> Suite:
    """The sizes of this run's backend (used at collection, to parametrize by them)."""
    return SUITES[backend_name(config)]


def decode_batch(config: DecoderConfig, num_reqs: int, query_len: int = 1) -> Batch:
    """`num_reqs` requests continuing cached sequences with `query_len` tokens each.

    Requests share the blocks besides the null block evenly (as many as a block table holds), so
    the largest batches still fit; attention reads every slot of a block table whatever the
    context length, so the step costs the same for any split.
    """
    free = config.num_blocks - 1
    if num_reqs > free:
        raise ValueError(
            f"{num_reqs} requests need {num_reqs} KV blocks besides the null block; the config "
            f"has {free}: use a config with more num_blocks"
        )
    per_request = min(config.max_blocks_per_req, free // num_reqs)
    capacity = per_request * config.block_size
    if capacity <= query_len:
        raise ValueError(
            f"{per_request} blocks of {config.block_size} slots leave no context before "
            f"{query_len} query tokens"
        )
    blocks = [b for b in range(config.num_blocks) if b != config.null_block]
    requests = []
    for index in range(num_reqs):
        own = tuple(blocks[index * per_request : (index + 1) * per_request])
        tokens = tuple((7 * index + offset) % config.vocab_size for offset in range(query_len))
        requests.append(Request(index, tokens, capacity - query_len, own))
    return Batch(tuple(requests))


def make_executor(
    decoder: Decoder,
    backend: Any,
    capture_sizes: Sequence[int],
    *,
    query_len: int = 1,
    memory: str = "shared",
) -> GraphExecutor:
    """An executor whose static inputs hold the largest capture size at `query_len`."""
    largest = max(capture_sizes)
    return GraphExecutor(
        decoder,
        backend,
        capture_sizes=capture_sizes,
        max_query_len=query_len,
        memory=memory,
        max_num_reqs=largest,
        max_num_tokens=largest * query_len,
    )


def step_fn(decoder: Decoder, inputs: StaticInputs, padded_reqs: int, query_len: int) -> StepFn:
    """The step a FULL graph records (forward + sampling on the static inputs), as the executor
    builds it, so eager timing and raw replay run exactly the graph's work."""
    views = inputs.views(padded_reqs, padded_reqs * query_len)
    sampling = inputs.sampling_views(padded_reqs)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        logits = decoder.forward(views)
        return logits, sample(logits, sampling.seeds, sampling.temperatures, sampling.positions)

    return run


def capture_step(
    backend: Any, run: StepFn, padded_reqs: int, query_len: int, memory: str = "shared"
) -> FullGraph:
    """Capture `run` as a FULL decode graph the way the executor does, in a pool of its own."""
    key = GraphKey("full", padded_reqs * query_len, padded_reqs, query_len, "decode", False)
    return capture_full(backend, key, run, make_graph_memory(memory, backend))


def check_same_step(backend: Any, run: StepFn, graph: FullGraph) -> None:
    """Fail before timing if the replay does not compute the eager step (same inputs)."""
    eager_logits, _ = run()
    eager_logits = eager_logits.clone()
    graph.graph.replay()
    backend.synchronize()
    torch.testing.assert_close(graph.logits, eager_logits, rtol=1e-2, atol=1e-2)


def append_json(path: Path, record: dict[str, Any]) -> None:
    """Add `record` to the JSON list in `path` (created on first use)."""
    records = json.loads(path.read_text()) if path.exists() else []
    records.append(record)
    path.write_text(json.dumps(records, indent=1))
