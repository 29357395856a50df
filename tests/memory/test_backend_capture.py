"""Graph memory strategies under real captures through the backend facade (sim; cuda on a GPU)."""

import random

import pytest
import torch

from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.memory import VmmUnsupportedError, find_overlaps, make_graph_memory

from .conftest import GRANULARITY

SIZES = (1 << 10, 1 << 12, 1 << 14)  # elements; each capture's temporaries are 64x that


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.graphmode_cuda)])
def backend(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("cuda backend: no CUDA GPU on this machine")
    with backends.get(request.param).active() as backend:
        backend.synchronize()
        yield backend
        backend.synchronize()


def _memory(strategy, backend):
    granularity = GRANULARITY if strategy == "vmm" and backend.name == "sim" else None
    try:
        return make_graph_memory(strategy, backend, granularity=granularity)
    except VmmUnsupportedError as error:
        pytest.skip(error.reason)


def _work(x):
    wide = x.repeat(64) * 2  # [64 * n]
    return (wide + 1).view(64, -1).sum(0)  # [n] == 64 * (2x + 1)


def _capture(backend, memory, static_input, size):
    x = static_input[:size]
    _work(x)  # warm-up outside the capture, as a runner does
    backend.synchronize()
    graph = backend.Graph()
    with backend.graph(graph, pool=memory.pool_for(size)):
        out = _work(x)
    memory.captured(size)
    return graph, out


def _physical_alone(strategy, backend, static_input, size):
    memory = _memory(strategy, backend)
    graph, out = _capture(backend, memory, static_input, size)
    physical = memory.stats().physical_bytes
    del graph, out
    memory.close()
    return physical


@pytest.mark.parametrize("order", ["ascending", "descending", "random"])
def test_vmm_graphs_replay_like_eager_and_share_physical_memory(backend, order):
    static_input = torch.zeros(max(SIZES), device=backend.device)
    sizes = sorted(SIZES, reverse=order == "descending")
    if order == "random":
        random.Random(7).shuffle(sizes)
    alone = [_physical_alone("vmm", backend, static_input, size) for size in SIZES]
    memory = _memory("vmm", backend)
    graphs = {size: _capture(backend, memory, static_input, size) for size in sizes}
    static_input.copy_(torch.randn(max(SIZES)).to(backend.device))
    for size, (graph, out) in graphs.items():
        graph.replay()
        backend.synchronize()
        torch.testing.assert_close(out, 64 * (2 * static_input[:size] + 1))
    stats = memory.stats()
    assert find_overlaps(memory.views()) == []
    assert stats.physical_bytes == max(alone)
    del graphs
    memory.close()


def test_separate_pools_grow_with_the_sum_and_vmm_with_the_largest(backend):
    static_input = torch.zeros(max(SIZES), device=backend.device)
    physical = {}
    for strategy in ("separate", "vmm"):
        memory = _memory(strategy, backend)
        graphs = [_capture(backend, memory, static_input, size) for size in SIZES]
        physical[strategy] = memory.stats().physical_bytes
        del graphs
        memory.close()
    separate_alone = [_physical_alone("separate", backend, static_input, s) for s in SIZES]
    assert physical["separate"] == sum(separate_alone)
    assert physical["vmm"] < physical["separate"]
