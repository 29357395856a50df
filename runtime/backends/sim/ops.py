"""What an ATen operation does to memory: classification, capture legality, output shapes.

The sim backend never computes during a capture, so it needs to know, per operation, whether it
aliases (views: metadata only, safe to run at once), writes its arguments (in-place and out=),
allocates fresh outputs (whose shapes come from running it on the meta device), or cannot be captured
at all (it reads device values on the host or has a data-dependent output shape).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_map

from pytest_graphmode.runtime.backends.op_kinds import (
    EMPTY_OPS,
    METADATA_QUERIES,
    is_view,
    written_arguments,
)
from pytest_graphmode.runtime.backends.sim.device import on_device
from pytest_graphmode.runtime.backends.sim.float8 import CUDA_ARGUMENT_CHECKS

aten = torch.ops.aten

_STD_READ = "normal with a tensor std (CUDA checks std >= 0 on the host)"
# Reading a device value on the host, or producing a shape only known after computing.
_HOST_READS = {
    aten._local_scalar_dense.default: "a host read of a device value (.item(), bool(t), int(t))",
    aten.equal.default: "a host read of a device value (torch.equal)",
    aten.is_nonzero.default: "a host read of a device value (bool(t))",
    # CUDA checks a tensor std >= 0 with .item() (a tensor mean with a number std is not read)
    aten.normal.Tensor_Tensor: _STD_READ,
    aten.normal.float_Tensor: _STD_READ,
}
_DATA_DEPENDENT = {
    "nonzero",
    "argwhere",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    # CUDA reads the largest value on the host to size the output, also with a minlength
    "bincount",
}
# Advanced indexing: its indices (argument 1) may be host tensors on a device tensor.
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}
# Host data turned into a tensor inside the capture: the graph keeps it as a constant.
CONSTANT_OPS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}

_TENSOR_RETURN_TYPES = {
    "Tensor",
    "Tensor[]",
    "Tensor?",
    "Tensor?[]",
    "List[Tensor]",
    "Optional[Tensor]",
}


def op_name(func: Any) -> str:
    return f"aten.{func.__name__}" if hasattr(func, "__name__") else str(func)


_METADATA_OPS = frozenset(
    {
        aten.resize_,
        aten.resize_as_,
        aten.set_,
        aten.as_strided_,
        aten.squeeze_,
        aten.unsqueeze_,
        aten.transpose_,
        aten.t_,
        aten.swapdims_,
        aten.swapaxes_,
    }
)

# Operations whose CUDA kernel reads a 0-dim tensor value on the host (`value.item()`), and the
# position of that value: a device tensor there is a host read.
_VALUE_READ_ON_THE_HOST = {
    aten.masked_fill.Tensor: 2,
    aten.masked_fill_.Tensor: 2,
    aten.index_fill.int_Tensor: 3,
    aten.index_fill_.int_Tensor: 3,
}
# Operations whose capture legality also depends on their arguments (`capture_violation`).
_ARGUMENT_CHECKED = {
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
    aten.index.Tensor,
    aten.index_put_.default,
    aten.index_put.default,
    aten.histc.default,
    *_VALUE_READ_ON_THE_HOST,
}
_MASK_DTYPES = (torch.bool, torch.uint8)
_RESIZES = {aten.resize_.default, aten.resize_as_.default}
# Operators that are not TensorIterator's: torch checks that every tensor argument is on the
# device, so a 0-dim host tensor is no kernel argument to them (float8.py). The sim knows these
# only; elsewhere it takes a 0-dim host tensor as TensorIterator's kernels do.
_NO_HOST_SCALARS = {aten._scaled_mm.default, aten._scaled_mm.out}


class OpFacts:
    """What the sim needs to know of one operation, derived from its schema once.

    The sim asks these questions for every operation it dispatches; an `OpOverload` is immutable
    and unique per operator overload, so the answers never change while it lives, and the facts
    hold the operation itself, so the `id` they are found by is never reused for another one.
    """

    __slots__ = (
        "allocates",
        "apart",
        "argument_checked",
        "changes_metadata",
        "composite",
        "constant",
        "cuda_check",
        "draws",
        "empty",
        "fresh_positions",
        "func",
        "host_scalars",
        "indexing",
        "is_copy",
        "is_view",
        "metadata_query",
        "name",
        "python_kernel",
        "quiet",
        "resizes",
        "return_count",
        "runnable",
        "violation",
        "written_positions",
    )

    def __init__(self, func: Any) -> None:
        self.func = func
        self.name = op_name(func)
        schema = func._schema
        rets = schema.returns
        self.is_view = is_view(func)
        # Allocation without computation: a replay has nothing to do for these.
        self.empty = func in EMPTY_OPS
        # Metadata or allocation only: nothing to order, nothing for the race checker.
        self.quiet = self.is_view or self.empty
        self.return_count = len(rets)
        self.fresh_positions = tuple(i for i, r in enumerate(rets) if r.alias_info is None)
        self.written_positions = written_arguments(func)
        # The operation makes a fresh tensor (a factory, or any op with a non-aliasing return).
        self.allocates = self.empty or bool(self.fresh_positions)
        # Grows its first argument's storage in place, where CUDA allocates a larger block.
        self.resizes = func in _RESIZES
        # CUDA's own argument checks, where its kernel refuses what the CPU's takes
        self.cuda_check = CUDA_ARGUMENT_CHECKS.get(func)
        # A 0-dim host tensor among its arguments is a kernel argument (`_NO_HOST_SCALARS`).
        self.host_scalars = func not in _NO_HOST_SCALARS
        self.violation = _operation_violation(func)
        self.argument_checked = func in _ARGUMENT_CHECKED
        self.indexing = func in INDEXING
        self.constant = func in CONSTANT_OPS
        self.metadata_query = func in METADATA_QUERIES
        self.python_kernel = _has_python_host_kernel(func)
        # Takes a generator: a draw, bound to a device generator's seed and offset (generators.py)
        self.draws = any(a.name == "generator" for a in schema.arguments)
        # Made of other operations (torch's CompositeImplicitAutograd kernels): the sim meets it
        # only in inference mode (SimBackend._dispatch).
        self.composite = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"
        )
        # Any of the three: the sim does not take it as one device operation (one test on the
        # hot path, SimBackend._dispatch, for what most operations are not)
        self.apart = self.python_kernel or self.composite or self.metadata_query
        self.is_copy = func is aten.copy_.default
        # In place, it changes a tensor's shape or storage rather than its bytes: queued, it must
        # run on the program's own tensor (frees.py holds other work's tensors through aliases).
        self.changes_metadata = getattr(func, "overloadpacket", None) in _METADATA_OPS
        # Whether the CPU can run it, asked of device operations only (limits.check_runnable):
        # None until then.
        self.runnable: bool | None = None


def _has_python_host_kernel(func: Any) -> bool:
    """Whether the operator is a runner's own, whose host kernel is Python (`torch.library`'s
    `custom_op`, or `Library.impl` with a Python function): torch records where a kernel was
    registered, a Python file or `<string>` for these, a C++ source for ATen's and extensions'."""
    if getattr(func, "namespace", "aten") in ("aten", "prims"):
        return False
    table = torch._C._dispatch_dump_table(func.name())
    found = re.search(
        r"^(?:CPU|CompositeExplicitAutograd(?:\[alias\])?): registered at (.+?):\d+ ", table, re.M
    )
    return found is not None and (found.group(1).endswith(".py") or found.group(1).startswith("<"))


_FACTS: dict[int, OpFacts] = {}


def facts(func: Any) -> OpFacts:
    """The facts of `func`, computed at its first use. Keyed by identity: an `OpOverload` hashes
    in Python, an int in C."""
    found = _FACTS.get(id(func))
    if found is None:
        found = _FACTS[id(func)] = OpFacts(func)
    return found


def capture_violation(op: OpFacts, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """Why the operation cannot be captured, or None when it can."""
    if op.violation is not None:
        return op.violation
    if not op.argument_checked:
        return None
    func = op.func
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and (
        kwargs.get("output_size") is None
    ):
        return "repeat_interleave without output_size (its output shape depends on device values)"
    if func in (aten.index_put_.default, aten.index_put.default):
        return _index_put_violation(args, kwargs)
    if func is aten.index.Tensor and any(_is_mask(i) for i in flat(args[1])):
        return _MASK_INDEXING
    if func is aten.histc.default and _argument(args, kwargs, 2, "min", 0) == _argument(
        args, kwargs, 3, "max", 0
    ):
        return "histc without a range (min == max: CUDA reads the data's range on the host)"
    position = _VALUE_READ_ON_THE_HOST.get(func)
    if position is not None and on_device(_argument(args, kwargs, position, "value", None)):
        return (
            f"{op.name} with a device tensor as its value (CUDA reads it on the host, as "
            ".item()): pass a Python number, or use torch.where"
        )
    return None


_MASK_INDEXING = "boolean-mask indexing (it computes nonzero and syncs with the host)"


def _index_put_violation(args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """`x[index] = value` in a capture, as CUDA's index_put_ takes it: one boolean mask on the
    device and a one-element host value (a Python number) become a masked_fill, which is
    captured; any other mask computes nonzero; any other host value is copied to the device
    first (a blocking copy)."""
    indices = [i for i in flat(args[1]) if isinstance(i, torch.Tensor)]
    value = args[2]
    accumulate = bool(_argument(args, kwargs, 3, "accumulate", False))
    masks = [i for i in indices if _is_mask(i)]
    host_value = isinstance(value, torch.Tensor) and not on_device(value)
    if masks:
        fill = len(indices) == 1 and on_device(masks[0]) and not accumulate
        if fill and host_value and value.numel() == 1:
            return None
        return _MASK_INDEXING
    if host_value:
        return (
            "an index assignment of a host value (a Python number or a CPU tensor): CUDA copies "
            "it to the device first, a blocking copy. Assign a device tensor, or use a boolean "
            "mask with a number (a masked_fill)"
        )
    return None


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in _MASK_DTYPES


def _argument(
    args: Sequence[Any], kwargs: dict[str, Any], position: int, name: str, default: Any
) -> Any:
    if position < len(args):
        return args[position]
    return kwargs.get(name, default)


def _operation_violation(func: Any) -> str | None:
    """The part of `capture_violation` that depends on the operation alone."""
    if func in _HOST_READS:
        return _HOST_READS[func]
    if func._schema.name.split("::")[-1] in _DATA_DEPENDENT:
        return "an operation whose output shape depends on device values (it syncs with the host)"
    for ret in func._schema.returns:
        if str(ret.type) not in _TENSOR_RETURN_TYPES:
            return f"an operation returning a host value ({ret.type})"
    return None


def flat(x: Any) -> list[Any]:
    return list(x) if isinstance(x, list | tuple) else [x]


def written_args(op: OpFacts, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors this call writes in place (self of add_, out= of add.out), in schema order."""
    written: list[torch.Tensor] = []
    for i, name in op.written_positions:
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            written.append(value)
        elif isinstance(value, list | tuple):
            written.extend(t for t in value if isinstance(t, torch.Tensor))
    return written


