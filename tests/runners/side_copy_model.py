"""The side-copy runner's model (`side_copy.py`): a 2-layer decoder over a paged, slot-major KV
cache, in plain torch. Nothing in `forward` reads a device value on the host, so it captures."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

M31 = 0x7FFFFFFF


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 64
    hidden: int = 16
    heads: int = 2
    ffn: int = 32
    layers: int = 2
    max_positions: int = 64
    num_blocks: int = 32
    block_size: int = 4
    max_blocks_per_seq: int = 8


def _mix(h: torch.Tensor) -> torch.Tensor:
    # 31-bit integer mixing: every product stays below 2**62, so int64 never overflows
    h = h & M31
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & M31
    h = ((h ^ (h >> 12)) * 0x297A2D39) & M31
    return h ^ (h >> 15)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Noise from a hash of (seed, position, token id): the same wherever the request runs."""
    vid = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix(seeds[:, None] * 0x01000193 + positions[:, None])
    h = _mix(h * 0x5BD1E995 + vid[None, :])
    u = (h.to(torch.float64) + 0.5) / float(M31 + 1)
    return -torch.log(-torch.log(u))


class TinyDecoder:
    def __init__(self, cfg: ModelConfig, device: str, seed: int) -> None:
        self.cfg = cfg
        self.head_dim = cfg.hidden // cfg.heads
        self.weights = {
            name: torch.empty(shape, device=device) for name, shape in self._shapes().items()
        }
        self.load_weights(seed)
        shape = (cfg.num_blocks, cfg.block_size, cfg.heads, self.head_dim)
        self.k_caches = [torch.zeros(shape, device=device) for _ in range(cfg.layers)]
        self.v_caches = [torch.zeros(shape, device=device) for _ in range(cfg.layers)]

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (c.vocab_size, c.hidden),
            "pos": (c.max_positions, c.hidden),
            "lm_head": (c.hidden, c.vocab_size),
        }
        for i in range(c.layers):
            for w in ("wq", "wk", "wv", "wo"):
                shapes[f"{w}{i}"] = (c.hidden, c.hidden)
            shapes[f"w1_{i}"] = (c.hidden, c.ffn)
            shapes[f"w2_{i}"] = (c.ffn, c.hidden)
        return shapes

    def load_weights(self, seed: int) -> None:
        """In place, so that captured graphs read the new weights."""
        gen = torch.Generator().manual_seed(seed)
        for name, shape in self._shapes().items():
            self.weights[name].copy_(torch.randn(shape, generator=gen) / math.sqrt(shape[0]))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        slot_mapping: torch.Tensor,  # [T]
        token_req: torch.Tensor,  # [T] the row of each token's request
        block_tables: torch.Tensor,  # [R, M]
        seq_lens: torch.Tensor,  # [R]
        logits_indices: torch.Tensor,  # [R]
        seeds: torch.Tensor,  # [R] int64, -1: greedy
        temperatures: torch.Tensor | float,  # [R], or one Python float for every row
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, w = self.cfg, self.weights
        t = input_ids.shape[0]
        heads, head_dim, block = c.heads, self.head_dim, c.block_size
        x = w["embed"][input_ids] + w["pos"][positions]
        keys = block_tables.shape[1] * block
        slot_pos = torch.arange(keys, device=x.device)
        tables = block_tables[token_req]  # [T, M]
        slots = (tables[:, :, None] * block + torch.arange(block, device=x.device)).reshape(t, keys)
        mask = (slot_pos[None, :] <= positions[:, None]) & (
            slot_pos[None, :] < seq_lens[token_req][:, None]
        )
        for i in range(c.layers):
            q = (x @ w[f"wq{i}"]).view(t, heads, head_dim)
            k = (x @ w[f"wk{i}"]).view(t, heads, head_dim)
            v = (x @ w[f"wv{i}"]).view(t, heads, head_dim)
            k_flat = self.k_caches[i].view(-1, heads, head_dim)
            v_flat = self.v_caches[i].view(-1, heads, head_dim)
            k_flat.index_copy_(0, slot_mapping, k)
            v_flat.index_copy_(0, slot_mapping, v)
            cached_k, cached_v = k_flat[slots], v_flat[slots]  # [T, L, H, Dh]
            scores = torch.einsum("thd,tlhd->thl", q, cached_k) / math.sqrt(head_dim)
            scores = torch.where(mask[:, None, :], scores, float("-inf"))
            attn = torch.softmax(scores, dim=-1)
            # 0 * NaN is NaN: masked slots (garbage the harness poisons) are zeroed, not weighted
            cached_v = torch.where(mask[:, :, None, None], cached_v, 0.0)
            x = x + torch.einsum("thl,tlhd->thd", attn, cached_v).reshape(t, c.hidden) @ w[f"wo{i}"]
            x = x + torch.nn.functional.silu(x @ w[f"w1_{i}"]) @ w[f"w2_{i}"]
        logits = x[logits_indices] @ w["lm_head"]
        return logits, self.sample(logits, seeds, positions[logits_indices], temperatures)

    def sample(
        self,
        logits: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
        temperatures: torch.Tensor | float,
    ) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if isinstance(temperatures, torch.Tensor):
            scaled = logits / temperatures[:, None]
        else:  # one temperature shared by every row
            scaled = logits / temperatures
        noise = gumbel_noise(seeds.clamp(min=0), positions, logits.shape[1]).to(logits.dtype)
        return torch.where(seeds < 0, greedy, (scaled + noise).argmax(dim=-1))
