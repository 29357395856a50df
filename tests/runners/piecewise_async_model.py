"""The tiny decoder behind the piecewise/async runner (`piecewise_async.py`).

Two layers, a paged KV cache read through block tables, a counter-based sampler. The forward is
split the way a piecewise graph splits it: token-wise pieces (embedding, projections, MLP, final
norm) that a graph may capture for a padded token count, and the attention between them, which
reads and writes the cache and so depends on per-request metadata. No function here reads a device
value on the host, so every piece, and the whole forward, can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MASK_32 = 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 96
    hidden: int = 32
    num_heads: int = 2
    head_dim: int = 16
    ffn: int = 64
    num_layers: int = 2
    num_blocks: int = 48
    block_size: int = 4
    max_blocks_per_req: int = 6

    @property
    def max_positions(self) -> int:
        return self.block_size * self.max_blocks_per_req


@dataclass(frozen=True, slots=True)
class TokenMetadata:
    """What the general attention needs, one row per (padded) token: the request row whose block
    table it reads, its position, and the cache slot it writes."""

    block_table: Tensor  # [rows, max_blocks_per_req]; a padding row points at the null block only
    token_row: Tensor  # [T]
    positions: Tensor  # [T]
    slot_mapping: Tensor  # [T]


@dataclass(frozen=True, slots=True)
class DecodeMetadata:
    """What the uniform-decode attention needs: per request, not per token. Token `t` belongs to
    request `t // query_len`, sits at position `seq_len - query_len + t % query_len`, and writes
    the slot its request's block table gives that position (computed on the device)."""

    block_table: Tensor  # [R, max_blocks_per_req]; a padding request's row is null
    seq_lens: Tensor  # [R]; a padding request's is query_len
    query_len: int


def _mix(x: Tensor) -> Tensor:
    """An integer hash in 31 bits (xorshift-multiply rounds; int64 wraps, deterministically)."""
    x = x & MASK_32
    for mult in (0x45D9F3B, 0x2C1B3C6D):
        x = ((x >> 16) ^ x) * mult & MASK_32
    return ((x >> 16) ^ x) & MASK_32


