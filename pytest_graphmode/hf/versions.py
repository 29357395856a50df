"""Which transformers releases the adapter drives, and which layout each one has.

transformers' continuous-batching surface is private and moves between releases. Three layouts are
supported, two of the paged KV cache and one of how the batch processor is built, each driven by a
module of its own:

- `"continuous_api"` (5.0 to 5.3, `pytest_graphmode.hf.continuous_api`): the cache of
  `"paged_tensors"`, but no `ContinuousBatchingConfig` and no `_create_batch_processor`: these
  releases build their paged cache, scheduler and batch processor only inside the background
  generation loop, so the engine runs that loop on the calling thread with its stop already
  signalled to have them built, then stages each batch through the batch processor's own
  `prepare_next_batch` with a one-batch scheduler in place of transformers';
- `"paged_tensors"` (5.4 to 5.17, `pytest_graphmode.hf.paged_tensors`): one key and one value
  tensor per layer, slot-major, with the two trash blocks after the allocatable ones;
- `"sector_cache"` (5.18 to 5.24, `pytest_graphmode.hf.sector_cache`): one flat byte tensor split
  into sectors by per-attention-type allocators, each block holding a page of every layer, with
  the two trash sectors first.

Within a layout, what moved between releases is named in `SINCE`, each entry with the first release
that has it, and asked with `has()`: how the batch processor is built and warmed up, which options
`ContinuousBatchingConfig` takes, what a step is handed, where a batch's sizes are padded, how graphs
are keyed, whether the logits are cut to the batch's requests, and whether padding reads a zeroed
block apart from the one it writes.

Every 5.x release, from the first, 5.0, captures CUDA graphs of its varlen path keyed by its padded
query and KV sizes, and every one up to 5.24 is driven (docs/targets-hf.md, "Versions").

`check_version()` admits exactly the supported releases and says what to install otherwise.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Literal

Layout = Literal["continuous_api", "paged_tensors", "sector_cache"]

# (first release, first release beyond) of each layout. 5.0 is the first 5.x release; 5.4 is the
# first that builds its batch processor apart from the generation loop (`_create_batch_processor`),
# from a `ContinuousBatchingConfig`, with an IO object that stages a batch at sizes it is given; 5.18
# replaces the per-group block tables and the trailing trash blocks with sector allocators and a
# flat byte cache; 5.24 is the newest release the sector layout was read and run against
# (docs/targets-hf.md, "Versions").
LAYOUTS: dict[Layout, tuple[tuple[int, int], tuple[int, int]]] = {
    "continuous_api": ((5, 0), (5, 4)),
    "paged_tensors": ((5, 4), (5, 18)),
    "sector_cache": ((5, 18), (5, 25)),
}
SUPPORTED = "transformers>=5.0,<5.25"
Feature = Literal[
    "io_object",
    "graph_store",
    "compute_stream",
    "warmup",
    "staged_logits_processor",
    "graph_key",
    "graph_flag_per_path",
    "trash_index",
    "future_query_length",
    "self_sized_warmup",
    "maybe_pad_inputs",
    "model_runner",
    "seed_option",
    "max_requests_per_batch",
    "split_trash",
]
# The first release with each piece of surface the engine adapts to, oldest first.
SINCE: dict[Feature, tuple[int, int]] = {
    # `batch_processor.inputs_and_outputs`, an IO object holding the static tensors and one next
    # token per request; before, the batch processor holds them, and the next token of every
    # query token.
    "io_object": (5, 1),
    # The IO object keeps the graphs in an LRU store (`graphs._storage`), the padding options are
    # interval sizes, and the scheduler hands out `FutureRequestState`s; before, the batch
    # processor keeps them in a dict (None with graphs off) keyed by sizes padded by interval
    # counts, and its scheduler hands out request states.
    "graph_store": (5, 3),
    # The forward (eager, capture or replay) runs on the IO object's compute stream, which does
    # not wait for the current one; before, a capture runs on a fresh stream that waits for the
    # current one, and a replay on the current one.
    "compute_stream": (5, 3),
    # `ContinuousBatchingManager.warmup()` builds the batch processor and captures the largest
    # varlen graph; before, the processor is built by `_create_batch_processor()` and nothing is
    # captured ahead of the first batch.
    "warmup": (5, 5),
    # The IO object takes the logits processor when it stages a batch
    # (`prepare_batch_tensors(requests, logits_processor, ...)`) and `_generation_step(model)`
    # does not; before, the manager's processor is an argument of every `_generation_step`.
    "staged_logits_processor": (5, 6),
    # `inputs_and_outputs._get_graph_key()`; before, the graph store is keyed by
    # `(num_q_tokens, max_kv_read)`.
    "graph_key": (5, 6),
    # `ContinuousBatchingConfig.use_cuda_graph` resolves to a (varlen, decode) pair; before, to one
    # flag for both paths.
    "graph_flag_per_path": (5, 6),
    # `PagedAttentionCache.trash_index`, the slot padding reads and writes (the last row but one);
    # before, padding indices are -2, which indexing resolves to the same row.
    "trash_index": (5, 6),
    # `FutureRequestState(state, has_new_token, complete_blocks, query_length)`; before, the query
    # length is that of the state's `tokens_to_process`.
    "future_query_length": (5, 6),
    # `warmup()` sizes its varlen capture to the cache (`max_batch_tokens` queries after the rest
    # of the cache's pages); before, it takes the sizes as arguments, and its defaults
    # (`block_size` cached tokens per query token) can ask for more pages than a small cache has.
    "self_sized_warmup": (5, 7),
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
