"""Inference mode, which serving engines run their steps and captures in: a module moved to the
device inside it, a capture of operations autograd would otherwise break up first (`to`,
`reshape`) and of views that outlive the tensors they view, and work issued inside it that the
device runs after the block has ended. On sim each case runs in the drop-in, as a runner's code
does."""

from __future__ import annotations

from typing import Any

import torch

from pytest_graphmode.runtime import backends
from tests.conformance.case import another_stream, busy, case, value


@case("cuda:0 torch.bfloat16 cuda:0")
def module_moved_to_the_device_in_inference_mode(be: Any) -> str:
    with backends.target_scope(be.name), torch.inference_mode():
        layer = torch.nn.Linear(2, 2).to(device="cuda", dtype=torch.bfloat16)
        out = layer(torch.ones(1, 2, device="cuda", dtype=torch.bfloat16))
        return f"{layer.weight.device} {layer.weight.dtype} {out.device}"


@case("value=[3.0, 3.0, 5.0, 5.0]")
def capture_of_a_dtype_change_and_a_reshape_in_inference_mode(be: Any) -> str:
    # `to(dtype)` and a `reshape` of a transposed tensor copy: a replay computes them again.
    with backends.target_scope(be.name), torch.inference_mode():
        x = torch.ones(2, 2, device=be.device)
        g = be.Graph()
        with be.graph(g):
            halves = (x * 2).to(torch.bfloat16)
            flat = halves.t().reshape(4).float() + 1
        x.copy_(torch.tensor([[1.0, 2.0], [1.0, 2.0]], device=be.device))
        g.replay()
        return value(be, flat)


@case("value=[16.0, 16.0, 16.0, 16.0]")
def capture_whose_view_outlives_its_base_in_inference_mode(be: Any) -> str:
    # A view of a temporary is all that is kept of it (`q, k = linear(x).split(...)`): the
    # temporary's memory must stay the graph's while the view is used, and later temporaries of
    # the capture must get other memory.
    with backends.target_scope(be.name), torch.inference_mode():
        x = torch.ones(4, 4, device=be.device)
        g = be.Graph()
        with be.graph(g):
            first, second = (x * 2).split(2, dim=1)
            later = x * 100  # a temporary allocated after the first one's object died
            out = (first + second).sum(-1) + later[:, 0] - 92
        g.replay()
        return value(be, out)


@case("value=[4.0, 4.0]")
def work_issued_in_inference_mode_runs_after_the_block(be: Any) -> str:
    # A replay and an in-place update queued on a side stream inside the block, still queued when
    # the block ends (the side stream first waits for a held default stream), run by the
    # synchronize after it.
    with backends.target_scope(be.name):
        x = torch.ones(2, device=be.device)
        g = be.Graph()
        side = another_stream(be)
        with torch.inference_mode():
            with be.graph(g):
                y = x * 2
            busy(be)
            side.wait_stream(be.current_stream())
            with be.stream(side):
                g.replay()
                y.add_(2)
        return value(be, y)
