"""A float16 GQA decoder whose attention is `F.scaled_dot_product_attention` with explicitly chosen
kernels, written against plain `torch.cuda` (runs on sim through the drop-in).

The model: token + learned position embeddings, two pre-norm layers (RMSNorm in float32, fused QKV
projection, 4 query heads sharing 2 KV heads, SiLU-gated MLP), a final norm and an LM head; every
weight and the slot-major paged KV cache (`[num_blocks * block_size, kv_heads, head_dim]` per layer
for K and for V) are float16. Logits are upcast to float32; sampling is Gumbel-max with noise hashed
from (seed, position, token id), greedy rows take the argmax.

Kernels are chosen as a serving engine that wants speed and predictability does, with
`torch.nn.attention.sdpa_kernel([...])` around each call:

- eager prefill of a request that starts from an empty cache (query length == key length, no
  mask): `sdpa_kernel([FLASH_ATTENTION])`, `is_causal=True`, `enable_gqa=True`, over the K/V it
  just projected;
- eager rows that continue a cached sequence (decode, speculative decode, a later prefill chunk,
  fewer queries than keys): the request's context gathered from the cache at exact length and an
  explicit bottom-right boolean mask (`is_causal` would align top-left), `sdpa_kernel(
  [EFFICIENT_ATTENTION, MATH])`, `enable_gqa=True`;
- graph-captured decode steps (capture sizes 1, 2, 4, 8; one token per row, rows padded to the
  capture size, padding rows on the null block at position 0): every row gathers the whole
  `max_blocks_per_req * block_size` window through its block table, masked keys and values are
  zeroed (the null block holds NaN), K/V are expanded to the query heads with
  `repeat_interleave` (as HF's `repeat_kv`) and an additive float16 mask is passed,
  `sdpa_kernel([EFFICIENT_ATTENTION, MATH])`.

The padded decode path keeps its mask in a per-step attention-metadata object: the first layer's
attention builds `attn_bias` (and the boolean visibility it came from) from the step's positions,
and the second layer reuses it (vLLM's torch SDPA backend does the same: "Set attention bias if
not provided. This typically happens at the very attention layer of every iteration",
`attn_metadata.attn_bias is None`). The graph path keeps one metadata object per capture size
around the static buffers, so the forward clears that cache at the start of every step: the
capture then records the build, and every replay rebuilds the mask from the positions it is given.

`make_buggy_target` (the one bug): the forward does not clear the metadata's cached mask; it
relies on metadata being fresh each step, which the eager path's is. The graph path's metadata
object outlives the step: the warm-up before the capture builds `attn_bias` from the warm-up's
all-padding positions (position 0: only slot 0 visible), the capture finds it set and records no
build, and every replay attends with the warm-up's mask (an additive mask buffer captured once and
never refreshed). On a GPU every decoded row then attends to its first token only, silently.
Modelled on vLLM's lazily cached `attn_metadata.attn_bias` (vllm/attention/backends/torch_sdpa.py,
xformers.py: "FIXME(woosuk): This is a hack"), which is correct only while metadata is rebuilt per
iteration, applied to a graph runner whose metadata is persistent; the related padded-row mask
questions are pytorch/pytorch#103749 and vllm-project/vllm#38436 (CUDA-graph padding rows with
seq_len 0 give NaN attention).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

HIDDEN, HQ, HKV, HEAD_DIM, LAYERS, FFN = 64, 4, 2, 16, 2, 96
GROUP = HQ // HKV
DTYPE = torch.float16
NULL_BLOCK = 0
SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=NULL_BLOCK,
)
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size  # the padded decode window, in slots
PRIME = 2147483647

PREFILL_KERNELS = [SDPBackend.FLASH_ATTENTION]
MASKED_KERNELS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rms(x: Tensor, w: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)


def sample(logits: Tensor, seeds: Tensor, temps: Tensor, positions: Tensor) -> Tensor:
    """Gumbel-max with noise from (seed, position, token id); seed < 0 is greedy."""
    ids = torch.arange(logits.shape[1], device=logits.device)
    h = (
        seeds.clamp(min=0)[:, None] * 1000003
        + positions[:, None] * 7919
        + ids[None, :] * 104729
        + 12345
    ) % PRIME
    for _ in range(3):
        h = (h * 48271) % PRIME
    u = ((h % 16777216).float() + 0.5) / 16777216.0
    gumbel = -torch.log(-torch.log(u))
    drawn = (logits / temps[:, None] + gumbel).argmax(-1)
    return torch.where(seeds >= 0, drawn, logits.argmax(-1))


class PaddedMeta:
    """Attention metadata of one padded decode batch: views of the static buffers plus the mask
    the first layer builds and the later layers reuse."""

    def __init__(self, positions: Tensor, tables: Tensor) -> None:
        self.positions, self.tables = positions, tables
        self.visible: Tensor | None = None
        self.attn_bias: Tensor | None = None

    def mask(self) -> tuple[Tensor, Tensor]:
        if self.attn_bias is None:  # built at the first attention layer of the step
            window = torch.arange(CONTEXT, device=self.positions.device)
            self.visible = window[None, :] <= self.positions[:, None]  # [T, S]
            bias = torch.zeros(
                self.positions.shape[0], 1, 1, CONTEXT, dtype=DTYPE, device=self.positions.device
            )
            self.attn_bias = bias.masked_fill(~self.visible[:, None, None, :], float("-inf"))
        assert self.visible is not None
        return self.visible, self.attn_bias

    def clear(self) -> None:
        self.visible = self.attn_bias = None


class SdpaDecoder:
    def __init__(self, mode: str, *, seed: int, clear_meta: bool) -> None:
        self.mode = mode
        self.clear_meta = clear_meta
        self.device = torch.device("cuda")
        dev = self.device
        qkv = (HQ + 2 * HKV) * HEAD_DIM
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "norm_f": (HIDDEN,),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        for layer in range(LAYERS):
            shapes |= {
                f"norm1.{layer}": (HIDDEN,),
                f"wqkv.{layer}": (HIDDEN, qkv),
                f"wo.{layer}": (HQ * HEAD_DIM, HIDDEN),
                f"norm2.{layer}": (HIDDEN,),
                f"wup.{layer}": (HIDDEN, 2 * FFN),
                f"wdown.{layer}": (FFN, HIDDEN),
            }
        with torch.inference_mode():
            self.w = {n: torch.empty(s, device=dev, dtype=DTYPE) for n, s in shapes.items()}
            self.load_weights(seed)
            slots = SPEC.num_blocks * SPEC.block_size
            self.k_cache = [
                torch.zeros(slots, HKV, HEAD_DIM, device=dev, dtype=DTYPE) for _ in range(LAYERS)
            ]
            self.v_cache = [
                torch.zeros(slots, HKV, HEAD_DIM, device=dev, dtype=DTYPE) for _ in range(LAYERS)
            ]
            rows = max(SPEC.capture_sizes)
            self.static: dict[str, Tensor] = {
                "tokens": torch.zeros(rows, dtype=torch.int64, device=dev),
                "positions": torch.zeros(rows, dtype=torch.int64, device=dev),
                "slots": torch.zeros(rows, dtype=torch.int64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=torch.int64, device=dev),
                "seeds": torch.zeros(rows, dtype=torch.int64, device=dev),
                "temps": torch.ones(rows, dtype=torch.float32, device=dev),
            }
            self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.metas: dict[int, PaddedMeta] = {}
            if mode == "graph":
                self.capture()

    def load_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            for name in sorted(self.w):
                t = self.w[name]
                if name.startswith("norm"):
                    fresh = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
                else:
                    fresh = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])
                    if name in ("embed", "pos"):
                        fresh = fresh * math.sqrt(t.shape[0]) * 0.5
                t.copy_(fresh.to(device=self.device, dtype=DTYPE))

    # -- the model ------------------------------------------------------------------------------

    def forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, attend) -> Tensor:
        """Hidden states of every query token; `attend(layer, q, k, v)` -> [T, HQ * D]."""
        w = self.w
        x = w["embed"][tokens] + w["pos"][positions]
        for layer in range(LAYERS):
            qkv = rms(x, w[f"norm1.{layer}"]) @ w[f"wqkv.{layer}"]
            q, k, v = qkv.split([HQ * HEAD_DIM, HKV * HEAD_DIM, HKV * HEAD_DIM], dim=-1)
            q = q.reshape(-1, HQ, HEAD_DIM)
            k = k.reshape(-1, HKV, HEAD_DIM)
            v = v.reshape(-1, HKV, HEAD_DIM)
            self.k_cache[layer].index_copy_(0, slots, k)  # stored before any read of it
            self.v_cache[layer].index_copy_(0, slots, v)
            x = x + attend(layer, q, k, v) @ w[f"wo.{layer}"]
            gate, up = (rms(x, w[f"norm2.{layer}"]) @ w[f"wup.{layer}"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w[f"wdown.{layer}"]
        return rms(x, w["norm_f"])

    def logits_of(self, hidden: Tensor) -> Tensor:
        return (hidden @ self.w["head"]).float()

    # -- padded decode (graphed) ----------------------------------------------------------------

    def padded_step(self, size: int) -> tuple[Tensor, Tensor]:
        s = {n: b[:size] for n, b in self.static.items()}
        meta = self.metas[size]
        if self.clear_meta:
            meta.clear()  # the mask is this step's: built by layer 0, reused by layer 1
        bs = SPEC.block_size
        context = (s["tables"][:, :, None] * bs + torch.arange(bs, device=self.device)).flatten(1)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            visible, bias = meta.mask()
            hidden = ~visible[:, :, None, None]
            # masked slots may hold NaN (null block) or another request's data: zero them
            keys = self.k_cache[layer][context].masked_fill(hidden, 0.0)
            values = self.v_cache[layer][context].masked_fill(hidden, 0.0)
            keys = keys.transpose(1, 2).repeat_interleave(GROUP, dim=1)  # [T, HQ, S, D]
            values = values.transpose(1, 2).repeat_interleave(GROUP, dim=1)
            with sdpa_kernel(MASKED_KERNELS):
                out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=bias)
            return out.reshape(q.shape[0], HQ * HEAD_DIM)

        hidden = self.forward(s["tokens"], s["positions"], s["slots"], attend)
        logits = self.logits_of(hidden)
        return logits, sample(logits, s["seeds"], s["temps"], s["positions"])

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.metas[size] = PaddedMeta(
                self.static["positions"][:size], self.static["tables"][:size]
            )
            self.prepare([], size)  # every row is padding during warm-up and capture
            self.padded_step(size)  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.padded_step(size)
            self.graphs[size] = graph

    def prepare(self, requests: Sequence[Request], size: int) -> None:
        bs, mb = SPEC.block_size, SPEC.max_blocks_per_req
        cols: dict[str, list] = {n: [] for n in self.static}
        for i in range(size):
            if i < len(requests):
                r = requests[i]
                pos = r.context_len
                cols["tokens"].append(r.tokens[0])
                cols["positions"].append(pos)
                cols["slots"].append(kv_slot(r.block_ids, pos, bs))
                cols["tables"].append(list(r.block_ids) + [NULL_BLOCK] * (mb - len(r.block_ids)))
                cols["seeds"].append(-1 if r.seed is None else r.seed % PRIME)
                cols["temps"].append(float(r.temperature))
            else:  # padding: token 0 at position 0, writing and reading the null block only
                cols["tokens"].append(0)
                cols["positions"].append(0)
                cols["slots"].append(NULL_BLOCK * bs)
                cols["tables"].append([NULL_BLOCK] * mb)
                cols["seeds"].append(-1)
                cols["temps"].append(1.0)
        for name, buf in self.static.items():
            buf[:size].copy_(torch.tensor(cols[name], dtype=buf.dtype))

    def replay(self, requests: Sequence[Request]) -> tuple[Tensor, Tensor, int]:
        size = next(s for s in SPEC.capture_sizes if s >= len(requests))
        self.prepare(requests, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = len(requests)
        return logits[:n].clone(), tokens[:n].clone(), size

    # -- eager (prefill, mixed, speculative, and the eager twin) --------------------------------

    def eager(self, requests: Sequence[Request]) -> tuple[Tensor, Tensor]:
        bs, dev = SPEC.block_size, self.device
        tokens, positions, slots, spans, last = [], [], [], [], []
        for r in requests:
            start = len(tokens)
            for i, t in enumerate(r.tokens):
                tokens.append(t)
                positions.append(r.context_len + i)
                slots.append(kv_slot(r.block_ids, r.context_len + i, bs))
            spans.append((start, len(tokens), r))
            last.append(len(tokens) - 1)
        context_slots = {
            id(r): torch.tensor([kv_slot(r.block_ids, p, bs) for p in range(r.seq_len)], device=dev)
            for r in requests
            if r.context_len > 0
        }

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = torch.empty(q.shape[0], HQ * HEAD_DIM, device=dev, dtype=DTYPE)
            for a, b, r in spans:
                qr = q[a:b].transpose(0, 1)[None]  # [1, HQ, L, D]
                n = b - a
                if r.context_len == 0:  # a whole prompt: as many queries as keys, no mask
                    with sdpa_kernel(PREFILL_KERNELS):
                        o = F.scaled_dot_product_attention(
                            qr,
                            k[a:b].transpose(0, 1)[None],
                            v[a:b].transpose(0, 1)[None],
                            is_causal=True,
                            enable_gqa=True,
                        )
                else:  # fewer queries than keys: bottom-right causal mask, spelled out
                    ctx = context_slots[id(r)]
                    kr = self.k_cache[layer][ctx].transpose(0, 1)[None]  # [1, HKV, seq, D]
                    vr = self.v_cache[layer][ctx].transpose(0, 1)[None]
                    keys = torch.arange(r.seq_len, device=dev)
                    queries = r.context_len + torch.arange(n, device=dev)
                    mask = (keys[None, :] <= queries[:, None])[None, None]  # [1, 1, L, seq]
                    with sdpa_kernel(MASKED_KERNELS):
                        o = F.scaled_dot_product_attention(
                            qr, kr, vr, attn_mask=mask, enable_gqa=True
                        )
                out[a:b] = o[0].transpose(0, 1).reshape(n, HQ * HEAD_DIM)
            return out

        as_dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)  # noqa: E731
        hidden = self.forward(as_dev(tokens), as_dev(positions), as_dev(slots), attend)
        idx = as_dev(last)
        logits = self.logits_of(hidden[idx])
        seeds = as_dev([-1 if r.seed is None else r.seed % PRIME for r in requests])
        temps = torch.tensor([float(r.temperature) for r in requests], device=dev)
        return logits, sample(logits, seeds, temps, as_dev(positions)[idx])

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.metas.clear()


class SdpaTarget:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, clear_meta: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.runner = SdpaDecoder(mode, seed=seed, clear_meta=clear_meta)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length above one (prefill, mixed or speculative)"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more rows than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        with torch.inference_mode():
            if batch.num_reqs == 0:
                empty = torch.empty(0, SPEC.vocab_size, device=self.runner.device)
                return StepResult(
                    empty,
                    torch.empty(0, dtype=torch.int64, device=self.runner.device),
                    "eager",
                    None,
                    reason=reason,
                )
            if reason is None:
                logits, tokens, size = self.runner.replay(batch.requests)
                return StepResult(logits, tokens, "full", ("decode", size))
            logits, tokens = self.runner.eager(batch.requests)
            return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        out: dict[str, Tensor] = {}
        for layer in range(LAYERS):
            out[f"k{layer}"] = self.runner.k_cache[layer]
            out[f"v{layer}"] = self.runner.v_cache[layer]
        return out

    def static_buffers(self) -> Mapping[str, Tensor]:
        return dict(self.runner.static) if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.load_weights(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SdpaTarget:
    return SdpaTarget(mode, seed=seed, clear_meta=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SdpaTarget:
    return SdpaTarget(mode, seed=seed, clear_meta=False)
