"""The model of the SGLang-style runner (`sglang_style.py`): a two-layer decoder with a slot-major
paged KV cache, and counter-based Gumbel sampling keyed by `(seed, position, token)`. Nothing here
knows of any test harness."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 64
    hidden: int = 32
    heads: int = 2
    layers: int = 2
    num_blocks: int = 24
    block_size: int = 4
    max_blocks_per_req: int = 6
    null_block: int = 0  # padding writes here; never given to a request

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def max_context(self) -> int:
        return self.max_blocks_per_req * self.block_size

    @property
    def null_slot(self) -> int:
        return self.null_block * self.block_size


_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash round; every product stays below 2**63."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    temperatures: torch.Tensor,
    counters: torch.Tensor,
    vocab_ids: torch.Tensor,
) -> torch.Tensor:
    """Gumbel-max with noise hashed from (seed, counter, token id); a negative seed is greedy."""
    h = _mix(seeds & _M32)
    h = _mix(h ^ (seeds >> 32) & _M32)
    h = _mix(h ^ counters & _M32)
    h = _mix(h[:, None] ^ vocab_ids[None, :])  # [R, V]
    u = ((h & 0xFFFFFF).to(torch.float32) + 0.5) / float(1 << 24)
    sampled = (logits / temperatures[:, None] - torch.log(-torch.log(u))).argmax(-1)
    return torch.where(seeds < 0, logits.argmax(-1), sampled)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyDecoder:
    """Learned positions, paged attention through `req_to_token`, a SiLU MLP, an LM head."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.cfg = cfg
        e, v = cfg.hidden, cfg.vocab_size
        shapes = {"embed": (v, e), "pos_embed": (cfg.max_context, e), "lm_head": (v, e)}
        for i in range(cfg.layers):
            shapes |= {f"qkv{i}": (3 * e, e), f"o{i}": (e, e)}
            shapes |= {f"up{i}": (2 * e, e), f"down{i}": (e, 2 * e)}
        self.weights = {n: torch.empty(s, device="cuda") for n, s in shapes.items()}
        self.load_weights(seed)
        kv_shape = (cfg.num_blocks, cfg.block_size, cfg.heads, cfg.head_dim)
        self.k_caches = [torch.zeros(kv_shape, device="cuda") for _ in range(cfg.layers)]
        self.v_caches = [torch.zeros(kv_shape, device="cuda") for _ in range(cfg.layers)]
        self.cols = torch.arange(cfg.max_context, device="cuda")
        self.vocab_ids = torch.arange(v, device="cuda")

    def load_weights(self, seed: int) -> None:
        """In place, so captured graphs read the new values."""
        gen = torch.Generator().manual_seed(seed)
        for name, w in self.weights.items():
            scale = 1.0 if "embed" in name else 2.0 * w.shape[1] ** -0.5
            w.copy_(torch.randn(w.shape, generator=gen) * scale)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        rows: torch.Tensor,  # [T] each token's row of req_to_token
        req_to_token: torch.Tensor,  # [P, C] KV slot of every position of a row
        last: torch.Tensor | None,  # [R] the tokens whose logits are wanted; None: all
        head: torch.Tensor,  # [E, V]
    ) -> torch.Tensor:
        w = self.weights
        h = w["embed"][input_ids] + w["pos_embed"][positions]  # [T, E]
        out_cache_loc = req_to_token[rows, positions]  # [T]
        slots = req_to_token[rows]  # [T, C]
        visible = self.cols[None, :] <= positions[:, None]  # [T, C]
        for i in range(self.cfg.layers):
            h = h + self._attention(i, _norm(h), out_cache_loc, slots, visible)
            h = h + F.silu(_norm(h) @ w[f"up{i}"].T) @ w[f"down{i}"].T
        if last is not None:
            h = h[last]
        return _norm(h) @ head  # [R, V]

    def _attention(
        self, i: int, x: torch.Tensor, loc: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        c = self.cfg
        t = x.shape[0]
        q, k, v = (x @ self.weights[f"qkv{i}"].T).view(t, 3, c.heads, c.head_dim).unbind(1)
        k_cache = self.k_caches[i].view(-1, c.heads, c.head_dim)
        v_cache = self.v_caches[i].view(-1, c.heads, c.head_dim)
        k_cache[loc] = k
        v_cache[loc] = v
        scores = torch.einsum("thd,tchd->thc", q, k_cache[slots]) * c.head_dim**-0.5
        # masked slots may hold anything (NaN in the null block): replace, never multiply
        scores = torch.where(visible[:, None, :], scores, float("-inf"))
        values = torch.where(visible[:, :, None, None], v_cache[slots], 0.0)
        out = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).reshape(t, c.hidden)
        return out @ self.weights[f"o{i}"].T
