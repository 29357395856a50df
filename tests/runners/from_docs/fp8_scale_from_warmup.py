"""HF-static-cache-style CUDA-graph decode runner with an fp8 (e4m3) paged KV cache.

Written against plain `torch.cuda` only (runs on sim through the harness's drop-in). The model is an
`nn.Module` decoder in the style of Hugging Face transformers' Llama: rotary embeddings from a
registered `inv_freq` buffer (`torch.outer`, `torch.cat((freqs, freqs), -1)`, `.cos()`, `.sin()`),
RMSNorm, and attention through `F.scaled_dot_product_attention` with a 4-D additive float mask
`[rows, 1, q, kv]` built on the device from `cache_position` (`torch.full(..., finfo.min)` +
`torch.triu` + a comparison with `cache_position`, as transformers'
`_prepare_4d_causal_attention_mask_with_cache_position` does). Keys and values are stored as
`torch.float8_e4m3fn` in a slot-major paged cache with a static per-layer scale (quantize
`(k / scale).clamp(-448, 448).to(fp8)`, dequantize `.to(bf16) * scale`), written through a slot
mapping with `index_copy_` and transformers' StaticCache fallback to index assignment where a
device lacks the kernel.

Graph mode: one `torch.cuda.CUDAGraph` per batch-size bucket (1, 2, 4), largest first, in one
shared pool, each warmed up on a side stream first; static `input_ids` / `position_ids` /
`cache_position` / `slot_mapping` / `block_tables` / mask / sampling tensors updated with `copy_`
before every replay. Prefill, mixed, speculative and oversized batches run eagerly. Sampling is
Gumbel-max with counter-based noise hashed from (seed, position, token id); logits float32.

Bug (`make_buggy_target`): vLLM-style `calculate_kv_scales`: the fp8 KV scale of each layer is
calibrated once, on the first forward pass, dynamically from that batch (`k.abs().amax() / 448`
over every row, padding rows included) instead of being a static per-layer scale. In graph mode
the first forward is the capture warm-up on dummy (all-padding) rows, so the graph twin calibrates
on dummy data while an eager engine calibrates on its first real batch; modelled on vLLM's KV-scale
calculation bugs with CUDA graphs / torch.compile
(https://github.com/vllm-project/vllm/pull/25513, fixing #21640: scales computed during
capture/dummy runs; and https://github.com/vllm-project/vllm/pull/38719: warm-up dummy runs
corrupting fp8 KV state).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM, LAYERS, FFN = 32, 2, 16, 2, 64
CTX = SPEC.max_blocks_per_req * SPEC.block_size
NUM_SLOTS = SPEC.num_blocks * SPEC.block_size
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_SCALES = (0.02, 0.03)  # static per-layer scales ("from the checkpoint")
_M32 = 0xFFFFFFFF


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def sample(
    logits: Tensor, positions: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor
) -> Tensor:
    """Gumbel-max; noise from hash(seed, position, token id): batch-independent, no generator."""
    key = _mix(_mix(seeds & _M32) ^ ((positions * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = torch.outer(position_ids.float(), self.inv_freq.float())  # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class FP8PagedCache:
    """Per-layer slot-major fp8 K/V with a static per-layer scale (float32 0-dim device tensors)."""

    def __init__(self, device: torch.device) -> None:
        shape = (NUM_SLOTS, HEADS, HEAD_DIM)
        self.k = [torch.zeros(shape, dtype=FP8, device=device) for _ in range(LAYERS)]
        self.v = [torch.zeros(shape, dtype=FP8, device=device) for _ in range(LAYERS)]
        self.k_scale = [torch.tensor(s, dtype=torch.float32, device=device) for s in KV_SCALES]
        self.v_scale = [torch.tensor(s, dtype=torch.float32, device=device) for s in KV_SCALES]
        self.dynamic = False  # True in the buggy runner: calibrate on the first forward
        self.calibrated = [False] * LAYERS

    def update(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        if self.dynamic and not self.calibrated[layer]:
            self.k_scale[layer].copy_(k.abs().amax().float() / FP8_MAX)
            self.v_scale[layer].copy_(v.abs().amax().float() / FP8_MAX)
            self.calibrated[layer] = True
        qk = (k.float() / self.k_scale[layer]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        qv = (v.float() / self.v_scale[layer]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        for cache, new in ((self.k[layer], qk), (self.v[layer], qv)):
            try:
                cache.index_copy_(0, slots, new)
            except NotImplementedError:  # transformers' StaticCache fallback (e.g. MPS)
                cache[slots] = new

    def read(self, layer: int, context: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        k = self.k[layer][context].to(dtype) * self.k_scale[layer].to(dtype)
        v = self.v[layer][context].to(dtype) * self.v_scale[layer].to(dtype)
        return k, v  # [T, CTX, H, D]


class Attention(nn.Module):
    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, meta: dict, cache: FP8PagedCache
    ) -> Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, HEADS, HEAD_DIM)
        k = self.k_proj(x).view(t, HEADS, HEAD_DIM)
        v = self.v_proj(x).view(t, HEADS, HEAD_DIM)
        c, s = cos[:, None, :], sin[:, None, :]
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        cache.update(self.layer, meta["slot_mapping"], k, v)
        context = (
            meta["block_tables"][:, :, None] * SPEC.block_size
            + torch.arange(SPEC.block_size, device=x.device)
        ).flatten(1)  # [T, CTX]
        keys, values = cache.read(self.layer, context, x.dtype)
        # Masked slots may hold anything (NaN in the null block): zero them so 0 * NaN cannot leak.
        visible = (mask == 0).view(t, CTX)[:, :, None, None]
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        keys = torch.where(visible, keys, zero).transpose(1, 2)  # [T, H, CTX, D]
        values = torch.where(visible, values, zero).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask)
        return self.o_proj(out.reshape(t, HEADS * HEAD_DIM))


class DecoderLayer(nn.Module):
    def __init__(self, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention(layer)
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x, cos, sin, mask, meta, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, meta, cache)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(SPEC.vocab_size, HIDDEN)
        self.layers = nn.ModuleList(DecoderLayer(i) for i in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.rotary_emb = RotaryEmbedding(HEAD_DIM)
        self.lm_head = nn.Linear(HIDDEN, SPEC.vocab_size, bias=False)

    def forward(self, input_ids, position_ids, mask, meta, cache) -> Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, meta, cache)
        logits = self.lm_head(self.norm(x))
        return logits.float()  # HF and vLLM upcast logits to float32


def causal_mask(cache_position: Tensor, dtype: torch.dtype) -> Tensor:
    """[T, 1, 1, CTX] additive mask: 0 where kv index <= the token's cache position, else min.
    Built as transformers does for one query token per row: full(min), then keep min only past
    the cache position (`mask *= arange(target_len) > cache_position`)."""
    t = cache_position.shape[0]
    min_value = torch.finfo(dtype).min
    mask = torch.full((t, CTX), min_value, dtype=dtype, device=cache_position.device)
    mask = mask * (
        torch.arange(CTX, device=cache_position.device)[None, :] > cache_position[:, None]
    )
    return mask[:, None, None, :]


class HFStaticFP8Runner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, dynamic_kv_scale: bool = False
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.device = torch.device("cuda")
        self.dtype = torch.bfloat16
        model = TinyLlama()
        self.model = model.to(device="cuda", dtype=self.dtype).eval()
        self.cache = FP8PagedCache(self.device)
        self.cache.dynamic = dynamic_kv_scale
        self.update_weights(seed)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.static: dict[str, Tensor] = {}
        if mode == "graph":
            self._capture()

    # -- weights ---------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.model.named_parameters()):
            if name.endswith("layernorm.weight") or name == "norm.weight":
                fresh = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                fresh = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
            p.copy_(fresh.to(device=self.device, dtype=p.dtype))

    # -- inputs ----------------------------------------------------------------------------------

    def _host_rows(self, batch: Batch) -> tuple[list[list[int]], list[int], list[list[int]]]:
        rows, last, req_rows = [], [], []
        for r in batch.requests:
            table = list(r.block_ids) + [SPEC.null_block] * (
                SPEC.max_blocks_per_req - len(r.block_ids)
            )
            for i, tok in enumerate(r.tokens):
                pos = r.context_len + i
                rows.append([tok, pos, kv_slot(r.block_ids, pos, SPEC.block_size), *table])
            last.append(len(rows) - 1)
            seed = -1 if r.seed is None else r.seed
            req_rows.append([seed, int(r.seed is not None), rows[-1][1]])
        return rows, last, req_rows

    def _forward(self, ids, pos, slots, tables, mask):
        meta = {"slot_mapping": slots, "block_tables": tables}
        return self.model(ids, pos, mask, meta, self.cache)

    # -- graphs ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _capture(self) -> None:
        n = max(SPEC.capture_sizes)
        d = self.device
        self.static = {
            "input_ids": torch.zeros(n, dtype=torch.long, device=d),
            "position_ids": torch.zeros(n, dtype=torch.long, device=d),
            "cache_position": torch.zeros(n, dtype=torch.long, device=d),
            "slot_mapping": torch.zeros(n, dtype=torch.long, device=d),
            "block_tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=torch.long, device=d),
            "attention_mask": torch.zeros(n, 1, 1, CTX, dtype=self.dtype, device=d),
            "seeds": torch.zeros(n, dtype=torch.long, device=d),
            "temperatures": torch.ones(n, dtype=torch.float32, device=d),
            "do_sample": torch.zeros(n, dtype=torch.bool, device=d),
        }
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._prepare(Batch(()), size)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self._graph_body(size)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._graph_body(size)
            self.graphs[size] = graph

    def _graph_body(self, size: int) -> tuple[Tensor, Tensor]:
        st = {k: v[:size] for k, v in self.static.items()}
        logits = self._forward(
            st["input_ids"],
            st["position_ids"],
            st["slot_mapping"],
            st["block_tables"],
            st["attention_mask"],
        )
        tokens = sample(
            logits, st["cache_position"], st["seeds"], st["temperatures"], st["do_sample"]
        )
        return logits, tokens

    def _prepare(self, batch: Batch, size: int) -> None:
        rows, _, req_rows = self._host_rows(batch)
        pad_row = [0, 0, SPEC.null_block * SPEC.block_size] + [
            SPEC.null_block
        ] * SPEC.max_blocks_per_req
        rows = rows + [pad_row] * (size - len(rows))
        req_rows = req_rows + [[0, 0, 0]] * (size - len(req_rows))
        temps = [r.temperature for r in batch.requests] + [1.0] * (size - batch.num_reqs)
        host = torch.tensor(rows, dtype=torch.long)
        host_req = torch.tensor(req_rows, dtype=torch.long)
        st = self.static
        st["input_ids"][:size].copy_(host[:, 0])
        st["position_ids"][:size].copy_(host[:, 1])
        st["cache_position"][:size].copy_(host[:, 1])
        st["slot_mapping"][:size].copy_(host[:, 2])
        st["block_tables"][:size].copy_(host[:, 3:])
        st["attention_mask"][:size].copy_(causal_mask(st["cache_position"][:size], self.dtype))
        st["seeds"][:size].copy_(host_req[:, 0])
        st["do_sample"][:size].copy_(host_req[:, 1].bool())
        st["temperatures"][:size].copy_(torch.tensor(temps, dtype=torch.float32))

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length > 1 (prefill, mixed or speculative)"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more requests than the largest graph"
        return None

    # -- contract --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
            self._prepare(batch, size)
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            n = batch.num_reqs
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(
                empty, torch.zeros(0, dtype=torch.long, device=self.device), "eager", None, reason
            )
        rows, last, req_rows = self._host_rows(batch)
        host = torch.tensor(rows, dtype=torch.long).to(self.device)
        pos = host[:, 1]
        logits = self._forward(
            host[:, 0], pos, host[:, 2], host[:, 3:], causal_mask(pos, self.dtype)
        )
        idx = torch.tensor(last, dtype=torch.long, device=self.device)
        logits = logits[idx]
        req = torch.tensor(req_rows, dtype=torch.long, device=self.device)
        temps = torch.tensor(
            [r.temperature for r in batch.requests], dtype=torch.float32, device=self.device
        )
        tokens = sample(logits, req[:, 2], req[:, 0], temps, req[:, 1].bool())
        return StepResult(logits, tokens, "eager", None, reason)

    def state(self) -> Mapping[str, Tensor]:
        out = {}
        for i in range(LAYERS):
            out[f"k{i}"] = self.cache.k[i]
            out[f"v{i}"] = self.cache.v[i]
        return out

    def static_buffers(self) -> Mapping[str, Tensor]:
        return dict(self.static) if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HFStaticFP8Runner:
    return HFStaticFP8Runner(mode, seed=seed)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> HFStaticFP8Runner:
    return HFStaticFP8Runner(mode, seed=seed, dynamic_kv_scale=True)