class TinyDecoder:
    def __init__(self, cfg: ModelConfig, *, seed: int, device: str = "cuda") -> None:
        self.cfg = cfg
        self.device = device
        self.weights = {
            name: torch.empty(shape, device=device) for name, shape in self._shapes().items()
        }
        self.load_weights(seed)
        cache = (cfg.num_blocks, cfg.block_size, cfg.num_heads, cfg.head_dim)
        self.k_caches = [torch.zeros(cache, device=device) for _ in range(cfg.num_layers)]
        self.v_caches = [torch.zeros(cache, device=device) for _ in range(cfg.num_layers)]

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (c.vocab_size, c.hidden),
            "pos": (c.max_positions, c.hidden),
            "head": (c.hidden, c.vocab_size),
        }
        for i in range(c.num_layers):
            shapes[f"qkv{i}"] = (c.hidden, 3 * c.num_heads * c.head_dim)
            shapes[f"o{i}"] = (c.num_heads * c.head_dim, c.hidden)
            shapes[f"up{i}"] = (c.hidden, c.ffn)
            shapes[f"down{i}"] = (c.ffn, c.hidden)
        return shapes

    def load_weights(self, seed: int) -> None:
        """In place, so captured graphs read the new values."""
        gen = torch.Generator().manual_seed(seed)
        for name, w in self.weights.items():
            scale = 1.0 if name in ("embed", "pos") else w.shape[0] ** -0.5
            w.copy_(torch.randn(w.shape, generator=gen) * scale)

    # token-wise pieces -------------------------------------------------------------------------

    def first_piece(self, input_ids: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        w = self.weights
        residual = w["embed"][input_ids] + w["pos"][positions]
        return (residual, *self._qkv(0, residual))

    def middle_piece(self, layer: int, residual: Tensor, attn: Tensor) -> tuple[Tensor, ...]:
        """Closes layer `layer - 1` and opens layer `layer`."""
        residual = self._close_layer(layer - 1, residual, attn)
        return (residual, *self._qkv(layer, residual))

    def last_piece(self, residual: Tensor, attn: Tensor) -> Tensor:
        residual = self._close_layer(self.cfg.num_layers - 1, residual, attn)
        return torch.nn.functional.rms_norm(residual, (self.cfg.hidden,))

    def _qkv(self, layer: int, residual: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c = self.cfg
        x = torch.nn.functional.rms_norm(residual, (c.hidden,))
        qkv = (x @ self.weights[f"qkv{layer}"]).view(-1, 3, c.num_heads, c.head_dim)
        return qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2].contiguous()

    def _close_layer(self, layer: int, residual: Tensor, attn: Tensor) -> Tensor:
        w = self.weights
        residual = residual + attn.flatten(1) @ w[f"o{layer}"]
        x = torch.nn.functional.rms_norm(residual, (self.cfg.hidden,))
        return residual + torch.nn.functional.silu(x @ w[f"up{layer}"]) @ w[f"down{layer}"]

    # attention ---------------------------------------------------------------------------------

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: TokenMetadata) -> Tensor:
        """Mixed batches: any query lengths, each token's table and position given per token."""
        self._write_cache(layer, k, v, meta.slot_mapping)
        tables = meta.block_table[meta.token_row]
        return self._attend(layer, q, tables, meta.positions)

    def decode_attention(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: DecodeMetadata
    ) -> Tensor:
        """Uniform batches only: every request has `query_len` tokens, laid out request by
        request, so the token-to-request map is a shape, not data."""
        bs = self.cfg.block_size
        offsets = torch.arange(q.shape[0], device=q.device)
        rows = offsets // meta.query_len
        positions = meta.seq_lens[rows] - meta.query_len + offsets % meta.query_len
        tables = meta.block_table[rows]
        slots = tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        self._write_cache(layer, k, v, slots)
        return self._attend(layer, q, tables, positions)

    def _write_cache(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
        c = self.cfg
        rows = c.num_blocks * c.block_size
        self.k_caches[layer].view(rows, c.num_heads, c.head_dim)[slots] = k
        self.v_caches[layer].view(rows, c.num_heads, c.head_dim)[slots] = v

    def _attend(self, layer: int, q: Tensor, tables: Tensor, positions: Tensor) -> Tensor:
        c = self.cfg
        within = torch.arange(c.block_size, device=q.device)
        slots = (tables[:, :, None] * c.block_size + within).flatten(1)  # [T, S]
        span = torch.arange(slots.shape[1], device=q.device)
        visible = (span[None, :] <= positions[:, None])[:, :, None, None]  # [T, S, 1, 1]
        rows = c.num_blocks * c.block_size
        # masked slots may hold anything (NaN in the null block): replace, do not multiply
        keys = torch.where(visible, self.k_caches[layer].view(rows, -1, c.head_dim)[slots], 0.0)
        vals = torch.where(visible, self.v_caches[layer].view(rows, -1, c.head_dim)[slots], 0.0)
        scores = torch.einsum("thd,tshd->ths", q, keys) * c.head_dim**-0.5
        scores = scores.masked_fill(~visible[:, :, :, 0].transpose(1, 2), float("-inf"))
        return torch.einsum("ths,tshd->thd", scores.softmax(-1), vals)

    # whole forwards ----------------------------------------------------------------------------

    def forward_mixed(self, input_ids: Tensor, meta: TokenMetadata) -> Tensor:
        residual, q, k, v = self.first_piece(input_ids, meta.positions)
        for layer in range(1, self.cfg.num_layers):
            attn = self.attention(layer - 1, q, k, v, meta)
            residual, q, k, v = self.middle_piece(layer, residual, attn)
        return self.last_piece(residual, self.attention(self.cfg.num_layers - 1, q, k, v, meta))

    def forward_decode(self, input_ids: Tensor, positions: Tensor, meta: DecodeMetadata) -> Tensor:
        residual, q, k, v = self.first_piece(input_ids, positions)
        for layer in range(1, self.cfg.num_layers):
            attn = self.decode_attention(layer - 1, q, k, v, meta)
            residual, q, k, v = self.middle_piece(layer, residual, attn)
        attn = self.decode_attention(self.cfg.num_layers - 1, q, k, v, meta)
        return self.last_piece(residual, attn)

    # head and sampler --------------------------------------------------------------------------

    def logits(self, hidden: Tensor) -> Tensor:
        return hidden @ self.weights["head"]

    def sample(
        self, logits: Tensor, seeds: Tensor, temperatures: Tensor, positions: Tensor, tokens: Tensor
    ) -> Tensor:
        """Gumbel-max with noise hashed from (seed, position, last token, vocab id): the same
        request at the same place draws the same noise in any batch. A negative seed is greedy."""
        vocab = torch.arange(logits.shape[1], device=logits.device)
        key = _mix(_mix(_mix(seeds) + positions) + tokens)
        bits = _mix(key[:, None] * 31 + vocab[None, :])
        uniform = (bits.to(torch.float32) + 0.5) / float(MASK_32 + 1)
        gumbel = -torch.log(-torch.log(uniform))
        sampled = (logits / temperatures[:, None] + gumbel).argmax(-1)
        return torch.where(seeds < 0, logits.argmax(-1), sampled)
