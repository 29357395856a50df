"""What the caching allocator's counts show a program: serving engines size their KV cache from
them and check their start-up with them (vLLM's memory profiling), so a backend that answers
otherwise sends a correct runner down another path."""

from __future__ import annotations

import gc
from typing import Any

import torch

from pytest_graphmode.runtime import backends
from tests.conformance.case import case

_MIB = 1 << 20


def _settled() -> None:
    """No tensor of an earlier case lingers, and no freed memory stays cached."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@case("+4096 for 4000 bytes, +0 for a view, -4096 when freed")
def allocations_count_in_512_byte_blocks(be: Any) -> str:
    with backends.target_scope(be.name):
        _settled()
        start = torch.cuda.memory_allocated()
        x = torch.empty(1000, device=be.device)
        made = torch.cuda.memory_allocated() - start
        view = x[10:]
        viewed = torch.cuda.memory_allocated() - start - made
        del x, view
        freed = torch.cuda.memory_allocated() - start - made
        return f"+{made} for 4000 bytes, +{viewed} for a view, {freed} when freed"


@case("peak 2 MiB above the start, current 1 MiB, peak 1 MiB after the reset")
def peak_counts_the_most_held_at_once(be: Any) -> str:
    with backends.target_scope(be.name):
        _settled()
        x = torch.ones(_MIB // 4, device=be.device)
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_stats()["allocated_bytes.all.current"] - _MIB
        doubled = x * 2  # a temporary as large as x
        del doubled
        stats = torch.cuda.memory_stats()
        peak = (stats["allocated_bytes.all.peak"] - start) // _MIB
        current = (stats["allocated_bytes.all.current"] - start) // _MIB
        torch.cuda.reset_peak_memory_stats()
        after_reset = (torch.cuda.max_memory_allocated() - start) // _MIB
        del x
        return (
            f"peak {peak} MiB above the start, current {current} MiB, "
            f"peak {after_reset} MiB after the reset"
        )


@case("freed memory stays reserved (+16 MiB); empty_cache gives it back (+0 MiB)")
def empty_cache_gives_back_freed_memory(be: Any) -> str:
    with backends.target_scope(be.name):
        _settled()
        start = torch.cuda.memory_reserved()
        x = torch.empty(16 * _MIB, dtype=torch.uint8, device=be.device)
        del x
        kept = (torch.cuda.memory_reserved() - start) // _MIB
        torch.cuda.empty_cache()
        after = (torch.cuda.memory_reserved() - start) // _MIB
        return (
            f"freed memory stays reserved (+{kept} MiB); empty_cache gives it back (+{after} MiB)"
        )


@case("free memory falls by 64 MiB, and rises by 64 MiB after empty_cache")
def free_memory_falls_with_what_is_reserved(be: Any) -> str:
    with backends.target_scope(be.name):
        _settled()
        free_before, _ = torch.cuda.mem_get_info()
        x = torch.empty(64 * _MIB, dtype=torch.uint8, device=be.device)
        free_holding, _ = torch.cuda.mem_get_info()
        del x
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info()
        return (
            f"free memory falls by {(free_before - free_holding) // _MIB} MiB, and rises by "
            f"{(free_after - free_holding) // _MIB} MiB after empty_cache"
        )


@case("+4096 after the capture (its output), +0 once the output is freed")
def a_graphs_output_counts_as_allocated(be: Any) -> str:
    with backends.target_scope(be.name):
        x = torch.ones(1000, device=be.device)
        # While no graph is alive, a capture also allocates the default generator's seed and
        # offset for graphs (1 KiB on cuda, kept until the last graph goes): a graph held through
        # the measurement keeps them allocated, whatever earlier cases left alive.
        holder = be.Graph()
        with be.graph(holder):
            x.add_(0)
        _settled()
        start = torch.cuda.memory_allocated()
        g = be.Graph()
        with be.graph(g):
            out = x * 2 + 1  # the temporary x * 2 goes back to the graph's pool
        held = torch.cuda.memory_allocated() - start
        del out
        gc.collect()
        freed = torch.cuda.memory_allocated() - start
        del g, holder
        return f"+{held} after the capture (its output), +{freed} once the output is freed"


@case("32 KiB in an open segment: free memory falls by 0 KiB, reserved grows by 0 KiB")
def small_blocks_come_from_an_open_segment(be: Any) -> str:
    # Blocks up to 1 MiB come out of 2 MiB segments: once one is open, small allocations leave
    # the driver's free memory where it was (vLLM <= 0.11's strict profiling check then fails).
    with backends.target_scope(be.name):
        _settled()
        held = torch.empty(256, device=be.device)  # opens a segment, or lands in an open one
        _settled()
        free_before, _ = torch.cuda.mem_get_info()
        reserved_before = torch.cuda.memory_reserved()
        more = [torch.empty(1024, device=be.device) for _ in range(8)]
        fell = (free_before - torch.cuda.mem_get_info()[0]) // 1024
        grew = (torch.cuda.memory_reserved() - reserved_before) // 1024
        del held, more
        return f"32 KiB in an open segment: free memory falls by {fell} KiB, reserved grows by {grew} KiB"


@case("a 3 MiB block reserves 20 MiB; a second one reserves nothing more")
def mid_sized_blocks_share_a_20_mib_segment(be: Any) -> str:
    with backends.target_scope(be.name):
        _settled()
        start = torch.cuda.memory_reserved()
        one = torch.empty(3 * _MIB, dtype=torch.uint8, device=be.device)
        first = (torch.cuda.memory_reserved() - start) // _MIB
        two = torch.empty(3 * _MIB, dtype=torch.uint8, device=be.device)
        second = (torch.cuda.memory_reserved() - start) // _MIB - first
        del one, two
        return (
            f"a 3 MiB block reserves {first} MiB; a second one reserves {second or 'nothing'} more"
        )


@case("-16 MiB when its storage is resized to nothing, +16 MiB when resized back")
def a_storage_resized_in_place_frees_and_takes_its_block(be: Any) -> str:
    # FSDP and sleep modes free memory under live tensors this way; no tensor operation runs.
    with backends.target_scope(be.name):
        _settled()
        x = torch.empty(16 * _MIB, dtype=torch.uint8, device=be.device)
        held = torch.cuda.memory_allocated()
        x.untyped_storage().resize_(0)
        emptied = (torch.cuda.memory_allocated() - held) // _MIB
        x.untyped_storage().resize_(16 * _MIB)
        back = (torch.cuda.memory_allocated() - held) // _MIB - emptied
        del x
        return (
            f"{emptied} MiB when its storage is resized to nothing, +{back} MiB when resized back"
        )
