"""What an ATen operation does to the bytes of its tensor arguments, read from its schema and a
few known sets: shared by the sim's dispatch (sim/ops.py) and cuda's copies-in-flight reports
(cuda_races.py), which must agree on what counts as a read or a write. Imports torch alone, so
that the cuda path does not load the sim (and the compiler stack it imports)."""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

# Allocation without computation: a replay has nothing to do for these, and they read nothing.
EMPTY_OPS = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
# Questions about two tensors' types and shapes, asked of host and device tensors alike (in
# inference mode `nn.Module.to` asks the first one of the dispatcher): no device work, no read.
METADATA_QUERIES = {aten._has_compatible_shallow_copy_type.default, aten.is_same_size.default}


def is_view(func: Any) -> bool:
    """Every return of `func` aliases an input without writing it (view, alias, detach, split)."""
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


def written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments `func` writes in place (self of add_, out= of add.out)."""
    return tuple(
        (i, arg.name)
        for i, arg in enumerate(func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )
