"""Paged attention: write this step's K/V into the cache, then attend through the block tables.

Everything is read from device tensors (slot mapping, query offsets, sequence lengths, block
tables); shapes depend only on the number of token and request rows, never on their contents, so
one capture serves every batch of the same row counts. Nothing masked is multiplied away: masked
keys and values are replaced with `masked_fill`, because `0 * NaN` is NaN and the harness poisons
everything a valid row must not read.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from pytest_graphmode.runtime.model.inputs import DecoderInputs, token_requests

AttentionFn = Callable[[int, Tensor, Tensor, Tensor, DecoderInputs, Tensor], Tensor]
"""`attention(layer, q, k, v, inputs, kv_cache) -> out`: q [T, heads, head_dim] and k, v
[T, kv_heads, head_dim] after RoPE; out [T, heads, head_dim]. It owns the KV cache write."""


def paged_attention(
    layer: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    inputs: DecoderInputs,
    kv_cache: Tensor,
    *,
    block_size: int,
    null_block: int,
) -> Tensor:
    """Default attention; bind `block_size` and `null_block` to get an `AttentionFn`."""
    write_kv(layer, k, v, inputs.slot_mapping, kv_cache, null_slot=null_block * block_size)
    return attend(layer, q, inputs, kv_cache, block_size=block_size)


def write_kv(
    layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor, kv_cache: Tensor, *, null_slot: int
) -> None:
    """Store k, v [T, kv_heads, head_dim] at their slots of `kv_cache` [slots, layers, 2, ...].

    A slot outside the cache (-1 marks padding) is redirected to `null_slot`, so padding rows, and
    garbage in them, write the null block and nothing else.
    """
    inside = (slot_mapping >= 0) & (slot_mapping < kv_cache.shape[0])
    slots = torch.where(inside, slot_mapping, null_slot)
    kv_cache[:, layer].index_copy_(0, slots, torch.stack((k, v), dim=1).to(kv_cache.dtype))


def block_slots(blocks: Tensor, block_size: int) -> Tensor:
    """[..., B] block tables -> [..., B * block_size] KV slots of positions 0 .. B*block_size-1:
    the tensor form of `pytest_graphmode.contract.kv_slot`."""
    offsets = torch.arange(block_size, device=blocks.device)
    return (blocks.unsqueeze(-1) * block_size + offsets).flatten(-2)


def attend(
    layer: int, q: Tensor, inputs: DecoderInputs, kv_cache: Tensor, *, block_size: int
) -> Tensor:
    """Causal attention of every query row over its own request's cached keys.

    A token's request is found on the device by searching `query_start`; its key positions run
    over every slot its block table can address, and the ones at or beyond its causal limit are
    masked. Padding rows land on some request and compute garbage that nothing valid reads.
    """
    num_tokens, heads, head_dim = q.shape
    num_slots, _, _, kv_heads, _ = kv_cache.shape
    max_blocks = inputs.block_tables.shape[1]
    max_keys = max_blocks * block_size
    device = q.device
    # Written for few tensor operations (views, not indexing with None): eager steps and captures
    # cost about one host launch per operation on cuda, and one Python dispatch on the sim.

    token_req = token_requests(inputs)  # [T]
    # A token sees its request's keys up to its own position: the sequence length less the
    # request's query tokens that come after it, i.e. seq_len - query_end + 1 + row.
    query_end = inputs.query_start[1:].index_select(0, token_req)
    rows_after = torch.arange(1, num_tokens + 1, device=device) - query_end
    visible = inputs.seq_lens.index_select(0, token_req) + rows_after  # [T]
    # [T, K]: the key positions each token must not see.
    masked = torch.arange(max_keys, device=device).view(1, max_keys) >= visible.view(num_tokens, 1)

    blocks = inputs.block_tables.index_select(0, token_req).clamp(0, num_slots // block_size - 1)
    slots = block_slots(blocks, block_size).view(-1)  # [T * K]
    cached = kv_cache[:, layer].index_select(0, slots)  # [T * K, 2, kv_heads, head_dim]
    cached = cached.view(num_tokens, max_keys, 2, kv_heads, head_dim)
    cached = cached.masked_fill(masked.view(num_tokens, max_keys, 1, 1, 1), 0).float()
    keys = cached[:, :, 0].permute(0, 2, 3, 1)  # [T, kv_heads, head_dim, K]
    values = cached[:, :, 1].permute(0, 2, 1, 3)  # [T, kv_heads, K, head_dim]

    group = heads // kv_heads
    grouped_q = q.float().view(num_tokens, kv_heads, group, head_dim)
    scores = torch.matmul(grouped_q, keys) * (1.0 / math.sqrt(head_dim))  # [T, kv_heads, G, K]
    scores = scores.masked_fill(masked.view(num_tokens, 1, 1, max_keys), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [T, kv_heads, G, head_dim]
    return out.reshape(num_tokens, heads, head_dim).to(q.dtype)
