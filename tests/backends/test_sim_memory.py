"""The sim's memory ledger: torch.cuda's allocator counts for device tensors that live in host
memory (runtime/backends/sim/memory_ledger.py). The same counts on a GPU are conformance cases
(tests/conformance/cases_memory.py); these pin the paths a case does not reach."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pytest_graphmode.fuzz import run_campaign
from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.backends.sim.drop_in import SIM_MEMORY, drop_in
from pytest_graphmode.runtime.backends.sim.memory_ledger import DeviceMemory
from pytest_graphmode.runtime.target import make_target
from tests.runners.from_docs import memory_profiled_capture

_MIB = 1 << 20


def _settled() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


@contextmanager
def _fresh_ledger() -> Iterator[DeviceMemory]:
    """The sim backend (one per process) with a ledger no question has started yet."""
    be = backends.get("sim")
    kept, be.memory = be.memory, DeviceMemory()
    try:
        yield be.memory
    finally:
        be.memory = kept


def test_counts_start_at_the_first_question_and_earlier_tensors_stay_out() -> None:
    with _fresh_ledger() as memory, drop_in():
        early = torch.empty(1000, device="cuda")
        assert not memory.counting
        assert torch.cuda.memory_allocated() == 0  # the first question: counting starts
        assert memory.counting
        late = torch.empty(1000, device="cuda")
        assert torch.cuda.memory_allocated() == 4096
        del early
        gc.collect()
        assert torch.cuda.memory_allocated() == 4096  # never counted, so never taken off
        del late
        assert torch.cuda.memory_allocated() == 0


def test_the_shipped_runtimes_campaign_never_asks_so_never_pays_for_counting() -> None:
    with _fresh_ledger() as memory:
        stats = run_campaign(make_target, backend="sim", max_examples=3, max_steps=4, seed=0)
        assert stats.steps > 0
        assert not memory.counting


def test_a_side_streams_queued_output_counts_from_the_call() -> None:
    # The output exists (poisoned) from the call on: CUDA allocates it when the kernel is queued.
    with drop_in():
        start = _settled()
        x = torch.ones(1000, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
            queued = torch.cuda.memory_allocated() - start
        torch.cuda.synchronize()
        assert queued == 2 * 4096
        del x, y
        assert _settled() == start


def test_a_grown_storage_counts_its_new_size_and_a_shrunk_one_keeps_its_block() -> None:
    with drop_in():
        start = _settled()
        x = torch.empty(10, device="cuda")
        x.resize_(100_000)
        assert torch.cuda.memory_allocated() - start == 400_384  # 400,000 rounded to 512
        x.resize_(10)
        assert torch.cuda.memory_allocated() - start == 400_384
        del x
        assert _settled() == start


def test_pool_storage_is_never_counted_only_the_blocks_a_capture_hands_out() -> None:
    with drop_in():
        x = torch.ones(1000, device="cuda")
        pool = torch.cuda.graph_pool_handle()
        start = _settled()
        blocks = torch.cuda.memory_stats()["allocation.all.current"]
        outs, graphs = [], []
        for _ in range(3):  # three captures share the pool's first chunk
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                outs.append(x * 2 + 1)
            graphs.append(g)
        assert torch.cuda.memory_allocated() - start == 3 * 4096
        assert torch.cuda.memory_stats()["allocation.all.current"] == blocks + 3
        outs.clear()
        gc.collect()
        assert torch.cuda.memory_allocated() == start
        graphs.clear()
        del pool
        assert _settled() == start


def test_frees_in_another_thread_are_counted_once_settled() -> None:
    # The weak references' callbacks run in whichever thread frees the storage; they only queue.
    with drop_in():
        start = _settled()
        held = [torch.empty(1000, device="cuda") for _ in range(4)]
        assert torch.cuda.memory_allocated() - start == 4 * 4096

        def free() -> None:
            held.clear()

        thread = threading.Thread(target=free)
        thread.start()
        thread.join()
        assert torch.cuda.memory_allocated() == start
        assert torch.cuda.max_memory_allocated() >= start + 4 * 4096


def test_accumulated_counts_reset_apart_from_current_ones() -> None:
    with drop_in():
        _settled()
        torch.cuda.reset_accumulated_memory_stats()
        x = torch.empty(1000, device="cuda")
        del x
        stats = torch.cuda.memory_stats()
        assert stats["allocated_bytes.all.allocated"] == stats["allocated_bytes.all.freed"] == 4096
        assert stats["allocation.small_pool.allocated"] == 1
        assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"]
        torch.cuda.reset_accumulated_memory_stats()
        assert torch.cuda.memory_stats()["allocated_bytes.all.allocated"] == 0
        summary = torch.cuda.memory_summary()
        assert "Allocated memory" in summary and "Reserved memory" in summary


def test_segments_reserve_as_the_caching_allocator_does() -> None:
    with _fresh_ledger(), drop_in():
        assert torch.cuda.memory_reserved() == 0
        first = torch.empty(256, device="cuda")  # 1 KiB opens a 2 MiB small segment
        assert torch.cuda.memory_reserved() == 2 * _MIB
        more = [torch.empty(1024, device="cuda") for _ in range(8)]  # 32 KiB fit in it
        assert torch.cuda.memory_reserved() == 2 * _MIB
        mid = torch.empty(3 * _MIB, dtype=torch.uint8, device="cuda")  # a 20 MiB segment
        assert torch.cuda.memory_reserved() == 22 * _MIB
        big = torch.empty(11 * _MIB + 1, dtype=torch.uint8, device="cuda")  # its own, 12 MiB
        assert torch.cuda.memory_reserved() == 34 * _MIB
        del mid, big
        assert torch.cuda.memory_reserved() == 34 * _MIB  # cached until empty_cache
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 2 * _MIB  # the small segment still holds blocks
        del first, more
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 0


def test_a_storage_emptied_in_place_is_seen_at_the_next_question() -> None:
    # `untyped_storage().resize_` passes no operation the sim sees; a view keeps the storage.
    with _fresh_ledger(), drop_in():
        x = torch.empty(4 * _MIB, dtype=torch.uint8, device="cuda")
        view = x[1:]
        assert torch.cuda.memory_allocated() == 0  # made before the first question
        y = torch.empty(4 * _MIB, dtype=torch.uint8, device="cuda")
        y.untyped_storage().resize_(0)
        assert torch.cuda.memory_allocated() == 0
        y.untyped_storage().resize_(2 * _MIB)
        assert torch.cuda.memory_allocated() == 2 * _MIB
        y.untyped_storage().resize_(3 * _MIB)
        assert torch.cuda.memory_allocated() == 3 * _MIB
        del y
        assert torch.cuda.memory_allocated() == 0
        del x, view


def test_vllm_strict_profiling_check_passes_on_sim() -> None:
    # vLLM <= 0.11 asserts that the driver's free memory fell while it loaded and profiled. With a
    # constant free memory the sim failed this correct start-up with "Error in memory profiling".
    # In a fresh process, as on the GPU it passed on: the weights open the first segment.
    be = backends.get("sim")
    with _fresh_ledger(), backends.target_scope("sim"):
        runner = memory_profiled_capture.ProfiledRunner(
            "graph",
            seed=0,
            profile_tokens=memory_profiled_capture.SPEC.max_num_tokens,
            strict_profile_check=True,
        )
        assert runner.weights_memory > 0
        assert runner.graph_memory >= 0
        assert runner.kv_budget["profiled_blocks"] >= memory_profiled_capture.SPEC.num_blocks
        assert be.mem_get_info()[0] < SIM_MEMORY  # its weights, cache and graphs hold segments
