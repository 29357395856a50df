"""Stream-ordered frees: a block freed while another stream still uses it.

CUDA's caching allocator hands a freed block to the next allocation of the stream it was allocated
on at once, whatever other streams have queued on it, unless the program called
`record_stream(other)` or ordered the allocating stream after the other stream's use. The copy
stream is held (`busy`) before it reads, so on CUDA the next allocation always takes the block and
overwrites it first. On sim no block is handed out again; its free tracker overwrites the freed
bytes at that allocation instead, and the scheduler seed picks whether the copy ran before it.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.conformance.case import busy, case, racy

_N = 1024  # floats: one small block, taken again whole by the next allocation of its size


def _read_on_a_copy_stream_then_free(be: Any, protect: str) -> str:
    """`intact` if the copy stream read the staged values, `clobbered` if the block's next owner
    (or the sim's overwrite of it) got there first. `protect`: `record_stream`, `wait_stream` or
    nothing."""
    dst = torch.zeros(_N, device=be.device)
    copy_stream = be.Stream()

    def trial() -> str:
        dst.zero_()
        be.synchronize()
        staged = torch.full((_N,), 7.0, device=be.device)  # allocated on the default stream
        copy_stream.wait_stream(be.current_stream())
        with be.stream(copy_stream):
            busy(be)
            dst.copy_(staged)
        if protect == "record_stream":
            staged.record_stream(copy_stream)
        if protect == "wait_stream":
            be.current_stream().wait_stream(copy_stream)
        del staged
        torch.full((_N,), 9.0, device=be.device)  # the default stream's next allocation
        be.synchronize()
        return "intact" if bool((dst == 7.0).all()) else "clobbered"

    return racy(be, trial, shows="clobbered")


@case("clobbered")
def block_freed_while_another_stream_reads_it(be: Any) -> str:
    return _read_on_a_copy_stream_then_free(be, protect="")


@case("intact")
def block_freed_after_record_stream(be: Any) -> str:
    return _read_on_a_copy_stream_then_free(be, protect="record_stream")


@case("intact")
def block_freed_after_waiting_for_the_reading_stream(be: Any) -> str:
    return _read_on_a_copy_stream_then_free(be, protect="wait_stream")
