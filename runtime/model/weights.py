"""Deterministic weights: drawn from a seeded CPU generator, so every backend gets the same bits."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from pytest_graphmode.runtime.model.config import DecoderConfig

# Scales keep the residual stream near unit RMS and give logits a standard deviation of about 2,
# so top-2 margins are usually far above float32/bfloat16 round-off (greedy tokens are stable
# between graph and eager runs) while sampling still has real choices to make.
_LOGIT_SCALE = 2.0
_NORM_JITTER = 0.1


def weight_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape, in the order they are drawn from the generator.

    Projections are stored `[in, out]` so a layer is `x @ w`. Adapter tables hold one entry per
    adapter id, entry 0 being the base model (all zeros).
    """
    c = config
    shapes: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, c.hidden)}
    for layer in range(c.layers):
        p = f"layers.{layer}."
        shapes[p + "attn_norm"] = (c.hidden,)
        shapes[p + "qkv"] = (c.hidden, c.qkv_size)
        shapes[p + "out"] = (c.heads * c.head_dim, c.hidden)
        shapes[p + "mlp_norm"] = (c.hidden,)
        shapes[p + "gate_up"] = (c.hidden, 2 * c.mlp)
        shapes[p + "down"] = (c.mlp, c.hidden)
        if c.num_adapters:
            shapes[p + "adapter_a"] = (c.num_adapters + 1, c.hidden, c.adapter_rank)
            shapes[p + "adapter_b"] = (c.num_adapters + 1, c.adapter_rank, c.qkv_size)
    shapes["final_norm"] = (c.hidden,)
    shapes["lm_head"] = (c.hidden, c.vocab_size)
    return shapes


def init_weights(config: DecoderConfig, seed: int) -> dict[str, Tensor]:
    """float32 CPU weights, a pure function of `(config, seed)`; fresh tensors on every call."""
    return {name: w.clone() for name, w in _drawn(config, seed).items()}


# The twins of an example, and a weight update applied to all of them, ask for the same
# `(config, seed)` several times in a row; drawing is most of a target's construction time.
@functools.lru_cache(maxsize=8)
def _drawn(config: DecoderConfig, seed: int) -> dict[str, Tensor]:
    # Host arithmetic on fresh tensors: drawn outside any dispatch mode (the sim backend's, say),
    # so the kept values never depend on which stream was current when they were first asked for.
    with _disable_current_modes():
        generator = torch.Generator(device="cpu").manual_seed(seed)
        weights = {}
        for name, shape in weight_shapes(config).items():
            noise = torch.randn(shape, generator=generator, dtype=torch.float32)
            weights[name] = noise * _scale(config, name) + _offset(name)
            if name.endswith(("adapter_a", "adapter_b")):
                weights[name][0] = 0.0
    return weights


def _scale(config: DecoderConfig, name: str) -> float:
    kind = name.rsplit(".", 1)[-1]
    fan_in = {
        "embed": 1,
        "qkv": config.hidden,
        "out": config.heads * config.head_dim,
        "gate_up": config.hidden,
        "down": config.mlp,
        "adapter_a": config.hidden,
        "adapter_b": config.adapter_rank,
    }
    if kind in fan_in:
        return 1.0 / math.sqrt(fan_in[kind])
    if kind == "lm_head":
        return _LOGIT_SCALE / math.sqrt(config.hidden)
    return _NORM_JITTER


def _offset(name: str) -> float:
    return 1.0 if name.endswith("norm") else 0.0
