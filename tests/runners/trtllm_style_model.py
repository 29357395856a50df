"""The decoder behind the TensorRT-LLM-style runner (`trtllm_style.py`): two layers over a paged
KV cache, read through an attention-metadata object (query start locations, sequence lengths,
block table, slot mapping) and sampled by a counter-based Gumbel-max sampler.

Written against plain `torch.cuda` and `device="cuda"` only. Nothing in `forward` or `sample` reads
a device value on the host, so a whole step can be captured into one graph. The attention loops
over (request, query offset) pairs the way a varlen kernel's thread blocks do: each request claims
the token rows `query_start_loc[i] .. query_start_loc[i + 1]` and stores its output there, so the
query start locations of every row, padding included, decide which rows are written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

MASK_32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 64
    hidden: int = 32
    num_heads: int = 2
    head_dim: int = 16
    num_layers: int = 2
    num_blocks: int = 40
    block_size: int = 4
    max_blocks_per_seq: int = 6

    @property
    def max_positions(self) -> int:
        return self.block_size * self.max_blocks_per_seq


@dataclass(slots=True)
class AttentionMetadata:
    """One step's inputs: views of the runner's persistent buffers, padded rows included.
    `max_query_len` and `num_kv_tokens` are host values: fixed for a captured graph."""

    input_ids: Tensor  # [T]
    positions: Tensor  # [T]
    slot_mapping: Tensor  # [T]
    query_start_loc: Tensor  # [R + 1]
    seq_lens: Tensor  # [R]
    block_table: Tensor  # [R, max_blocks_per_seq]
    temperature: Tensor  # [R] float32
    seeds: Tensor  # [R] int64, folded to 32 bits
    greedy: Tensor  # [R] bool
    max_query_len: int
    num_kv_tokens: int  # tokens whose keys and values are appended to the cache
    num_kv_blocks: int  # block-table columns attention reads: enough for the longest row


class TinyDecoder:
    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.cfg = cfg
        self.weights = {name: w.to("cuda") for name, w in _init_weights(cfg, seed).items()}
        shape = (cfg.num_blocks, cfg.block_size, cfg.num_heads, cfg.head_dim)
        self.k_caches = [torch.zeros(shape, device="cuda") for _ in range(cfg.num_layers)]
        self.v_caches = [torch.zeros(shape, device="cuda") for _ in range(cfg.num_layers)]

    def load_weights(self, seed: int) -> None:
        # in place: captured graphs read these very tensors
        for name, w in _init_weights(self.cfg, seed).items():
            self.weights[name].copy_(w)

    def forward(
        self, meta: AttentionMetadata, aux: torch.cuda.Stream | None = None, late_fork: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Logits `[R, vocab]` at each row's last query token and the sampled tokens `[R]`.
        With `aux`, the cache append runs on that stream beside the query path; `late_fork`
        issues it before `aux` waits for the current stream."""
        cfg, w = self.cfg, self.weights
        t = meta.input_ids.shape[0]
        x = w["embed"][meta.input_ids] + w["pos"][meta.positions]  # [T, hidden]
        for layer in range(cfg.num_layers):
            h = _rms_norm(x) * w[f"ln1.{layer}"]
            qkv = (h @ w[f"qkv.{layer}"]).view(t, 3, cfg.num_heads, cfg.head_dim)
            q, k, v = qkv.unbind(1)  # [T, H, D] each
            if aux is None:
                self._append(layer, k, v, meta)
            else:
                self._append_beside(aux, layer, k, v, meta, late_fork)
            attn = self._attention(layer, q, meta)
            x = x + attn.reshape(t, -1) @ w[f"o.{layer}"]
            h = _rms_norm(x) * w[f"ln2.{layer}"]
            x = x + torch.nn.functional.silu(h @ w[f"up.{layer}"]) @ w[f"down.{layer}"]
        last = (meta.query_start_loc[1:] - 1).clamp(0, t - 1)  # [R]
        logits = _rms_norm(x[last]) @ w["head"]  # [R, vocab]
        return logits, sample(logits, meta)

    def _append_beside(
        self,
        aux: torch.cuda.Stream,
        layer: int,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        late_fork: bool,
    ) -> None:
        # fork: during a capture `aux` joins it only by waiting on the capturing stream; work
        # issued on it before that wait runs once, now, and is not part of the graph
        main = torch.cuda.current_stream()
        if not late_fork:
            aux.wait_stream(main)
        with torch.cuda.stream(aux):
            self._append(layer, k, v, meta)
        if late_fork:
            aux.wait_stream(main)
        main.wait_stream(aux)  # join before attention reads the cache

    def _append(self, layer: int, k: Tensor, v: Tensor, meta: AttentionMetadata) -> None:
        n = meta.num_kv_tokens
        slots = meta.slot_mapping[:n]
        self.k_caches[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k[:n])
        self.v_caches[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v[:n])

    def _attention(self, layer: int, q: Tensor, meta: AttentionMetadata) -> Tensor:
        cfg = self.cfg
        t, heads, dim = q.shape
        rows = meta.seq_lens.shape[0]
        start = meta.query_start_loc[:-1]  # [R]
        q_len = meta.query_start_loc[1:] - start  # [R]
        offs = torch.arange(meta.max_query_len, device=q.device)  # [Q]
        tok = start[:, None] + offs  # [R, Q]: the token row each (request, offset) stores to
        live = (offs < q_len[:, None]) & (tok >= 0) & (tok < t)
        tok = torch.where(live, tok, t)  # row t: a scratch row nobody reads
        queries = torch.cat([q, q.new_zeros(1, heads, dim)])[tok]  # [R, Q, H, D]
        pos = meta.seq_lens[:, None] - q_len[:, None] + offs  # [R, Q]

        within = torch.arange(cfg.block_size, device=q.device)
        table = meta.block_table[:, : meta.num_kv_blocks]
        slots = (table[:, :, None] * cfg.block_size + within).view(rows, -1)  # [R, S]
        seen = torch.arange(slots.shape[1], device=q.device) < meta.seq_lens[:, None]  # [R, S]
        # masked slots may hold anything (NaN in the null block): select, never multiply by 0
        keys = torch.where(
            seen[..., None, None], self.k_caches[layer].view(-1, heads, dim)[slots], 0
        )
        vals = torch.where(
            seen[..., None, None], self.v_caches[layer].view(-1, heads, dim)[slots], 0
        )

        scores = torch.einsum("rqhd,rshd->rhqs", queries, keys) / math.sqrt(dim)
        causal = torch.arange(slots.shape[1], device=q.device) <= pos[:, :, None]  # [R, Q, S]
        scores = scores.masked_fill(~causal[:, None], -1e30)
        out_rows = torch.einsum("rhqs,rshd->rqhd", scores.softmax(-1), vals)  # [R, Q, H, D]
        out = q.new_zeros(t + 1, heads, dim)
        out.index_copy_(0, tok.reshape(-1), out_rows.reshape(-1, heads, dim))
        return out[:t]


