"""Outputs and pools: graph outputs are memory the next replay overwrites; pools may be shared."""

from __future__ import annotations

from typing import Any

import torch

from pytest_graphmode.runtime import backends
from tests.conformance.case import another_stream, busy, case, racy, value


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
def a_block_a_graph_branch_freed_is_not_handed_to_the_origin(be: Any) -> str:
    # The caching allocator hands a freed block only to the stream that allocated it: a block
    # the side branch freed would otherwise tie the origin's work to the branch's.
    x = torch.ones(1024, device=be.device)
    g = be.Graph()
    with be.graph(g):
        origin, side = be.current_stream(), another_stream(be)
        side.wait_stream(origin)
        with be.stream(side):
            first = x * 2
            address = first.data_ptr()
            del first
        second = x * 3
        origin.wait_stream(side)
    return "same address" if second.data_ptr() == address else "new address"


_NEW_OWNERS = "read the new owner's"


def _freed_while_a_branch_reads_it(be: Any, kept_by: str) -> str:
    """The origin frees a block the side branch reads, then allocates a block of its size: where
    that block lands, and what the branch reads at replay. `kept_by`: what keeps the block for
    the branch ("nothing", "record_stream", or the origin's "join" with the branch before the
    free). On cuda the branch starts late (`busy`); on sim a replay's seed picks the order."""
    x = torch.ones(64, device=be.device)
    g = be.Graph()
    with be.graph(g):
        origin, side = be.current_stream(), another_stream(be)
        first = x * 2
        address = first.data_ptr()
        side.wait_stream(origin)
        with be.stream(side):
            busy(be)
            seen = first + 1
        if kept_by == "record_stream":
            first.record_stream(side)
        elif kept_by == "join":
            origin.wait_stream(side)
        del first
        second = x * 50
        origin.wait_stream(side)
    where = "same address" if second.data_ptr() == address else "new address"

    def trial() -> str:
        x.fill_(1.0)
        g.replay()
        be.synchronize()
        if bool((seen == 51.0).all()):
            return _NEW_OWNERS
        return "read its own" if bool((seen == 3.0).all()) else "read something else"

    return f"{where}, {racy(be, trial, shows=_NEW_OWNERS)}"


@case("same address, read the new owner's")
def a_block_freed_under_a_graph_branch_goes_to_the_next_allocation(be: Any) -> str:
    return _freed_while_a_branch_reads_it(be, "nothing")


@case("new address, read its own")
def record_stream_keeps_a_block_for_a_graph_branch_until_capture_end(be: Any) -> str:
    return _freed_while_a_branch_reads_it(be, "record_stream")


@case("same address, read its own")
def a_block_freed_after_joining_its_reader_branch_is_reused_safely(be: Any) -> str:
    return _freed_while_a_branch_reads_it(be, "join")


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


def _capture_again_into_a_pool(be: Any, keep_one: bool, outputs_die: str) -> str:
    """Two graphs captured into one pool handle, both reset (or one kept), then a third capture
    into the same handle. `outputs_die`: when the first two graphs' outputs are dropped
    ("before the reset", "after the reset" or "never"). CUDA frees a pool whose graphs were all
    reset once none of its blocks is in use, and refuses to share it until then."""
    x = torch.ones(4, device=be.device)
    pool = be.graph_pool_handle()
    g1, g2 = be.Graph(), be.Graph()
    with be.graph(g1, pool=pool):
        outputs = [x * 2]
    with be.graph(g2, pool=pool):
        outputs.append(x * 3)
    if outputs_die == "before the reset":
        outputs.clear()
    g1.reset()
    if not keep_one:
        g2.reset()
    if outputs_die == "after the reset":
        outputs.clear()
    g3 = be.Graph()
    with be.graph(g3, pool=pool):
        y3 = x * 4
    g3.replay()
    return value(be, y3)


@case("raises RuntimeError")
def capture_into_a_pool_whose_graphs_were_all_reset_while_an_output_lives(be: Any) -> str:
    return _capture_again_into_a_pool(be, keep_one=False, outputs_die="never")


@case("value=[4.0, 4.0, 4.0, 4.0]")
def capture_into_a_pool_one_of_whose_graphs_lives(be: Any) -> str:
    return _capture_again_into_a_pool(be, keep_one=True, outputs_die="never")


@case("value=[4.0, 4.0, 4.0, 4.0]")
def capture_into_a_pool_whose_graphs_were_reset_after_their_outputs_died(be: Any) -> str:
    return _capture_again_into_a_pool(be, keep_one=False, outputs_die="before the reset")


@case("value=[4.0, 4.0, 4.0, 4.0]")
def capture_into_a_pool_whose_outputs_died_after_its_graphs_were_reset(be: Any) -> str:
    return _capture_again_into_a_pool(be, keep_one=False, outputs_die="after the reset")


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