def touched(
    op: OpFacts,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    fresh: Sequence[torch.Tensor],
    tensors: Sequence[torch.Tensor] | None = None,
) -> list[tuple[torch.Tensor, bool]]:
    """Every tensor the call touches and whether it writes it: its written arguments and fresh
    outputs are written, its other tensor arguments read. `tensors`: the tensor arguments (lists
    flattened), when the caller has them already."""
    if tensors is None:
        tensors = [t for x in (*args, *kwargs.values()) for t in flat(x)]
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if op.written_positions:
        written = written_args(op, args, kwargs)
        found = [(t, any(t is w for w in written)) for t in tensors]
    else:
        found = [(t, False) for t in tensors]
    found.extend((t, True) for t in fresh)
    return found


def fresh_outputs(op: OpFacts, result: Any) -> list[torch.Tensor]:
    """The returns of a call that are new tensors (not its arguments, not views of them)."""
    positions = op.fresh_positions
    if not positions:
        return []
    if not isinstance(result, tuple | list):
        # one return: a tensor (or None, for an optional one)
        return [result] if isinstance(result, torch.Tensor) else []
    return [t for p in positions for t in flat(result[p]) if isinstance(t, torch.Tensor)]


_META_CACHE: dict[Any, list[Any]] = {}
_META_CACHE_LIMIT = 4096


