"""Memory lifetime: a graph holds addresses, not references.

On CUDA a replay after the memory it reads was freed or moved reads (or writes) whatever the caching
allocator keeps there now: no error, wrong data at some later point. Sim reports it instead, so
those cases differ on purpose. None of these cases hands the freed memory back to the driver before
the replay, so on CUDA the replay touches mapped memory and the context stays healthy.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_graphmode.runtime.backends.sim.capture import KEEPS_CAPTURED_PINNED_BLOCKS
from tests.conformance.case import case, value

_USE_AFTER_FREE = "sim reports a replay that touches freed memory; CUDA silently reads it"


@case("replayed", sim="raises UseAfterFreeError", why=_USE_AFTER_FREE)
def weight_rebound_and_freed(be: Any) -> str:
    layer = {"weight": torch.ones(4, 4, device=be.device)}
    x = torch.ones(1, 4, device=be.device)
    x @ layer["weight"]  # warm-up: the first matmul creates the cuBLAS handle
    g = be.Graph()
    with be.graph(g):
        x @ layer["weight"]
    g.replay()
    layer["weight"] = torch.zeros(4, 4, device=be.device)  # the captured weight is freed
    g.replay()
    be.synchronize()
    return "replayed"


@case("replayed", sim="raises UseAfterFreeError", why=_USE_AFTER_FREE)
def static_input_deleted(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        x * 2
    g.replay()
    del x
    g.replay()
    be.synchronize()
    return "replayed"


@case("replayed", sim="raises UseAfterFreeError", why=_USE_AFTER_FREE)
def workspace_grown_by_resize_after_capture(be: Any) -> str:
    workspace = torch.zeros(16, device=be.device)
    g = be.Graph()
    with be.graph(g):
        workspace.add_(1)
    workspace.resize_(1 << 16)  # grows: new storage, the captured one is freed
    g.replay()
    be.synchronize()
    return "replayed"


@case("value=[1.0, 1.0, 1.0, 1.0]")
def workspace_shrunk_by_resize_after_capture(be: Any) -> str:
    workspace = torch.zeros(16, device=be.device)
    g = be.Graph()
    with be.graph(g):
        workspace.add_(1)
    workspace.resize_(4)  # shrinking keeps the storage where it is
    g.replay()
    return value(be, workspace)


@case("value=[1.0, 1.0, 1.0, 1.0]")
def output_kept_by_a_view_after_its_base_is_dropped(be: Any) -> str:
    x = torch.ones(8, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 1
    head = y[:4]
    del y
    x.fill_(1.0)
    g.replay()
    return value(be, head)


@case("value=[2.0, 2.0, 2.0, 2.0]")
def input_dropped_after_its_replay_was_issued(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 2
    be.synchronize()
    g.replay()
    # The replay is issued: the caching allocator hands x's block out again only in the order
    # of this stream, after the replay ran.
    del x
    return value(be, y)


# Torch's caching host allocator allocates a pinned block made during a capture to the graph's
# pool and keeps it for the pool's life from 2.11 on (pytorch#167507), and the sim does the same
# under that torch. Before it, the block could be handed out again while the graph still copies
# through it, which the sim reports as a use after free. A pinned block made before the capture
# is not kept: it goes back to the allocator with its last reference, on any release.
_MADE_IN_CAPTURE = (
    {}
    if KEEPS_CAPTURED_PINNED_BLOCKS
    else {
        "sim": "raises UseAfterFreeError",
        "why": "torch before 2.11 may hand the block out again; sim reports the replay's access",
    }
)


def _pinned_blocks_like(be: Any, size: int, fill: float) -> list[torch.Tensor]:
    """Pinned blocks of `size` floats filled with `fill`: where the allocator hands a freed
    block out again, one of them may take it."""
    blocks = [be.empty_pinned(size) for _ in range(4)]
    for block in blocks:
        block.fill_(fill)
    return blocks


@case("replayed", sim="raises UseAfterFreeError", why=_USE_AFTER_FREE)
def pinned_source_made_before_the_capture_dropped_after_it(be: Any) -> str:
    source = be.empty_pinned(4)
    source.fill_(1.0)
    static = torch.zeros(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        static.copy_(source, non_blocking=True)
    del source  # back to the host allocator, which may hand it out again (seen on the H200)
    g.replay()
    be.synchronize()
    return "replayed"


@case("replayed", sim="raises UseAfterFreeError", why=_USE_AFTER_FREE)
def pinned_destination_made_before_the_capture_dropped_after_it(be: Any) -> str:
    result = be.empty_pinned(4)
    x = torch.full((4,), 3.0, device=be.device)
    g = be.Graph()
    with be.graph(g):
        result.copy_(x, non_blocking=True)
    del result  # a replay may now write into a block handed out again (seen on the H200)
    g.replay()
    be.synchronize()
    return "replayed"


@case("value=[1.0, 1.0, 1.0, 1.0]", **_MADE_IN_CAPTURE)
def pinned_source_made_in_the_capture_dropped_after_it(be: Any) -> str:
    _pinned_blocks_like(be, 4, 0.0)  # made and dropped: cached, the capture allocates none
    static = torch.zeros(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        source = be.empty_pinned(4)
        source.fill_(1.0)  # host code: runs at once, as the capture is recorded
        static.copy_(source, non_blocking=True)
    del source
    others = _pinned_blocks_like(be, 4, 9.0)
    static.zero_()
    g.replay()
    be.synchronize()
    del others
    return value(be, static)


@case("intact", **_MADE_IN_CAPTURE)
def pinned_destination_made_in_the_capture_dropped_after_it(be: Any) -> str:
    _pinned_blocks_like(be, 4, 0.0)  # made and dropped: cached, the capture allocates none
    x = torch.full((4,), 3.0, device=be.device)
    g = be.Graph()
    with be.graph(g):
        result = be.empty_pinned(4)
        result.copy_(x, non_blocking=True)
    del result
    others = _pinned_blocks_like(be, 4, 9.0)
    g.replay()
    be.synchronize()
    return "intact" if all(bool((o == 9.0).all()) for o in others) else "another block written"
