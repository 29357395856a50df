"""State of a packed type, judged through its bytes.

An NVFP4 cache keeps two float4 codes a byte (`torch.float4_e2m1fn_x2`), and torch has no CPU
kernel to fill, copy or index such a tensor: the harness's marks, its poisoning of the null block
and its checks would raise on the runner's first step. A twin whose `state()` hands out such a
tensor is therefore given to the harness behind a view of it as `uint8`, the same memory, whose
bytes the harness marks and compares as a quantized cache's codes. Every other twin is the
factory's object itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from pytest_graphmode.contract import GraphTarget

# Packed types this torch has (a name it lacks is no type a runner can hand out).
PACKED = frozenset(
    dtype for dtype in (getattr(torch, "float4_e2m1fn_x2", None),) if dtype is not None
)


class PackedStateAsBytes:
    """`target` with each packed tensor of its `state()` seen as `uint8`; everything else is the
    target's own."""

    def __init__(self, target: GraphTarget) -> None:
        self._wrapped = target

    def state(self) -> Mapping[str, Tensor]:
        return {
            key: tensor.view(torch.uint8) if tensor.dtype in PACKED else tensor
            for key, tensor in self._wrapped.state().items()
        }

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


def packed_state_as_bytes(target: GraphTarget) -> GraphTarget:
    """`target` itself, or, where its `state()` holds a packed type, `PackedStateAsBytes`. A
    `state()` that raises is left for the checks of the twins as made to report."""
    try:
        state = target.state()
    except Exception:
        return target
    if any(tensor.dtype in PACKED for tensor in state.values()):
        return PackedStateAsBytes(target)  # type: ignore[return-value]
    return target