def _signature(items: Sequence[Any]) -> tuple[Any, ...]:
    """A hashable stand-in for a sequence of arguments as far as output metadata goes (a tensor's
    layout, a list's items, a scalar with its type: 1, 1.0 and True are equal keys but make
    different dtypes); raises TypeError for anything unhashable."""
    found: list[Any] = []
    for x in items:
        if isinstance(x, torch.Tensor):
            found.append(("tensor", x.shape, x.stride(), x.dtype))
        elif isinstance(x, list | tuple):
            found.append(_signature(x))
        else:
            hash(x)
            found.append((x.__class__, x))
    return tuple(found)


class Layout(NamedTuple):
    """The metadata of a fresh output, without a tensor (`meta_outputs` hands these out)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    itemsize: int
    nbytes: int  # bytes its shape and stride span


def _layout(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    shape, stride = tuple(t.shape), tuple(t.stride())
    itemsize = t.element_size()
    if t.numel() == 0:
        nbytes = 0
    else:
        nbytes = (1 + sum((n - 1) * step for n, step in zip(shape, stride, strict=True))) * itemsize
    return Layout(shape, stride, t.dtype, itemsize, nbytes)


def meta_outputs(op: OpFacts, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The layouts of the call's returns, computed on the meta device (no data).

    Memoised by argument layout: a runner captures the same shapes over and over, and running an
    operation on the meta device costs far more than looking its result up. Keyed by the
    operation's facts, which hash by identity and live as long as the process (`facts`).
    """
    func = op.func
    try:
        key = (op, _signature(args), _signature(sorted(kwargs.items())) if kwargs else ())
    except TypeError:
        return _compute_meta_outputs(func, args, kwargs)
    cached = _META_CACHE.get(key)
    if cached is None:
        cached = _compute_meta_outputs(func, args, kwargs)
        if len(_META_CACHE) >= _META_CACHE_LIMIT:
            _META_CACHE.clear()
        _META_CACHE[key] = cached
    return cached


