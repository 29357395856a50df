"""What padding rows hold, and the host-side rows of one staged step.

A graph captured for `R` requests and `T` tokens always computes `R` and `T` rows; a step with
fewer real ones fills the rest with sentinels that make them inert: they read nothing a real row
owns, write only the null block, and consume no request's randomness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pytest_graphmode.contract import Batch, kv_slot


@dataclass(frozen=True, slots=True)
class PaddingPolicy:
    """The sentinel each static input holds in padding rows.

    `slot=-1` sends a padding token's KV write to the null block; the null block fills unused
    block-table entries so a padding row (or a stale entry) never addresses a live block;
    `seq_len_fill` is the decoder's own fill value (`Decoder.SEQ_LEN_FILL`), the length its
    attention treats as a cheap, harmless row; `seed=-1` makes padding rows greedy so they draw
    no random numbers. Padding requests have no query tokens: their query offsets repeat the
    last real offset.
    """

    null_block: int
    seq_len_fill: int
    token_id: int = 0
    position: int = 0
    slot: int = -1
    seed: int = -1
    temperature: float = 1.0
    adapter: int = 0

    def __post_init__(self) -> None:
        if self.null_block < 0:
            raise ValueError(f"null_block={self.null_block} must be a block id >= 0")
        if self.seq_len_fill < 0:
            raise ValueError(f"seq_len_fill={self.seq_len_fill} must be >= 0")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"padding temperature={self.temperature} must be finite and > 0")


@dataclass(frozen=True, slots=True)
class HostRows:
    """One step's static-input contents, real rows first, then padding rows."""

    token_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    query_start: list[int]  # [R + 1]
    seq_lens: list[int]  # [R]
    block_tables: list[int]  # [R * max_blocks_per_req], row-major
    adapter_ids: list[int]  # [R]
    seeds: list[int]  # [R]
    temperatures: list[float]  # [R]


def host_rows(
    batch: Batch,
    padded_reqs: int,
    padded_tokens: int,
    *,
    block_size: int,
    max_blocks_per_req: int,
    policy: PaddingPolicy,
) -> HostRows:
    """Lay out an already validated `batch` as `padded_reqs` request rows and `padded_tokens`
    token rows."""
    token_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start = [0]
    block_tables: list[int] = []
    for request in batch.requests:
        for offset, token in enumerate(request.tokens):
            position = request.context_len + offset
            token_ids.append(token)
            positions.append(position)
            slot_mapping.append(kv_slot(request.block_ids, position, block_size))
        query_start.append(query_start[-1] + request.query_len)
        unused = max_blocks_per_req - len(request.block_ids)
        block_tables.extend(request.block_ids)
        block_tables.extend([policy.null_block] * unused)

    pad_tokens = padded_tokens - batch.num_tokens
    pad_reqs = padded_reqs - batch.num_reqs
    return HostRows(
        token_ids=token_ids + [policy.token_id] * pad_tokens,
        positions=positions + [policy.position] * pad_tokens,
        slot_mapping=slot_mapping + [policy.slot] * pad_tokens,
        query_start=query_start + [query_start[-1]] * pad_reqs,
        seq_lens=[r.seq_len for r in batch.requests] + [policy.seq_len_fill] * pad_reqs,
        block_tables=block_tables + [policy.null_block] * (pad_reqs * max_blocks_per_req),
        adapter_ids=[r.adapter for r in batch.requests] + [policy.adapter] * pad_reqs,
        seeds=[policy.seed if r.seed is None else r.seed for r in batch.requests]
        + [policy.seed] * pad_reqs,
        temperatures=[r.temperature for r in batch.requests] + [policy.temperature] * pad_reqs,
    )
