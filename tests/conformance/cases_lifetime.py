"""Memory lifetime: a graph holds addresses, not references.

On CUDA a replay after the memory it reads was freed or moved reads (or writes) whatever the caching
allocator keeps there now: no error, wrong data at some later point. Sim reports it instead, so
those cases differ on purpose. None of these cases hands the freed memory back to the driver before
the replay, so on CUDA the replay touches mapped memory and the context stays healthy.
"""

from __future__ import annotations

from typing import Any

import torch

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
