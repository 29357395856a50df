"""Which transformers releases the adapter drives, and which cache layout each one has.

transformers' continuous-batching surface is private and moves between releases. Two layouts of
its paged KV cache are supported, each by a module of its own:

- `"paged_tensors"` (5.11 to 5.17, `pytest_graphmode.hf.paged_tensors`): one key and one value
  tensor per layer, slot-major, with the two trash blocks after the allocatable ones;
- `"sector_cache"` (5.18 to 5.24, `pytest_graphmode.hf.sector_cache`): one flat byte tensor split
  into sectors by per-attention-type allocators, each block holding a page of every layer, with
  the two trash sectors first.

Within a layout, `split_trash()` says whether a release pads with a zeroed read-trash block apart
from its write-trash block and asks its IO object for padding in `prepare_batch_tensors` (5.13 on),
or pads reads and writes into one slot and pads when it hands the batch to the model (5.11 and
5.12).

`check_version()` admits exactly these releases and says what to install otherwise.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Literal

Layout = Literal["paged_tensors", "sector_cache"]

# (first release, first release beyond) of each layout. 5.11 is the first release whose model
# runner caps a batch's requests (`max_requests_per_batch`) and picks the logits of its requests
# only; 5.18 replaces the per-group block tables and the trailing trash blocks with
# sector allocators and a flat byte cache; 5.24 is the newest release the sector layout was read
# and run against (docs/targets-hf.md, "Versions").
LAYOUTS: dict[Layout, tuple[tuple[int, int], tuple[int, int]]] = {
    "paged_tensors": ((5, 11), (5, 18)),
    "sector_cache": ((5, 18), (5, 25)),
}
SUPPORTED = "transformers>=5.11,<5.25"
# The first release with a zeroed read-trash block apart from the write-trash one, and with
# `prepare_batch_tensors(..., use_padding)`.
SPLIT_TRASH = (5, 13)


class UnsupportedTransformers(RuntimeError):
    """The installed transformers is missing or outside the releases this adapter supports."""


def support_problem() -> str | None:
    """Why no engine can be made here (transformers missing or unsupported); None if one can."""
    try:
        check_version()
    except UnsupportedTransformers as exc:
        return str(exc)
    return None


def check_version() -> str:
    """The installed transformers version; raises `UnsupportedTransformers` unless it is supported."""
    installed = _installed()
    layout_of(installed)
    return installed


def installed_layout() -> Layout:
    """The cache layout of the installed transformers; raises `UnsupportedTransformers` if none."""
    return layout_of(_installed())


def split_trash(version: str) -> bool:
    """Whether transformers `version` pads reads from a zeroed block of their own and takes
    `use_padding` in `prepare_batch_tensors` (5.13 on), rather than reading and writing padding in
    one slot of its write-trash block (5.11 and 5.12)."""
    return _release(version) >= SPLIT_TRASH


def layout_of(version: str) -> Layout:
    """The cache layout of transformers `version`; raises `UnsupportedTransformers` if none."""
    release = _release(version)
    for layout, (oldest, beyond) in LAYOUTS.items():
        if oldest <= release < beyond:
            return layout
    raise UnsupportedTransformers(
        f"transformers {version} is installed, but the continuous-batching adapter supports "
        f"{SUPPORTED} only: its batch processor, paged cache and graph store are private and "
        f"change between releases; pip install '{SUPPORTED}'"
    )


def _release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _installed() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError as exc:
        raise UnsupportedTransformers(
            f"transformers is not installed; install the extra: pip install 'pytest-graphmode[hf]' "
            f"({SUPPORTED})"
        ) from exc
