"""What the sim cannot run, refused at first use rather than computed wrongly.

The sim runs a device operation as the CPU kernel of the same ATen operator. An operator with a
CUDA kernel and no CPU or composite one (a custom CUDA extension, an op registered with
`torch.library` for CUDA only) has nothing the sim could run; neither has a question about the real
hardware (driver calls, device properties beyond the plausible ones the drop-in gives).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map_only

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.ops import OpFacts


# Why most calls the sim refuses cannot run on it.
NOT_PURE_PYTORCH = (
    "the sim runs pure-PyTorch runners (ATen operators with a CPU kernel), not custom CUDA "
    "extensions, Triton kernels or the CUDA driver"
)


class SimUnsupportedError(RuntimeError):
    """A call the sim cannot run; the message names it, and why (`why`)."""

    def __init__(self, what: str, why: str = NOT_PURE_PYTORCH) -> None:
        super().__init__(
            f"{what} cannot run on the sim: {why}; run this on a GPU (--graphmode-backend=cuda)"
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


class SimKernelMissing(SimUnsupportedError, NotImplementedError):
    """The CPU kernel of an operator has no case for these dtypes. A `NotImplementedError` as
    torch's own is, so that a runner's fallback for a kernel a device lacks takes it."""


# (operator, the dtypes of its tensor arguments) whose CPU kernel the sim has tried -> None when
# it has a case for them, else what its kernel said
_TRIED: dict[tuple[int, tuple[torch.dtype, ...]], str | None] = {}


def check_kernel_dtypes(
    op: OpFacts,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tensors: list[torch.Tensor],
    internal: Callable[[Any], Any],
) -> None:
    """Raise `SimKernelMissing` now for an operation the sim will run later (queued on a side
    stream, or recorded in a capture) whose CPU kernel has no case for its dtypes (the CPU has no
    float8 `index_copy_`, say). A GPU checks dtypes when the operation is called; the CPU kernel
    would raise only when the work ran, from whatever call ran the queue, and a runner's fallback
    around the call (transformers' `try: index_copy_ except NotImplementedError`) would never see
    it. `tensors`: the call's tensor arguments, lists flattened. Tried once per operator and
    dtypes, on copies of the arguments (the sim's own work,
    `internal`); any other error of the trial (a value the queued work has not written yet) is
    left to the operation itself. Random operations are not tried: a trial would draw."""
    key = (id(op.func), tuple(t.dtype for t in tensors))
    if key not in _TRIED:
        _TRIED[key] = _trial(op, args, kwargs, internal)
    missing = _TRIED[key]
    if missing is not None:
        raise SimKernelMissing(f"{op.name} on {', '.join(map(str, key[1]))} ({missing})")


def _trial(
    op: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any], internal: Callable[[Any], Any]
) -> str | None:
    if torch.Tag.nondeterministic_seeded in op.func.tags:
        return None

    def trial() -> None:
        copied_args, copied_kwargs = tree_map_only(torch.Tensor, torch.Tensor.clone, (args, kwargs))
        op.func(*copied_args, **copied_kwargs)

    try:
        internal(trial)
    except NotImplementedError as error:
        return str(error)
    except Exception:  # not a kernel the CPU lacks: the operation itself decides, when it runs
        return None
    return None
