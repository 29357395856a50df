"""transformers 5.4 to 5.17: the paged cache as one key and one value tensor per layer.

Each tensor has `(num_blocks + 2) * block_size` rows, slot-major already: the allocatable blocks,
then two trash blocks. From 5.13 the first is the read trash (zeroed, what padding tokens read) and
the second the write trash (where padding tokens write, never read). 5.4 to 5.12 leave the first
unused: their padding tokens read and write one slot of the second, their `trash_index`. A
request's block ids go into the block table of the one layer group's `FullAttentionCacheAllocator`, kept in the cache's `group_cache_managers`.
"""

from __future__ import annotations

from torch import Tensor

from pytest_graphmode.hf.engine import Engine
from pytest_graphmode.hf.versions import Layout, UnsupportedTransformers, has, split_trash


class PagedTensorsEngine(Engine):
    """`Engine` over the per-layer key and value tensors of transformers 5.4 to 5.17."""

    layout: Layout = "paged_tensors"
    block_size_option = "block_size"

    def _check_layout(self) -> None:
        # Sliding-window groups change how blocks map to slots; a tiny Llama has full attention only.
        managers = self._cache.group_cache_managers
        if len(managers) != 1 or type(managers[0]).__name__ != "FullAttentionCacheAllocator":
            raise UnsupportedTransformers(
                "the adapter drives full-attention models only (one layer group of "
                f"FullAttentionCacheAllocator); this model has {[type(m).__name__ for m in managers]}"
            )
        expected = (self.config.num_blocks + 2) * self.config.block_size
        if self._cache.key_cache[0].shape[0] != expected:
            raise UnsupportedTransformers(
                f"transformers {self.version} lays out its paged cache with "
                f"{self._cache.key_cache[0].shape[0]} rows, not num_blocks + 2 trash blocks "
                f"= {expected}"
            )

    def _clear_cache(self) -> None:
        # The cache is allocated uninitialised, and the warm-up wrote into it.
        for tensor in self.kv_tensors():
            tensor.zero_()

    def _before_step(self) -> None:
        pass  # the caller writes transformers' own tensors

    def _after_step(self) -> None:
        pass  # and reads them

    def _block_table(self) -> dict[str, list[int]]:
        (group,) = self._cache.group_cache_managers
        table: dict[str, list[int]] = group.block_table
        return table

    @property
    def read_trash_block(self) -> int:
        index = self._cache.read_trash_index if split_trash(self.version) else self._trash_index()
        return int(index) // self.config.block_size

    @property
    def write_trash_block(self) -> int:
        index = self._cache.write_trash_index if split_trash(self.version) else self._trash_index()
        return int(index) // self.config.block_size

    def _trash_index(self) -> int:
        """The one slot padding reads and writes up to 5.12."""
        if has(self.version, "trash_index"):
            return int(self._cache.trash_index)
        # Up to 5.5 padding indices are -2, which indexing resolves to the last row but one.
        return int(self._cache.key_cache[0].shape[0]) - 2

    def kv_tensors(self) -> list[Tensor]:
        """transformers' own tensors: [(num_blocks + 2) * block_size, kv_heads, head_dim] each."""
        return [
            t
            for pair in zip(self._cache.key_cache, self._cache.value_cache, strict=True)
            for t in pair
        ]
