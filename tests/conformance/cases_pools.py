"""Outputs and pools: graph outputs are memory the next replay overwrites; pools may be shared."""

from __future__ import annotations

from typing import Any

import torch

from pytest_graphmode.runtime import backends
from tests.conformance.case import case, value


@case("overwritten")
def output_is_overwritten_by_the_next_replay(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 2
    g.replay()
    first = y  # the same memory, not a copy
    x.fill_(5.0)
    g.replay()
    be.synchronize()
    return "overwritten" if bool((first == 10.0).all()) else "kept"


@case("value=[2.0, 2.0, 2.0, 2.0]")
def cloned_output_survives_the_next_replay(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 2
    g.replay()
    kept = y.clone()
    x.fill_(5.0)
    g.replay()
    return value(be, kept)


@case("same address")
def temporaries_are_reused_inside_one_capture(be: Any) -> str:
    x = torch.ones(1024, device=be.device)
    g = be.Graph()
    with be.graph(g):
        first = x * 2
        address = first.data_ptr()
        del first
        second = x * 3
    return "same address" if second.data_ptr() == address else "new address"


@case("same address")
def shared_pool_handle_reuses_a_dropped_output(be: Any) -> str:
    x = torch.ones(1024, device=be.device)
    pool = be.graph_pool_handle()
    g1, g2 = be.Graph(), be.Graph()
    with be.graph(g1, pool=pool):
        y1 = x * 2
    address = y1.data_ptr()
    del y1
    with be.graph(g2, pool=pool):
        y2 = x * 3
    return "same address" if y2.data_ptr() == address else "new address"


@case("same address")
def other_graphs_pool_reuses_a_dropped_output(be: Any) -> str:
    x = torch.ones(1024, device=be.device)
    g1, g2 = be.Graph(), be.Graph()
    with be.graph(g1):
        y1 = x * 2
    address = y1.data_ptr()
    del y1
    with be.graph(g2, pool=g1.pool()):
        y2 = x * 3
    return "same address" if y2.data_ptr() == address else "new address"


@case("new address")
def private_pools_do_not_share(be: Any) -> str:
    x = torch.ones(1024, device=be.device)
    g1, g2 = be.Graph(), be.Graph()
    with be.graph(g1):
        y1 = x * 2
    address = y1.data_ptr()
    del y1
    with be.graph(g2):
        y2 = x * 3
    return "same address" if y2.data_ptr() == address else "new address"


@case("value=[2.0, 2.0, 6.0, 6.0]")
def live_output_survives_a_graph_sharing_its_pool(be: Any) -> str:
    x = torch.ones(2, device=be.device)
    pool = be.graph_pool_handle()
    g1, g2 = be.Graph(), be.Graph()
    with be.graph(g1, pool=pool):
        y1 = x * 2
    with be.graph(g2, pool=pool):
        y2 = x * 6
    g1.replay()
    g2.replay()
    return value(be, torch.cat([y1, y2]))


@case("value=[6.0, 6.0]")
def output_outlives_its_graph(be: Any) -> str:
    x = torch.full((2,), 3.0, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 2
    g.replay()
    be.synchronize()
    del g
    return value(be, y)


@case("raises RuntimeError")
def pool_of_a_graph_never_captured(be: Any) -> str:
    be.Graph().pool()
    return "pool"


@case("raises RuntimeError")
def pool_of_a_reset_graph(be: Any) -> str:
    # A runner that resets its graphs after a weight update and captures them again must take
    # a pool from a graph still captured, or a new handle.
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        x.mul_(2)
    g.reset()
    g.pool()
    return "pool"


@case("value=[2.0, 2.0, 2.0, 2.0]")
def replay_on_the_default_stream(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 2
    with be.stream(be.default_stream()):
        g.replay()
    return value(be, y)


@case("value=[200.0]")
def many_replays_run_every_time(be: Any) -> str:
    counter = torch.zeros(1, device=be.device)
    g = be.Graph()
    with be.graph(g):
        counter.add_(2)
    for _ in range(100):
        g.replay()
    return value(be, counter)


@case("value=[6.0, 6.0, 6.0, 6.0], snapshot=list")
def mem_pool_spelled_from_torch_cuda_memory_holds_a_capture(be: Any) -> str:
    # vLLM's sleep-mode allocator spells its pool torch.cuda.memory.MemPool; on sim each case
    # runs in the drop-in, as a runner's code does.
    with backends.target_scope(be.name):
        pool = torch.cuda.memory.MemPool()
        with torch.cuda.memory.use_mem_pool(pool):
            x = torch.zeros(4, device=be.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool.id):
            y = x * 2
        x.fill_(3.0)
        g.replay()
        return f"{value(be, y)}, snapshot={type(pool.snapshot()).__name__}"
