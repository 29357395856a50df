"""Which bytes an operation touches, and which line of the program issued it.

A tensor's footprint is the byte interval of its storage that its elements span, plus its layout
when it does not cover that interval densely (a strided view, an expanded tensor): two views of one
buffer whose intervals overlap conflict only if they share a byte, which `overlap` decides from the
layouts. The sim's race checker (sim/happens_before.py) keys its history by storage base address
and keeps footprints, never tensors or storages, so it keeps no memory alive; cuda's reports of
copies in flight (cuda_races.py) keep them the same way. Imports torch alone: the cuda path uses it
without loading the sim.
"""

from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

import pytest_graphmode.runtime.backends as _backends_package

# Above this many elements, strided overlap is not refined: the intervals' overlap is reported.
_REFINE_LIMIT = 1 << 18


class Footprint(NamedTuple):
    """The bytes of one storage that a tensor covers (a tuple: made for every tensor of every
    operation, so it must be cheap)."""

    storage: int  # base address of the storage: the key of its access history
    lo: int  # first byte, relative to the storage
    hi: int  # one past the last byte
    # (storage offset, sizes, strides) in elements, when the tensor skips bytes of [lo, hi)
    strided: tuple[int, tuple[int, ...], tuple[int, ...]] | None
    itemsize: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None for a range of bytes (a graph's merged accesses)

    def describe(self) -> str:
        if self.dtype is None:
            return f"{self.hi - self.lo} bytes of graph memory"
        return f"tensor {list(self.shape)} {str(self.dtype).removeprefix('torch.')}"

    def covers(self, other: Footprint) -> bool:
        """Every byte of `other` is one of this footprint's (decided for dense footprints)."""
        if self == other:
            return True
        return self.strided is None and self.lo <= other.lo and other.hi <= self.hi


# A Footprint made without the keyword handling of the NamedTuple's own constructor: `of` runs
# for every tensor of every operation.
_new = tuple.__new__


def of(t: torch.Tensor) -> tuple[torch.UntypedStorage, Footprint] | None:
    """The storage of `t` and the footprint of `t` in it; None for an empty tensor."""
    storage = t.untyped_storage()
    item = t.element_size()
    offset = t.storage_offset()
    lo = offset * item
    if t.is_contiguous():
        nbytes = t.numel() * item
        if nbytes == 0:
            return None
        return storage, _new(
            Footprint, (storage.data_ptr(), lo, lo + nbytes, None, item, t.shape, t.dtype)
        )
    numel = t.numel()
    if numel == 0:
        return None
    shape, stride = tuple(t.shape), t.stride()
    span = 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    # span == numel: every element slot of the interval is one of the tensor's elements.
    strided = None if span == numel else (offset, shape, tuple(stride))
    return storage, _new(
        Footprint, (storage.data_ptr(), lo, lo + span * item, strided, item, shape, t.dtype)
    )


def byte_range(storage: int, lo: int, hi: int) -> Footprint:
    """A dense range of bytes with no tensor of its own (what a graph replay touches)."""
    return Footprint(storage, lo, hi, None, 1, (hi - lo,), None)


def merge(touched: Iterable[tuple[Footprint, bool]]) -> list[tuple[Footprint, bool]]:
    """The same bytes in fewer footprints: dense ranges of one storage read (or written) are
    united where they meet; strided footprints are kept as they are, each once. A graph replay
    checks its accesses at every launch, so they are merged once, at capture end."""
    kept: dict[tuple[Footprint, bool], None] = {}
    dense: dict[tuple[int, bool], set[Footprint]] = {}
    for fp, write in touched:
        if fp.strided is None:
            dense.setdefault((fp.storage, write), set()).add(fp)
        else:
            kept[(fp, write)] = None
    merged = list(kept)
    for (storage, write), fps in dense.items():
        run: list[Footprint] = []
        end = 0
        for fp in sorted(fps, key=lambda f: (f.lo, f.hi)):
            if run and fp.lo > end:
                merged.append((_united(storage, run), write))
                run = []
            run.append(fp)
            end = max(end, fp.hi) if len(run) > 1 else fp.hi
        merged.append((_united(storage, run), write))
    return merged


def _united(storage: int, run: list[Footprint]) -> Footprint:
    if len(run) == 1:
        return run[0]  # keeps its tensor's shape and dtype for the report
    return byte_range(storage, min(f.lo for f in run), max(f.hi for f in run))


def overlap(a: Footprint, b: Footprint) -> tuple[int, int] | None:
    """The byte range (relative to the storage) where `a` and `b` share bytes, or None.

    Pure Python, no torch operation: it runs inside the dispatcher, where another dispatch mode
    (a test's, a profiler's) must not see the checker's work.
    """
    lo, hi = max(a.lo, b.lo), min(a.hi, b.hi)
    if lo >= hi or a.storage != b.storage:
        return None
    if a.strided is None and b.strided is None:
        return lo, hi
    starts_a, starts_b = _element_starts(a), _element_starts(b)
    if starts_a is None or starts_b is None:
        return lo, hi  # too large to refine: the intervals' overlap stands
    # b's elements are disjoint and sorted: the candidate for each of a's is the last b element
    # that starts before a's element ends.
    shared = [
        s
        for s in starts_a
        if (i := bisect.bisect_left(starts_b, s + a.itemsize) - 1) >= 0
        and starts_b[i] + b.itemsize > s
    ]
    if not shared:
        return None
    return shared[0], shared[-1] + a.itemsize


def _element_starts(f: Footprint) -> list[int] | None:
    """Sorted, distinct byte offsets of the footprint's elements."""
    if f.strided is None:
        if (f.hi - f.lo) // f.itemsize > _REFINE_LIMIT:
            return None
        return list(range(f.lo, f.hi, f.itemsize))
    offset, sizes, strides = f.strided
    numel = 1
    for size in sizes:
        numel *= size
    if numel > _REFINE_LIMIT:
        return None
    starts = [offset]
    for size, step in zip(sizes, strides, strict=True):
        starts = [s + i * step for s in starts for i in range(size)]
    return sorted({s * f.itemsize for s in starts})


# -- the line of the program ---------------------------------------------------------------------

_HIDDEN = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, _backends_package))
_hidden_files: dict[str, bool] = {}


