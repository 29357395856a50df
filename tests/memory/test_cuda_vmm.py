"""The CUDA VMM pool on a real GPU: the same guarantees as the host pool, through real captures."""

import os
import random
from types import SimpleNamespace

import pytest
import torch

from pytest_graphmode.runtime.memory import (
    CudaVmmPool,
    PoolError,
    PoolExhaustedError,
    VmmMemory,
    VmmUnsupportedError,
    cuda_vmm,
    find_overlaps,
    make_graph_memory,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MiB = 1 << 20
SIZES = (1 << 14, 1 << 16, 1 << 18)  # elements; temporaries are 64x that many floats
CUDA = SimpleNamespace(name="cuda", graph_pool_handle=lambda: torch.cuda.graph_pool_handle())


def _vmm_pool(**kwargs) -> CudaVmmPool:
    try:
        return CudaVmmPool(**kwargs)
    except VmmUnsupportedError as error:
        pytest.skip(error.reason)


def _vmm_memory():
    try:
        return make_graph_memory("vmm", CUDA)
    except VmmUnsupportedError as error:
        pytest.skip(error.reason)


@pytest.fixture
def pool():
    pool = _vmm_pool(view_capacity=256 * MiB)
    yield pool
    pool.close()


def _allocate_in(view, nbytes: int) -> torch.Tensor:
    with torch.cuda.use_mem_pool(view.mempool):
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def _work(x: torch.Tensor) -> torch.Tensor:
    wide = x.repeat(64) * 2  # [64 * n]: a temporary that scales with the shape
    return (wide + 1).view(64, -1).sum(0)  # [n] == 64 * (2x + 1)


def _capture(memory, static_input: torch.Tensor, size: int):
    x = static_input[:size]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _work(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=memory.pool_for(size)):
        out = _work(x)
    memory.captured(size)
    return graph, out


def _physical_alone(size: int, static_input: torch.Tensor) -> int:
    memory = _vmm_memory()
    graph, out = _capture(memory, static_input, size)
    physical = memory.stats().physical_bytes
    del graph, out
    memory.close()
    return physical


def test_views_are_disjoint_and_alias_the_same_physical_memory(pool):
    first, second = pool.new_view("a"), pool.new_view("b")
    a, b = _allocate_in(first, MiB), _allocate_in(second, MiB)
    assert (a.data_ptr(), b.data_ptr()) == (first.base, second.base)
    assert find_overlaps(pool.views()) == []
    a.fill_(7)
    assert bool((b == 7).all())
    b[5] = 3
    assert a[5].item() == 3
    del a, b


@pytest.mark.parametrize("order", ["ascending", "descending", "random"])
def test_graphs_replay_correctly_and_physical_is_the_largest_capture(order):
    static_input = torch.zeros(max(SIZES), device="cuda")
    sizes = sorted(SIZES, reverse=order == "descending")
    if order == "random":
        random.Random(3).shuffle(sizes)
    needs = {size: _physical_alone(size, static_input) for size in SIZES}
    memory = _vmm_memory()
    graphs = {size: _capture(memory, static_input, size) for size in sizes}
    static_input.copy_(torch.randn(max(SIZES), device="cuda"))
    for size, (graph, out) in graphs.items():
        graph.replay()
        torch.testing.assert_close(out, 64 * (2 * static_input[:size] + 1))
    stats = memory.stats()
    assert find_overlaps(memory.views()) == []
    assert stats.physical_bytes == max(needs.values())
    assert stats.views == len(SIZES)
    del graphs
    memory.close()


def test_vmm_needs_less_physical_memory_than_separate_pools():
    static_input = torch.zeros(max(SIZES), device="cuda")
    separate = make_graph_memory("separate", CUDA)
    separate_graphs = [_capture(separate, static_input, size) for size in SIZES]
    separate_bytes = separate.stats().physical_bytes
    vmm = _vmm_memory()
    vmm_graphs = [_capture(vmm, static_input, size) for size in SIZES]
    vmm_bytes = vmm.stats().physical_bytes
    del separate_graphs, vmm_graphs
    separate.close()
    vmm.close()
    assert vmm_bytes < separate_bytes


def test_a_failed_allocation_keeps_its_real_cause():
    tiny = _vmm_pool(view_capacity=1)  # rounded up to a single chunk
    view = tiny.new_view("k")
    with pytest.raises(torch.OutOfMemoryError):
        _allocate_in(view, 4 * tiny.granularity)
    assert isinstance(tiny.allocation_error("k"), PoolExhaustedError)
    tiny.close()


def test_the_strategy_keeps_the_cause_after_discard():
    memory = VmmMemory(_vmm_pool(view_capacity=1))
    memory.pool_for("k")
    view = memory.pool.view("k")
    with pytest.raises(torch.OutOfMemoryError):
        _allocate_in(view, 4 * memory.pool.granularity)
    memory.discard("k")
    assert isinstance(memory.allocation_error("k"), PoolExhaustedError)
    memory.close()


def test_a_sealed_view_refuses_new_segments(pool):
    view = pool.new_view("k")
    view.seal()
    with pytest.raises(torch.OutOfMemoryError):
        _allocate_in(view, MiB)
    error = pool.allocation_error("k")
    assert isinstance(error, PoolError) and "has ended" in str(error)


def test_a_closed_view_stays_mapped_until_its_last_tensor_dies():
    pool = _vmm_pool(view_capacity=64 * MiB)
    view = pool.new_view("k")
    tensor = _allocate_in(view, MiB)
    tensor.fill_(1)
    pool.close()
    assert not view.unmapped
    assert tensor.sum().item() == MiB
    del tensor
    torch.cuda.empty_cache()
    assert view.unmapped


def test_close_returns_device_memory_twenty_times():
    static_input = torch.zeros(max(SIZES), device="cuda")

    def cycle() -> None:
        memory = _vmm_memory()
        graphs = [_capture(memory, static_input, size) for size in SIZES]
        for captured in graphs:
            captured[0].replay()
        torch.cuda.synchronize()
        assert memory.stats().physical_bytes > 0
        del graphs, captured  # every graph and output gone before close, as an executor does
        memory.close()

    cycle()  # first use initialises cuBLAS-free kernels and driver state
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    # Views other tests closed while their tensors lived are not this test's business.
    unreleased_before = set(cuda_vmm._unreleased_views)
    for _ in range(20):
        cycle()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert cuda_vmm._unreleased_views <= unreleased_before
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        # Free device memory is device-wide: only meaningful while no other worker shares the GPU.
        assert torch.cuda.mem_get_info()[0] >= free_before - 2 * MiB


def test_granularity_must_be_a_multiple_of_the_device_granularity():
    with pytest.raises(ValueError, match="VMM granularity"):
        _vmm_pool(granularity=4096 + 1)


def test_close_unmaps_views_discarded_while_their_tensors_lived():
    pool = _vmm_pool(view_capacity=64 * MiB)
    view = pool.new_view("k")
    tensor = _allocate_in(view, MiB)
    pool.discard("k")
    assert not view.unmapped
    del tensor
    pool.close()
    assert view.unmapped


@pytest.fixture
def full_collections(monkeypatch):
    """The full collections `close` runs, with automatic collection off meanwhile (it could free
    a reference cycle before `close` does)."""
    made: list[int] = []
    collect = cuda_vmm.gc.collect
    monkeypatch.setattr(cuda_vmm.gc, "collect", lambda *args: made.append(1) or collect(*args))
    enabled = cuda_vmm.gc.isenabled()
    cuda_vmm.gc.disable()
    yield made
    if enabled:
        cuda_vmm.gc.enable()


def test_close_collects_a_reference_cycle_that_holds_a_view(full_collections):
    pool = _vmm_pool(view_capacity=64 * MiB)
    view = pool.new_view("k")
    holder = {"tensor": _allocate_in(view, MiB)}
    holder["self"] = holder  # only the cycle collector can free the tensor
    del holder
    pool.close()
    assert view.unmapped and full_collections == [1]


def test_close_runs_no_full_collection_when_nothing_holds_a_view(full_collections):
    pool = _vmm_pool(view_capacity=64 * MiB)
    view = pool.new_view("k")
    tensor = _allocate_in(view, MiB)
    del tensor
    pool.close()
    assert view.unmapped and full_collections == []