def checked_layouts(op: OpFacts, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The layouts of an operation's returns that is queued or recorded rather than run, its
    arguments checked as at the call.

    CUDA checks an operation's arguments (shapes, dimensions, dtypes) on the host before it
    queues a kernel, so a mistake raises at the call; queued unchecked, it raised when the queue
    ran, in whatever operation came next, even another twin's. Checked on the meta device, once
    per argument layout (`meta_outputs`). A draw that makes nothing fresh is left to its run: a
    kernel without a meta form is run on copies there, and a draw on copies would move its
    generator.
    """
    if op.fresh_positions or not op.draws:
        return meta_outputs(op, args, kwargs)
    return []


def _compute_meta_outputs(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:

    def to_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return x

    margs, mkwargs = tree_map(to_meta, (list(args), dict(kwargs)))
    if "device" in mkwargs:
        mkwargs["device"] = torch.device("meta")
    try:
        out = func(*margs, **mkwargs)
    except (NotImplementedError, RuntimeError):
        # Some CPU kernels have no meta implementation: compute on copies, keep only the metadata.
        cargs, ckwargs = tree_map(
            lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (list(args), dict(kwargs))
        )
        out = func(*cargs, **ckwargs)
    return [_layout(t) for t in out] if isinstance(out, tuple | list) else [_layout(out)]


def assemble_returns(
    op: OpFacts, args: Sequence[Any], kwargs: dict[str, Any], fresh: dict[int, torch.Tensor]
) -> Any:
    """The call's return value: fresh outputs by position, written arguments for the rest."""
    count = op.return_count
    if count == 0:
        return None
    if count == 1 and 0 in fresh:
        return fresh[0]
    written = iter(written_args(op, args, kwargs))
    results = [fresh[p] if p in fresh else next(written) for p in range(count)]
    return results[0] if count == 1 else tuple(results)