# (file, line, what the harness was issuing then: "" or "step 5"); see `issuing`.
Line = tuple[str, int, str]

_issuing = ""


@contextmanager
def issuing(what: str) -> Iterator[None]:
    """Inside, every line `source_line` gives names `what` (such as "step 5"), so that a race
    whose two sides come from different steps (a pipelined pair, a copy queued a step before)
    says which step each came from. A plain global, not a context variable: a runner's own
    threads issue the step's work too."""
    global _issuing
    before, _issuing = _issuing, what
    try:
        yield
    finally:
        _issuing = before


def source_line() -> Line:
    """(file, line, step) of the innermost frame outside torch and outside the backends: the line
    of the runner (or harness) that issued the operation, and what the harness was issuing then
    (`issuing`). Keeps no frame."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        hidden = _hidden_files.get(path)  # a str caches its hash: cheaper than a code object's
        if hidden is None:
            hidden = _hidden_files[path] = path.startswith(_HIDDEN)
        if not hidden:
            return path, frame.f_lineno, _issuing
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>", 0, _issuing


def hide_file(path: str) -> None:
    """Frames of `path` are machinery that issues operations for a program (a dispatch mode's),
    not a line of the program: `source_line` passes over them as over torch's."""
    _hidden_files[path] = True


def format_line(line: Line) -> str:
    """`path:line`, the path relative to the working directory when it lies below it, and the
    step it was issued in where the harness named one (`path:line, in step 5`)."""
    path, lineno, step = line
    here = os.getcwd() + os.sep
    where = f"{path.removeprefix(here)}:{lineno}"
    return f"{where}, in {step}" if step else where
