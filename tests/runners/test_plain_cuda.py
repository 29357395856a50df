"""The plain torch.cuda runner on the sim through the drop-in: replay matches eager, and it passes
the harness; the runner module itself imports nothing from this package."""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.fuzz import run_campaign
from pytest_graphmode.runtime.backends.sim import drop_in
from tests.runners import plain_cuda
from tests.runners.plain_target import PlainTarget, make_target

PROMPTS = Batch(
    (Request(1, (5, 6, 7), 0, (1,)), Request(2, (9,), 0, (2,)), Request(3, (3, 3), 0, (3,)))
)
DECODE = Batch((Request(1, (8,), 3, (1,)), Request(2, (4,), 1, (2,)), Request(3, (2,), 2, (3,))))


def test_the_runner_imports_only_torch() -> None:
    tree = ast.parse(Path(plain_cuda.__file__).read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= {"__future__", "collections", "dataclasses", "math", "torch"}, imported


@pytest.fixture
def twins() -> Iterator[tuple[PlainTarget, PlainTarget]]:
    with drop_in():
        graph = make_target("graph", seed=3, backend="sim")
        eager = make_target("eager", seed=3, backend="sim")
        for target in (graph, eager):
            target.step(PROMPTS)
        yield graph, eager
        graph.close()
        eager.close()


def test_its_tensors_are_on_the_simulated_gpu(twins: tuple[PlainTarget, PlainTarget]) -> None:
    runner = twins[0].runner
    assert runner.k_cache.device == torch.device("cuda", 0)
    assert runner.staging.is_pinned() and not runner.staging.is_cuda
    assert set(runner.graphs) == {1, 2, 4}


def test_decode_replays_a_graph_equal_to_eager(twins: tuple[PlainTarget, PlainTarget]) -> None:
    graph, eager = twins
    replayed, expected = graph.step(DECODE), eager.step(DECODE)
    assert (replayed.path, replayed.graph_key) == ("full", ("decode", 4))
    torch.testing.assert_close(replayed.logits, expected.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(replayed.next_tokens, expected.next_tokens)
    torch.testing.assert_close(graph.state()["k"][4:], eager.state()["k"][4:])


def test_plain_runner_passes_the_harness_on_sim() -> None:
    stats = run_campaign(make_target, backend="sim", max_examples=8, max_steps=8, seed=0)
    assert stats.failures == []
    assert stats.paths["full"] > 0


@pytest.mark.graphmode_cuda
def test_on_a_gpu_the_same_runner_replays_real_graphs_equal_to_eager() -> None:
    graph = make_target("graph", seed=3, backend="cuda")
    eager = make_target("eager", seed=3, backend="cuda")
    assert type(graph.runner.k_cache) is torch.Tensor and graph.runner.k_cache.is_cuda
    assert isinstance(graph.runner.graphs[4], torch.cuda.CUDAGraph)
    for target in (graph, eager):
        target.step(PROMPTS)
    replayed, expected = graph.step(DECODE), eager.step(DECODE)
    graph.close()
    eager.close()
    assert (replayed.path, replayed.graph_key) == ("full", ("decode", 4))
    torch.testing.assert_close(replayed.logits, expected.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(replayed.next_tokens, expected.next_tokens)


@pytest.mark.graphmode_cuda
def test_plain_runner_passes_the_harness_on_a_gpu() -> None:
    stats = run_campaign(make_target, backend="cuda", max_examples=8, max_steps=8, seed=0)
    assert stats.failures == []
    assert stats.paths["full"] > 0
