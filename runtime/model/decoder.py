"""The reference decoder: a Llama-like model whose whole step can be captured into a graph.

`forward` reads nothing back to the host: every per-step quantity (which request a token belongs
to, how many keys it sees, where its K/V goes) lives in device tensors, so a capture made with one
batch replays correctly for any other batch with the same numbers of token and request rows.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from pytest_graphmode.runtime.model import inputs as _inputs
from pytest_graphmode.runtime.model.attention import AttentionFn, paged_attention
from pytest_graphmode.runtime.model.config import DecoderConfig
from pytest_graphmode.runtime.model.inputs import DecoderInputs, token_requests
from pytest_graphmode.runtime.model.ops import (
    adapter_delta,
    apply_rope,
    rms_norm,
    rope_angles,
    rope_inv_freq,
    silu_mlp,
)
from pytest_graphmode.runtime.model.weights import init_weights


class Decoder:
    """Weights, a slot-major paged KV cache and a graph-safe forward.

    `kv_cache` is one tensor `[num_blocks * block_size, layers, 2, kv_heads, head_dim]`
    (index 0 keys, 1 values), zero-initialised.
    """

    SEQ_LEN_FILL = _inputs.SEQ_LEN_FILL

    def __init__(self, config: DecoderConfig, *, seed: int, device: torch.device | str) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = config.torch_dtype
        self._weights = {
            name: w.to(device=self.device, dtype=self.dtype)
            for name, w in init_weights(config, seed).items()
        }
        self.kv_cache = torch.zeros(
            (config.num_slots, config.layers, 2, config.kv_heads, config.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self._inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, self.device)
        # The default attention, bound to this cache's geometry; piecewise runners call it
        # eagerly between graph pieces.
        self.attention: AttentionFn = functools.partial(
            paged_attention, block_size=config.block_size, null_block=config.null_block
        )

    def weights(self) -> dict[str, Tensor]:
        """The live weight tensors by name (not copies: graphs read them at these addresses)."""
        return dict(self._weights)

    def load_weights(self, seed: int) -> None:
        """Replace every weight with the weights of `seed`, in place, so captured graphs that
        read the old addresses see the new values."""
        for name, fresh in init_weights(self.config, seed).items():
            self._weights[name].copy_(fresh)

    def forward(
        self,
        inputs: DecoderInputs,
        *,
        use_adapters: bool = False,
        attention: AttentionFn | None = None,
    ) -> Tensor:
        """float32 logits [R, vocab] at each request row's last query token.

        `use_adapters` selects the topology: with it, every token gets its request's adapter
        delta on the QKV projection; without it, no adapter op is issued at all.
        """
        hidden = self.hidden(inputs, use_adapters=use_adapters, attention=attention)
        return self.logits(hidden, inputs)

    def hidden(
        self,
        inputs: DecoderInputs,
        *,
        use_adapters: bool = False,
        attention: AttentionFn | None = None,
        token_adapters: Tensor | None = None,
    ) -> Tensor:
        """The body: hidden states [T, hidden] after the last layer, before the final norm.

        Everything here is token-wise except `attention`, which is why a piecewise runner can
        capture it as graph pieces split at the attention calls. `token_adapters` ([T] adapter id
        per token) replaces the per-request lookup for callers whose request rows vary between
        replays of one capture.
        """
        if use_adapters and not self.config.num_adapters:
            raise ValueError("use_adapters=True needs a DecoderConfig with num_adapters >= 1")
        attention = self.attention if attention is None else attention
        c, w = self.config, self._weights
        num_tokens = inputs.token_ids.shape[0]
        token_ids = inputs.token_ids.clamp(0, c.vocab_size - 1)
        x = w["embed"].index_select(0, token_ids)  # [T, hidden]
        if use_adapters and token_adapters is None:
            token_adapters = self.token_adapters(inputs)
        elif not use_adapters:
            token_adapters = None
        cos, sin = rope_angles(inputs.positions, self._inv_freq)

        for layer in range(c.layers):
            p = f"layers.{layer}."
            h = rms_norm(x, w[p + "attn_norm"])
            qkv = h @ w[p + "qkv"]
            if token_adapters is not None:
                delta = adapter_delta(h, token_adapters, w[p + "adapter_a"], w[p + "adapter_b"])
                qkv = qkv + delta
            q, k, v = qkv.split(
                [c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], dim=-1
            )
            q = apply_rope(q.view(num_tokens, c.heads, c.head_dim), cos, sin)
            k = apply_rope(k.view(num_tokens, c.kv_heads, c.head_dim), cos, sin)
            v = v.view(num_tokens, c.kv_heads, c.head_dim)
            attended = attention(layer, q, k, v, inputs, self.kv_cache)
            x = x + attended.reshape(num_tokens, c.heads * c.head_dim) @ w[p + "out"]
            x = x + silu_mlp(rms_norm(x, w[p + "mlp_norm"]), w[p + "gate_up"], w[p + "down"])
        return x

    def logits(self, hidden: Tensor, inputs: DecoderInputs) -> Tensor:
        """float32 logits [R, vocab] at each request row's last query token."""
        w = self._weights
        num_tokens = hidden.shape[0]
        last = (inputs.query_start[1:] - 1).clamp(0, num_tokens - 1)  # [R]
        final = rms_norm(hidden.index_select(0, last), w["final_norm"])
        # float32 logits even for bfloat16 weights: bfloat16 rounding would tie top tokens often
        # enough to make greedy choices flip on round-off.
        return final.float() @ w["lm_head"].float()

    def token_adapters(self, inputs: DecoderInputs) -> Tensor:
        """[T] adapter id of each token's request, clamped so padding garbage stays in range."""
        adapters = inputs.adapter_ids.index_select(0, token_requests(inputs))
        return adapters.clamp(0, self.config.num_adapters)
