"""Capture-size schedules: the lists serving engines capture by default, and explicit lists.

Each named kind rebuilds the default list of one engine for a given maximum size, so the planner
can be compared with what an engine would capture at the same maximum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

KINDS = ("vllm", "sglang", "deepinfer", "nanovllm", "pow2")


def _vllm(max_size: int) -> list[int]:
    # [1, 2, 4], steps of 8 below 256, steps of 16 from 256 up to the maximum.
    return [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]


def _sglang(max_size: int) -> list[int]:
    # The default list for plain decode (no speculative decoding, padding enabled).
    return [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_size + 1, 32)]


def _nanovllm(max_size: int) -> list[int]:
    return [1, 2, 4, 8, *range(16, max_size + 1, 16)]


def _pow2(max_size: int) -> list[int]:
    # Powers of two up to the first one that covers max_size; `clamp` trims the last one.
    sizes = [1]
    while sizes[-1] < max_size:
        sizes.append(sizes[-1] * 2)
    return sizes


def _deepinfer(max_size: int, interval: int) -> list[int]:
    if interval < 1:
        raise ValueError(f"deepinfer interval must be >= 1, got {interval}")
    interval = min(interval, max_size)
    sizes: list[int] = []
    size = 1
    while size < interval:
        sizes.append(size)
        size *= 2
    sizes.extend(range(interval, max_size, interval))
    sizes.append(max_size)
    return sizes


_BUILDERS: dict[str, Callable[[int], list[int]]] = {
    "vllm": _vllm,
    "sglang": _sglang,
    "nanovllm": _nanovllm,
    "pow2": _pow2,
}


def _check_size(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def schedule(
    kind: str | Sequence[int],
    max_size: int,
    *,
    align: int = 1,
    clamp: bool = False,
    interval: int = 8,
) -> list[int]:
    """Return the sorted capture sizes of `kind` for batches up to `max_size`.

    `kind` is one of KINDS or an explicit sequence of sizes. Named kinds never exceed max_size
    except "pow2", which ends at the first power of two >= max_size. `align=m` keeps only multiples
    of m plus the largest size (so the maximum stays covered). `clamp=True` drops sizes above
    max_size and always includes max_size itself. `interval` is DeepInfer's step (default 8).
    An explicit list with sizes above max_size is an error unless `clamp=True`.
    """
    max_size = _check_size(max_size, "max_size")
    align = _check_size(align, "align")
    if isinstance(kind, str):
        if kind == "deepinfer":
            sizes = _deepinfer(max_size, interval)
        elif kind in _BUILDERS:
            sizes = [s for s in _BUILDERS[kind](max_size) if s <= max_size or kind == "pow2"]
        else:
            raise ValueError(
                f"unknown schedule kind {kind!r}; use one of {', '.join(KINDS)}"
                " or an explicit list of sizes"
            )
    else:
        sizes = [_check_size(s, "every capture size") for s in kind]
        if not sizes:
            raise ValueError("an explicit schedule needs at least one size")
        too_large = [s for s in sizes if s > max_size]
        if too_large and not clamp:
            raise ValueError(
                f"sizes {sorted(set(too_large))} exceed max_size={max_size};"
                " pass clamp=True to drop them"
            )
    sizes = sorted(set(sizes))
    if clamp:
        sizes = [s for s in sizes if s < max_size] + [max_size]
    if align > 1:
        largest = sizes[-1]
        sizes = [s for s in sizes if s % align == 0 or s == largest]
    return sizes