def sample(logits: Tensor, meta: AttentionMetadata) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position of the last query token, token id): a
    request draws the same noise in any batch, row or bucket."""
    vocab = torch.arange(logits.shape[1], device=logits.device)
    position = (meta.seq_lens - 1).clamp(min=0) & MASK_32
    x = _mix(_mix(meta.seeds & MASK_32) ^ position)  # [R]
    bits = _mix(x[:, None] ^ vocab)  # [R, V] in [0, 2**32)
    u = ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)
    gumbel = -torch.log(-torch.log(u))
    noisy = logits / meta.temperature[:, None] + gumbel
    return torch.where(meta.greedy, logits.argmax(-1), noisy.argmax(-1))


def fold_seed(seed: int) -> int:
    """A request's 63-bit seed folded to the 32 bits the sampler hashes."""
    return (seed ^ (seed >> 32)) & MASK_32


def _mix(x: Tensor) -> Tensor:
    # 32-bit integer finalizer; every product stays below 2**63
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & MASK_32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & MASK_32
    return x ^ (x >> 16)


def _rms_norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _init_weights(cfg: ModelConfig, seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float) -> Tensor:
        return torch.randn(*shape, generator=gen) * scale

    width = cfg.num_heads * cfg.head_dim
    weights = {
        "embed": randn(cfg.vocab_size, cfg.hidden, scale=1.0),
        "pos": randn(cfg.max_positions, cfg.hidden, scale=0.5),
        "head": randn(cfg.hidden, cfg.vocab_size, scale=cfg.hidden**-0.5),
    }
    for layer in range(cfg.num_layers):
        weights[f"ln1.{layer}"] = 1 + randn(cfg.hidden, scale=0.1)
        weights[f"ln2.{layer}"] = 1 + randn(cfg.hidden, scale=0.1)
        weights[f"qkv.{layer}"] = randn(cfg.hidden, 3 * width, scale=cfg.hidden**-0.5)
        weights[f"o.{layer}"] = randn(width, cfg.hidden, scale=width**-0.5)
        weights[f"up.{layer}"] = randn(cfg.hidden, 2 * cfg.hidden, scale=cfg.hidden**-0.5)
        weights[f"down.{layer}"] = randn(2 * cfg.hidden, cfg.hidden, scale=(2 * cfg.hidden) ** -0.5)
    return weights
