"""What the sim cannot run, refused at first use rather than computed wrongly.

The sim runs a device operation as the CPU kernel of the same ATen operator. An operator with a
CUDA kernel and no CPU or composite one (a custom CUDA extension, an op registered with
`torch.library` for CUDA only) has nothing the sim could run; neither has a question about the real
hardware (driver calls, device properties beyond the plausible ones the drop-in gives).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.ops import OpFacts


class SimUnsupportedError(RuntimeError):
    """A call the sim cannot run; the message names it."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} cannot run on the sim: the sim runs pure-PyTorch runners (ATen operators with "
            "a CPU kernel), not custom CUDA extensions, Triton kernels or the CUDA driver; run "
            "this on a GPU (--graphmode-backend=cuda)"
        )


# Dispatch keys under which an operator has a kernel the sim can run on CPU storage.
_RUNNABLE_KEYS = (
    "CPU",
    "CompositeExplicitAutograd",
    "CompositeExplicitAutogradNonFunctional",
    "CompositeImplicitAutograd",
)


def check_runnable(op: OpFacts) -> None:
    """Raise `SimUnsupportedError` for an operator only a GPU can run (decided once per op, and
    kept in its facts)."""
    if op.runnable is None:
        name = op.func.name()
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        op.runnable = not has(name, "CUDA") or any(has(name, key) for key in _RUNNABLE_KEYS)
    if not op.runnable:
        raise SimUnsupportedError(f"operator {op.func.name()} (it has a CUDA kernel only)")
