"""The model of the static-cache-style runner (`static_cache_style.py`): a two-layer decoder whose
attention reads each request's cache through a per-request slot map (position -> KV slot, built
from the request's paged blocks), and counter-based Gumbel sampling keyed by
`(seed, position, token)`. The first projection runs W8A8-style: its input is quantized to int8
levels with a dynamic per-token scale. Nothing here knows of any test harness."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 96
    hidden: int = 32
    heads: int = 2
    layers: int = 2
    num_blocks: int = 32
    block_size: int = 4
    max_blocks_per_req: int = 6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def max_context(self) -> int:
        return self.max_blocks_per_req * self.block_size


GREEDY = -1  # the seed of a greedy row
_M32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer finalizer; operands stay below 2**62, so int64 never overflows."""
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def sample(logits: Tensor, seeds: Tensor, temperatures: Tensor, positions: Tensor) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): a request draws the same
    noise at the same position whatever row, batch or bucket it is in. A GREEDY seed is argmax."""
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    h = _hash32((seeds & _M32) ^ 0x5BD1E995)
    h = _hash32(h ^ (positions & _M32))
    h = _hash32(h[:, None] ^ vocab[None, :])
    u = ((h & 0xFFFFFF).to(torch.float32) + 0.5) / float(1 << 24)
    noisy = logits / temperatures[:, None] - torch.log(-torch.log(u))
    return torch.where(seeds == GREEDY, logits.argmax(-1), noisy.argmax(-1))


def _rms_norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def quantize_int8(x: Tensor, *, per_token: bool = True) -> Tensor:
    """Fake int8 quantization with a dynamic scale. Per token, each row's scale comes from its own
    values; a per-tensor scale lets every other row of the batch (padding too) move it."""
    amax = x.abs().amax(-1, keepdim=True) if per_token else x.abs().amax()
    scale = amax.clamp_min(1e-6) / 127.0
    return torch.round(x / scale) * scale


class TinyDecoder:
    """Learned positions, paged attention through per-token slot maps, a SiLU MLP, an LM head.
    Its forward reads no device value on the host, so it can be captured whole."""

    def __init__(
        self, cfg: ModelConfig, *, per_token_scale: bool = True, mask_values: bool = True
    ) -> None:
        self.cfg = cfg
        self.per_token_scale = per_token_scale
        self.mask_values = mask_values
        e, v = cfg.hidden, cfg.vocab_size
        shapes = {"embed": (v, e), "pos_embed": (cfg.max_context, e), "lm_head": (v, e)}
        for i in range(cfg.layers):
            shapes |= {f"qkv{i}": (3 * e, e), f"o{i}": (e, e)}
            shapes |= {f"up{i}": (2 * e, e), f"down{i}": (e, 2 * e)}
        self.weights = {n: torch.zeros(s, device="cuda") for n, s in shapes.items()}
        kv_shape = (cfg.num_blocks, cfg.block_size, cfg.heads, cfg.head_dim)
        self.k_caches = [torch.zeros(kv_shape, device="cuda") for _ in range(cfg.layers)]
        self.v_caches = [torch.zeros(kv_shape, device="cuda") for _ in range(cfg.layers)]
        self.columns = torch.arange(cfg.max_context, device="cuda")

    def forward(
        self,
        input_ids: Tensor,  # [T]
        positions: Tensor,  # [T] each token's position in its request
        slot_maps: Tensor,  # [T, C] the KV slot of every position of the token's request
        last: Tensor | None,  # [R] the tokens whose logits are wanted; None: every token
    ) -> Tensor:
        w = self.weights
        h = w["embed"][input_ids] + w["pos_embed"][positions]
        write_slots = slot_maps.gather(1, positions[:, None]).squeeze(1)
        visible = self.columns[None, :] <= positions[:, None]  # [T, C]
        for i in range(self.cfg.layers):
            x = _rms_norm(h)
            if i == 0:
                x = quantize_int8(x, per_token=self.per_token_scale)
            h = h + self._attention(i, x, write_slots, slot_maps, visible)
            h = h + F.silu(_rms_norm(h) @ w[f"up{i}"].T) @ w[f"down{i}"].T
        if last is not None:
            h = h[last]
        return _rms_norm(h) @ w["lm_head"].T

    def _attention(
        self, i: int, x: Tensor, write_slots: Tensor, slot_maps: Tensor, visible: Tensor
    ) -> Tensor:
        c = self.cfg
        t = x.shape[0]
        q, k, v = (x @ self.weights[f"qkv{i}"].T).view(t, 3, c.heads, c.head_dim).unbind(1)
        k_cache = self.k_caches[i].view(-1, c.heads, c.head_dim)
        v_cache = self.v_caches[i].view(-1, c.heads, c.head_dim)
        k_cache[write_slots] = k
        v_cache[write_slots] = v
        scores = torch.einsum("thd,tchd->thc", q, k_cache[slot_maps]) * c.head_dim**-0.5
        scores = torch.where(visible[:, None, :], scores, float("-inf"))
        probs = scores.softmax(-1)  # [T, H, C]
        values = v_cache[slot_maps]  # [T, C, H, D]
        if self.mask_values:
            # Slots past a request's length (its blocks' tails, the null block) may hold
            # anything, NaN included, and a zero probability times NaN is NaN: replace them.
            values = torch.where(visible[:, :, None, None], values, 0.0)
        out = torch.einsum("thc,tchd->thd", probs, values).reshape(t, c.hidden)
        return out @ self.weights[f"o{i}"].T
