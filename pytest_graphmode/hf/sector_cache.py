"""transformers 5.18 to 5.24: the paged cache as one flat byte tensor split into sectors.

`PagedAttentionCache.cache_tensor` is a uint8 tensor that allocators, one per attention type, cut
into sectors, sectors into blocks and blocks into pages. For a model of full-attention layers only
(one `FullAttentionCacheAllocator`), a block holds one page of every layer, and a page holds its
layer's keys for `page_size` tokens, then their values:

    cache_tensor viewed as [block, layer, key|value, offset, kv_heads, head_dim]

The first two sectors are never allocated: the read trash (zeroed, what padding tokens read) and
the write trash (where padding tokens write, never read). With `EngineConfig`'s sizes a sector is
one block, so they are blocks 0 and 1, and a request's block id `b` is block `b` of the tensor. A
request's block ids go into the allocator's block table.

No view of that tensor is slot-major (a slot's keys of one layer sit a whole block apart from the
next block's), so the engine keeps a slot-major image of it, `[slot, layer, key|value, kv_heads,
head_dim]`, and exposes per-layer views of the image: it copies the image into the cache before
each step (whatever the caller wrote there, a poisoned block or a restored state, is what the step
reads) and the cache back into the image after it (what the step wrote is what the caller sees).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pytest_graphmode.hf.engine import Engine
from pytest_graphmode.hf.versions import UnsupportedTransformers


class SectorCacheEngine(Engine):
    """`Engine` over the flat, sector-split cache of transformers 5.18 to 5.24."""

    layout = "sector_cache"
    block_size_option = "page_size"

    def _attention(self, cb_fields: set[str]) -> tuple[str, dict[str, Any]]:
        if "auto_switch_to_flash" not in cb_fields:  # 5.18 keeps a "paged|" implementation as named
            return super()._attention(cb_fields)
        # From 5.19 SDPA is named without "paged|" (deprecated there), and the switch to flash
        # attention where one is installed is an option, turned off.
        return "sdpa", {"auto_switch_to_flash": False}

    def _check_layout(self) -> None:
        allocators = list(self._cache.cache_allocators.values())
        kinds = [type(allocator).__name__ for allocator in allocators]
        # Sliding-window groups lay their blocks out otherwise; a tiny Llama has full attention only.
        if kinds != ["FullAttentionCacheAllocator"]:
            raise UnsupportedTransformers(
                "the adapter drives full-attention models only (one FullAttentionCacheAllocator); "
                f"this model has {kinds}"
            )
        (allocator,) = allocators
        config = self.config
        blocks = config.num_blocks + 2
        found = {
            "layers": allocator.layer_indices,
            "tokens per page": allocator.tokens_per_page,
            "blocks per sector": allocator.blocks_per_sector,
            "read trash index": allocator.read_trash_index,
            "write trash index": allocator.write_trash_index,
            "cache bytes": self._cache.cache_tensor.numel(),
        }
        expected = {
            "layers": list(range(config.num_layers)),
            "tokens per page": config.block_size,
            "blocks per sector": 1,
            "read trash index": 0,
            "write trash index": allocator.block_physical_stride,
            "cache bytes": blocks * allocator.bytes_per_block,
        }
        if found != expected:
            raise UnsupportedTransformers(
                f"transformers {self.version} lays out its sector cache as {found}, not as the "
                f"adapter reads it: {expected}"
            )
        self._allocator = allocator
        heads, dim = allocator.num_key_value_heads, allocator.head_dim
        # [block, layer, key|value, offset, kv_heads, head_dim]: transformers' own bytes
        self._blocks = self._cache.cache_tensor.view(allocator.cache_dtype).view(
            blocks, config.num_layers, 2, config.block_size, heads, dim
        )
        # [slot, layer, key|value, kv_heads, head_dim]: the slot-major image
        self._slots = torch.zeros(
            blocks * config.block_size,
            config.num_layers,
            2,
            heads,
            dim,
            dtype=allocator.cache_dtype,
            device=self._blocks.device,
        )

    def _clear_cache(self) -> None:
        # The warm-up wrote its fake requests into the cache.
        self._cache.cache_tensor.zero_()
        self._slots.zero_()

    def _block_table(self) -> dict[str, list[int]]:
        table: dict[str, list[int]] = self._allocator.block_table
        return table

    @property
    def read_trash_block(self) -> int:
        return int(self._allocator.read_trash_index) // int(self._allocator.block_physical_stride)

    @property
    def write_trash_block(self) -> int:
        return int(self._allocator.write_trash_index) // int(self._allocator.block_physical_stride)

    def kv_tensors(self) -> list[Tensor]:
        """Views of the slot-major image: [(num_blocks + 2) * block_size, kv_heads, head_dim] each."""
        return [
            self._slots[:, layer, kind]
            for layer in range(self.config.num_layers)
            for kind in (0, 1)
        ]

    def _block_major_image(self) -> Tensor:
        # [block, layer, key|value, offset, kv_heads, head_dim], a view of the image
        config = self.config
        return self._slots.view(-1, config.block_size, *self._slots.shape[1:]).permute(
            0, 2, 3, 1, 4, 5
        )

    def _before_step(self) -> None:
        self._blocks.copy_(self._block_major_image())
        # transformers' compute stream does not wait for the caller's: the copy must have landed
        # before its forward reads the cache.
        if self._blocks.is_cuda:
            torch.cuda.current_stream(self._blocks.device).synchronize()

    def _after_step(self) -> None:
        # transformers has waited for its compute stream before handing out the step's tokens.
        self._block_major_image().copy_(self._blocks)
