"""What an ATen operation does to memory: classification, capture legality, output shapes.

The sim backend never computes during a capture, so it needs to know, per operation, whether it
aliases (views: metadata only, safe to run at once), writes its arguments (in-place and out=),
allocates fresh outputs (whose shapes come from running it on the meta device), or cannot be captured
at all (it reads device values on the host or has a data-dependent output shape).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten

# Reading a device value on the host, or producing a shape only known after computing.
_HOST_READS = {
    aten._local_scalar_dense.default: "a host read of a device value (.item(), bool(t), int(t))",
    aten.equal.default: "a host read of a device value (torch.equal)",
    aten.is_nonzero.default: "a host read of a device value (bool(t))",
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
}
# Allocation without computation: a replay has nothing to do for these.
EMPTY_OPS = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
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


def capture_violation(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """Why `func` cannot be captured, or None when it can."""
    problem = _operation_violation(func)
    if problem is not None:
        return problem
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and (
        kwargs.get("output_size") is None
    ):
        return "repeat_interleave without output_size (its output shape depends on device values)"
    if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in flat(args[1])
    ):
        return "boolean-mask indexing (it computes nonzero and syncs with the host)"
    return None


@functools.cache
def _operation_violation(func: Any) -> str | None:
    """The part of `capture_violation` that depends on the operation alone: asked for every
    dispatched operation, so computed once per operation."""
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


@functools.cache
def allocates(func: Any) -> bool:
    """The operation makes a fresh tensor (a factory, or any op with a non-aliasing return)."""
    return func in EMPTY_OPS or bool(fresh_return_positions(func))


# The schema facts below are asked for every operation the sim queues or records: each is
# computed once per operation.


@functools.cache
def is_view(func: Any) -> bool:
    """Every return aliases an input without writing it (view, alias, detach, split...)."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


@functools.cache
def _written_positions(func: Any) -> tuple[tuple[int, str], ...]:
    return tuple(
        (i, arg.name)
        for i, arg in enumerate(func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def written_args(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors this call writes in place (self of add_, out= of add.out), in schema order."""
    written: list[torch.Tensor] = []
    for i, name in _written_positions(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        written.extend(t for t in flat(value) if isinstance(t, torch.Tensor))
    return written


def touched(
    func: Any,
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
    if _written_positions(func):
        written = written_args(func, args, kwargs)
        found = [(t, any(t is w for w in written)) for t in tensors]
    else:
        found = [(t, False) for t in tensors]
    found.extend((t, True) for t in fresh)
    return found


@functools.cache
def fresh_return_positions(func: Any) -> tuple[int, ...]:
    return tuple(i for i, r in enumerate(func._schema.returns) if r.alias_info is None)


def fresh_outputs(func: Any, result: Any) -> list[torch.Tensor]:
    """The returns of a call that are new tensors (not its arguments, not views of them)."""
    positions = fresh_return_positions(func)
    if not positions:
        return []
    results = result if isinstance(result, tuple | list) else [result]
    return [t for p in positions for t in flat(results[p]) if isinstance(t, torch.Tensor)]


_META_CACHE: dict[Any, list[Any]] = {}
_META_CACHE_LIMIT = 4096


def _signature(x: Any) -> Any:
    """A hashable stand-in for an argument as far as output metadata goes (a tensor's layout, a
    list's items); raises TypeError for anything unhashable."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, list | tuple):
        return tuple(_signature(i) for i in x)
    hash(x)
    return x


def meta_outputs(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The call's returns computed on the meta device (shapes, strides, dtypes; no data).

    Memoised by argument layout: a runner captures the same shapes over and over, and running an
    operation on the meta device costs far more than looking its result up.
    """
    try:
        key = (func, _signature(list(args)), _signature(sorted(kwargs.items())))
    except TypeError:
        return _compute_meta_outputs(func, args, kwargs)
    cached = _META_CACHE.get(key)
    if cached is None:
        cached = _compute_meta_outputs(func, args, kwargs)
        if len(_META_CACHE) >= _META_CACHE_LIMIT:
            _META_CACHE.clear()
        _META_CACHE[key] = cached
    return cached


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
    return list(out) if isinstance(out, tuple | list) else [out]


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor with this shape and stride spans."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return span * t.element_size()


def assemble_returns(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], fresh: dict[int, torch.Tensor]
) -> Any:
    """The call's return value: fresh outputs by position, written arguments for the rest."""
    count = len(func._schema.returns)
    if count == 0:
        return None
    written = iter(written_args(func, args, kwargs))
    results = [fresh[p] if p in fresh else next(written) for p in range(count)]
    return results[0] if count == 1 else tuple(results)
