"""`torch.compile` around a runner's code: compiled code that a runner captures itself replays as
its Python would; a compile that captures CUDA graphs of its own (CUDAGraph Trees) the sim does not
build, and refuses by name. On sim each case runs in the drop-in, as a runner's code does."""

from __future__ import annotations

from typing import Any

import torch

from pytest_graphmode.runtime import backends
from tests.conformance.case import case, value


def _layer(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ weight) + 1


@case("value=[3.0, 3.0, 3.0, 3.0]")
def compiled_code_captured_by_the_runner_reads_its_input_at_replay(be: Any) -> str:
    # Compiled on the warm-up call outside the capture, as a runner must on a GPU.
    with backends.target_scope(be.name):
        weight = torch.eye(4, device=be.device)
        compiled = torch.compile(_layer, fullgraph=True, backend="aot_eager")
        x = torch.zeros(1, 4, device=be.device)
        compiled(x, weight)
        g = be.Graph()
        with be.graph(g):
            y = compiled(x, weight)
        x.fill_(2.0)
        g.replay()
        return value(be, y)


@case(
    "value=[3.0, 3.0, 3.0, 3.0]",
    sim="raises SimUnsupportedError",
    why="the sim does not build torch.compile's own CUDA graphs (CUDAGraph Trees); it refuses "
    "them at the call rather than run the function eagerly while the runner counts on graphs",
)
def compile_that_captures_cuda_graphs_of_its_own(be: Any) -> str:
    with backends.target_scope(be.name):
        weight = torch.eye(4, device=be.device)
        compiled = torch.compile(_layer, backend="cudagraphs")
        x = torch.full((1, 4), 2.0, device=be.device)
        for _ in range(3):  # warm-up, record, replay
            y = compiled(x, weight)
        return value(be, y.clone())
