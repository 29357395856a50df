"""Which ATen operations copy between host memory and a cuda device, and their host end."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def copy_device(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], non_blocking: bool | None
) -> torch.device | None:
    """The cuda device whose current stream runs `func(*args, **kwargs)`, when that is a copy
    between host memory and a cuda device, non-blocking or not as asked (None: either); None
    otherwise."""
    if func is torch.ops.aten.copy_.default:
        destination, source = args[0], args[1]
        asked = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        ends = (destination.device, source.device)
    elif func is torch.ops.aten._to_copy.default:
        source = args[0]
        asked = kwargs.get("non_blocking", False)
        target = kwargs.get("device")
        ends = (source.device, source.device if target is None else torch.device(target))
    else:
        return None
    if non_blocking is not None and bool(asked) != non_blocking:
        return None
    return crossing_device(*ends)


def crossing_device(one: torch.device, other: torch.device) -> torch.device | None:
    """The cuda end of a copy between host memory and a cuda device; None for any other pair."""
    kinds = {one.type, other.type}
    if kinds != {"cpu", "cuda"}:
        return None
    return one if one.type == "cuda" else other


def host_end(func: Any, args: Sequence[Any], result: Any) -> tuple[torch.Tensor, bool]:
    """The host end of the copy between host and device `func(*args)` that returned `result`,
    and whether the copy is an upload (host to device)."""
    if func is torch.ops.aten.copy_.default:
        destination, source = args[0], args[1]
        return (source, True) if source.device.type == "cpu" else (destination, False)
    source = args[0]  # aten._to_copy: the copy is its result
    return (source, True) if source.device.type == "cpu" else (result, False)
