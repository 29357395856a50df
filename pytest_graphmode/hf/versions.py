"""Which transformers releases the adapter drives, and which cache layout each one has.

transformers' continuous-batching surface is private and moves between releases. Two layouts of
its paged KV cache are supported, each by a module of its own:

- `"paged_tensors"` (5.6 to 5.17, `pytest_graphmode.hf.paged_tensors`): one key and one value
  tensor per layer, slot-major, with the two trash blocks after the allocatable ones;
- `"sector_cache"` (5.18 to 5.24, `pytest_graphmode.hf.sector_cache`): one flat byte tensor split
  into sectors by per-attention-type allocators, each block holding a page of every layer, with
  the two trash sectors first.

Within a layout, what moved between releases is named in `SINCE`, each entry with the first release
that has it, and asked with `has()`: where a batch's sizes are padded, which options
`ContinuousBatchingConfig` takes, whether the logits are cut to the batch's requests, and whether
padding reads a zeroed block apart from the one it writes.

Every 5.x release since 5.0 captures CUDA graphs of its varlen path keyed by its padded query and
KV sizes; 5.0 to 5.5 are not driven yet (docs/targets-hf.md, "Versions"): 5.0 to 5.3 have no
`ContinuousBatchingConfig` (their options are arguments of `init_continuous_batching`) and pad a
batch inside the generation step, and 5.4 and 5.5 hand the logits processor to every step rather
than to the IO object, key graphs without `_get_graph_key` and keep one CUDA-graph flag for both
paths.

`check_version()` admits exactly the supported releases and says what to install otherwise.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Literal

Layout = Literal["paged_tensors", "sector_cache"]

# (first release, first release beyond) of each layout. 5.6 is the first release whose IO object
# keys its graphs with `_get_graph_key` and takes the logits processor when it stages a batch
# rather than at every step; 5.18 replaces the per-group block tables and the trailing trash
# blocks with sector allocators and a flat byte cache; 5.24 is the newest release the sector layout
# was read and run against (docs/targets-hf.md, "Versions").
LAYOUTS: dict[Layout, tuple[tuple[int, int], tuple[int, int]]] = {
    "paged_tensors": ((5, 6), (5, 18)),
    "sector_cache": ((5, 18), (5, 25)),
}
SUPPORTED = "transformers>=5.6,<5.25"
Feature = Literal[
    "maybe_pad_inputs", "model_runner", "seed_option", "max_requests_per_batch", "split_trash"
]
# The first release with each piece of surface the engine adapts to.
SINCE: dict[Feature, tuple[int, int]] = {
    # `maybe_pad_inputs(num_q, kv_read, decode_fast_path)` pads a batch's sizes; before, the
    # scheduling step pads them inline with the same two `pad_to_interval` calls.
    "maybe_pad_inputs": (5, 8),
    # A `ModelRunner` (`batch_processor.model_runner`) pads, captures and replays; before, the batch
    # processor does it itself.
    "model_runner": (5, 9),
    # `ContinuousBatchingConfig.seed`, which seeds the global generator when the processor is built.
    "seed_option": (5, 9),
    # `ContinuousBatchingConfig.max_requests_per_batch`: the model runner caps a batch's requests
    # and picks the logits of its requests only, sized by that cap; before, every token's logits
    # are sampled, and the per-request staging tensors are sized by `max_batch_tokens`.
    "max_requests_per_batch": (5, 11),
    # A zeroed read-trash block apart from the write-trash one, and
    # `prepare_batch_tensors(..., use_padding)`.
    "split_trash": (5, 13),
}


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


def has(version: str, feature: Feature) -> bool:
    """Whether transformers `version` has `feature` (`SINCE` says what each one is)."""
    return _release(version) >= SINCE[feature]


def split_trash(version: str) -> bool:
    """Whether transformers `version` pads reads from a zeroed block of their own and takes
    `use_padding` in `prepare_batch_tensors` (5.13 on), rather than reading and writing padding in
    one slot of its write-trash block (up to 5.12)."""
    return has(version, "split_trash")


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
