"""A slow, dense oracle for the decoder: whole sequences from scratch, in float64, on the CPU.

No KV cache, no block tables, no padding, one request at a time, written out independently of the
paged code path, so agreement with `Decoder.forward` checks the cache writes, the paging, the
token-to-request map and the causal masks, not just the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_graphmode.runtime.model.config import DecoderConfig

_EPS = 1e-6


def reference_forward(
    config: DecoderConfig,
    weights: Mapping[str, Tensor],
    sequences: Sequence[Sequence[int]],
    adapters: Sequence[int] | None = None,
    *,
    use_adapters: bool = False,
) -> Tensor:
    """float32 logits [len(sequences), vocab] at the last token of each full token sequence
    (context and query together), as the paged decoder should produce them."""
    adapters = [0] * len(sequences) if adapters is None else list(adapters)
    if len(adapters) != len(sequences):
        raise ValueError(f"{len(adapters)} adapter ids for {len(sequences)} sequences")
    if use_adapters and not config.num_adapters:
        raise ValueError("use_adapters=True needs a DecoderConfig with num_adapters >= 1")
    w = {name: t.detach().to("cpu", torch.float64) for name, t in weights.items()}
    rows = [
        _sequence_logits(config, w, list(tokens), adapter if use_adapters else None)
        for tokens, adapter in zip(sequences, adapters, strict=True)
    ]
    return torch.stack(rows).float()


def _sequence_logits(
    c: DecoderConfig, w: dict[str, Tensor], tokens: list[int], adapter: int | None
) -> Tensor:
    n = len(tokens)
    x = w["embed"][torch.tensor(tokens)]  # [n, hidden]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(c.layers):
        p = f"layers.{layer}."
        h = _rms(x, w[p + "attn_norm"])
        qkv = h @ w[p + "qkv"]
        if adapter is not None:
            qkv = qkv + h @ w[p + "adapter_a"][adapter] @ w[p + "adapter_b"][adapter]
        q_size, kv_size = c.heads * c.head_dim, c.kv_heads * c.head_dim
        q = _rope(qkv[:, :q_size].reshape(n, c.heads, c.head_dim), c.rope_theta)
        k = _rope(
            qkv[:, q_size : q_size + kv_size].reshape(n, c.kv_heads, c.head_dim), c.rope_theta
        )
        v = qkv[:, q_size + kv_size :].reshape(n, c.kv_heads, c.head_dim)
        heads_out = []
        for head in range(c.heads):
            kv_head = head // (c.heads // c.kv_heads)
            scores = q[:, head] @ k[:, kv_head].T / math.sqrt(c.head_dim)  # [n, n]
            scores = scores.masked_fill(~causal, float("-inf"))
            heads_out.append(torch.softmax(scores, dim=-1) @ v[:, kv_head])
        x = x + torch.cat(heads_out, dim=-1) @ w[p + "out"]
        gate, up = (_rms(x, w[p + "mlp_norm"]) @ w[p + "gate_up"]).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ w[p + "down"]
    return _rms(x[-1], w["final_norm"]) @ w["lm_head"]


def _rms(x: Tensor, weight: Tensor) -> Tensor:
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + _EPS) * weight


def _rope(x: Tensor, theta: float) -> Tensor:
    """Rotate pair (i, i + head_dim/2) of position p by p / theta**(2i / head_dim)."""
    n, _, dim = x.shape
    half = dim // 2
    freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / dim)
    angle = torch.arange(n, dtype=torch.float64)[:, None, None] * freq  # [n, 1, half]
    first, second = x[..., :half], x[..., half:]
    return torch.cat(
        (first * angle.cos() - second * angle.sin(), second * angle.cos() + first * angle.sin()),
        dim=-1,
    )
