"""A runner's own operators written in Python (`torch.library.custom_op`, as vLLM keeps attention
opaque): CUDA runs their Python once, when they are called, so a capture records the kernels that
Python launched then. On sim each case runs in the drop-in, as a runner's code does."""

from __future__ import annotations

from typing import Any

import torch

from pytest_graphmode.runtime import backends
from tests.conformance.case import case, value

# A host value the operator reads when it runs, as vLLM's read their forward context.
_host = {"scale": 1.0}


@torch.library.custom_op("graphmode_conformance::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * _host["scale"]


@_scaled.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("graphmode_conformance::total", mutates_args=())
def _total(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.sum().item())


@_total.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("graphmode_conformance::ramp", mutates_args=("out",))
def _ramp(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x + torch.arange(x.shape[0], device=x.device, dtype=x.dtype))


@case("value=[2.0, 2.0]")
def custom_op_python_runs_once_at_capture(be: Any) -> str:
    # The host value at capture is in the graph; changed before the replay, it is not read.
    with backends.target_scope(be.name):
        x = torch.ones(2, device=be.device)
        g = be.Graph()
        _host["scale"] = 2.0
        with be.graph(g):
            y = torch.ops.graphmode_conformance.scaled(x)
        _host["scale"] = 3.0
        g.replay()
        _host["scale"] = 1.0
        return value(be, y)


@case("raises CaptureError")
def custom_op_reading_the_host_in_a_capture(be: Any) -> str:
    with backends.target_scope(be.name):
        x = torch.ones(2, device=be.device)
        g = be.Graph()
        with be.graph(g):
            y = torch.ops.graphmode_conformance.total(x)
        g.replay()
        return value(be, y)


@case("value=[1.0, 2.0, 3.0], value=[3.0, 4.0, 5.0]")
def custom_op_writing_an_output_made_on_its_inputs_device(be: Any) -> str:
    # It makes a tensor on its input's device, and writes an output the caller allocated; the
    # replay computes from the input's contents then.
    with backends.target_scope(be.name):
        x = torch.ones(3, device=be.device)
        out = torch.zeros(3, device=be.device)
        torch.ops.graphmode_conformance.ramp(x, out)
        eager = value(be, out)
        g = be.Graph()
        with be.graph(g):
            torch.ops.graphmode_conformance.ramp(x, out)
        x.fill_(3.0)
        g.replay()
        return f"{eager}, {value(be, out)}"
