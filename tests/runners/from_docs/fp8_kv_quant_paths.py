"""A bfloat16 two-layer decoder with a float8 (e4m3fn) paged KV cache and per-slot scales, whose
CUDA-graph decode path quantizes and dequantizes in another order than its eager path.

Model: token + learned position embeddings, 2 layers of (RMS norm, Q/K/V projections, attention
over a slot-major paged KV cache read through block tables, output projection, SiLU MLP), final
RMS norm and an LM head; vocabulary 320; weights and activations in bfloat16, logits handed out
upcast to float32 (every value a bfloat16 holds).

KV cache (per layer, in `state()`): `k{i}`, `v{i}` as `torch.float8_e4m3fn [slots, heads, dim]`,
`ks{i}` a float32 scale per slot `[slots]` (amax over all heads of the token's key / 448), `vs{i}` a
float32 scale per slot and head `[slots, heads]`, as per-token(-head) fp8 KV caches (vLLM's
`fp8_per_token_head`, DeepSeek-V3.2's fp8 indexer cache with inline fp32 scales) keep them.
Codes are stored through a `uint8` view (SGLang's fp8 pools store as uint8 since `index_put_`
has no fp8 kernel on every device).

- Eager path (eager twin; graph twin's prefill / mixed / speculative / oversized batches):
  per-head loop for the amax (max over the heads' maxima), quantize by multiplying with the
  reciprocal `448 / amax`; attention dequantizes K and V to bfloat16 first (`codes * scale`,
  rounded to bf16) and then runs float32 softmax attention on them ("dequantize, then matmul").
- Graph path (decode batches of up to 8 requests, padded to capture size 1/2/4/8, captured at
  start-up, largest first, one pool): fused QKV projection (a derived weight refreshed in place by
  `update_weights`), amax over all heads in one reduction, quantize by dividing by
  `scale = amax / 448`; attention multiplies the raw fp8 codes with q and applies the key scale to
  the scores afterwards, and folds the value scale into the probabilities ("scale after
  matmul", as fused fp8 attention kernels do). Padding rows carry slot -1 (vLLM's PAD_SLOT_ID);
  the cache store maps a negative slot to the null block's first slot.

The two twins therefore compute the same mathematics with other rounding: a layer-1 key or value
lands on a neighbouring fp8 code now and then, its scale differs by a bf16 rounding, and logits
differ at bfloat16's level.

Bug (`make_buggy_target`): the graph path's scale store (a separate indexed store of the per-slot
scales, beside the guarded code store) does not skip the -1 padding sentinel: `scale_cache[-1]`
wraps to the last slot of the cache, so every padded replay writes the padding row's scale into
block `num_blocks - 1` (a live request's block, or one no request of the step lists). Modelled on
TensorRT-LLM PR #18673 ("Guard MiniMax-M3 FP8 indexer against padded -1 cache slots": with CUDA
graphs the FP8 cache writer runs over the padded token extent and turned slot -1 into a write
outside the real slots; https://github.com/NVIDIA/TensorRT-LLM/pull/18673) and on SGLang PR #35351
("[mxfp8-kv] Skip writes to the reserved CUDA-graph padding slot": the bf16 store guarded padding
lanes, the fp8 pool's scale store did not; https://github.com/sgl-project/sglang/pull/35351).
No code copied from either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=320,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS = 64, 4, 16, 2
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
PAD_SLOT = -1  # vLLM's PAD_SLOT_ID
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_EPS = 1e-6
BF16 = torch.bfloat16
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]; -1 for padding rows
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R]; None when T == R (decode)


# -- quantization: two formulations of the same mathematics ------------------------------------


def quantize_fused(x: Tensor, per_head: bool) -> tuple[Tensor, Tensor]:
    """Graph path: one reduction for the amax, divide by the scale."""
    xf = x.float()  # [T, H, D]
    amax = xf.abs().amax(dim=-1) if per_head else xf.abs().amax(dim=(1, 2))  # [T, H] / [T]
    scale = amax.clamp(min=AMAX_EPS) / FP8_MAX
    div = scale[..., None] if per_head else scale[:, None, None]
    codes = (xf / div).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def quantize_looped(x: Tensor, per_head: bool) -> tuple[Tensor, Tensor]:
    """Eager path: per-head loop, multiply by the reciprocal."""
    heads = [x[:, h].float() for h in range(HEADS)]
    head_amax = [h.abs().amax(dim=-1) for h in heads]  # each [T]
    if per_head:
        amax = torch.stack(head_amax, dim=1)  # [T, H]
        inv = [FP8_MAX / amax[:, h].clamp(min=AMAX_EPS) for h in range(HEADS)]
    else:
        amax = head_amax[0]
        for a in head_amax[1:]:
            amax = torch.maximum(amax, a)
        inv = [FP8_MAX / amax.clamp(min=AMAX_EPS)] * HEADS
    scale = amax.clamp(min=AMAX_EPS) / FP8_MAX
    codes = torch.stack(
        [
            (h * i[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            for h, i in zip(heads, inv, strict=True)
        ],
        dim=1,
    )
    return codes, scale


# -- attention: dequantize-then-matmul vs scale-after-matmul ----------------------------------


def _context(inputs: StepInputs, device: torch.device) -> tuple[Tensor, Tensor]:
    size = SPEC.block_size
    offsets = torch.arange(size, device=device)
    context = (inputs.tables[:, :, None] * size + offsets).flatten(1)  # [T, C]
    visible = torch.arange(CONTEXT, device=device)[None, :] <= inputs.positions[:, None]
    return context, visible


def attention_dequant_first(q: Tensor, cache: dict[str, Tensor], inputs: StepInputs) -> Tensor:
    context, visible = _context(inputs, q.device)
    keys = (cache["k"][context].float() * cache["ks"][context][:, :, None, None]).to(BF16)
    vals = (cache["v"][context].float() * cache["vs"][context][:, :, :, None]).to(BF16)
    qf = q.view(-1, HEADS, HEAD_DIM).float()
    scores = torch.einsum("thd,tchd->thc", qf, keys.float()) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    vals = torch.where(visible[:, :, None, None], vals.float(), torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, vals).flatten(1).to(BF16)


def attention_scale_after(q: Tensor, cache: dict[str, Tensor], inputs: StepInputs) -> Tensor:
    context, visible = _context(inputs, q.device)
    zero = torch.zeros((), device=q.device)
    qf = q.view(-1, HEADS, HEAD_DIM).float()
    raw = torch.einsum("thd,tchd->thc", qf, cache["k"][context].float())
    k_scale = torch.where(visible, cache["ks"][context], zero) * (1.0 / math.sqrt(HEAD_DIM))
    scores = (raw * k_scale[:, None, :]).masked_fill(~visible[:, None, :], float("-inf"))
    probs = scores.softmax(-1)  # [T, H, C]
    v_scale = torch.where(visible[:, :, None], cache["vs"][context], zero)  # [T, C, H]
    codes = torch.where(visible[:, :, None, None], cache["v"][context].float(), zero)
    weighted = probs * v_scale.transpose(1, 2)
    return torch.einsum("thc,tchd->thd", weighted, codes).flatten(1).to(BF16)


def _rms(x: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16)


class Fp8KvDecoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            **{f"{n}{i}": (HIDDEN, HIDDEN) for i in range(LAYERS) for n in "qkvo"},
            **{f"up{i}": (HIDDEN, 2 * HIDDEN) for i in range(LAYERS)},
            **{f"down{i}": (2 * HIDDEN, HIDDEN) for i in range(LAYERS)},
        }
        self.w = {n: torch.empty(s, dtype=BF16, device=device) for n, s in shapes.items()}
        # derived weights the graph path reads: fused QKV, refreshed in place
        self.qkv = [
            torch.empty(HIDDEN, 3 * HIDDEN, dtype=BF16, device=device) for _ in range(LAYERS)
        ]
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            weight = self.w[name]
            fresh = torch.randn(weight.shape, generator=gen) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(BF16).to(weight.device))
        for i in range(LAYERS):
            self.qkv[i].copy_(torch.cat([self.w[f"{n}{i}"] for n in "qkv"], dim=1))

    def forward(
        self, inputs: StepInputs, kv: list[dict[str, Tensor]], fused: bool, guard_scales: bool
    ) -> Tensor:
        w = self.w
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]
        # a negative (padding) slot goes to the null block's first slot
        safe = torch.where(
            inputs.slots >= 0, inputs.slots, torch.full_like(inputs.slots, NULL_SLOT)
        )
        scale_slots = safe if guard_scales else inputs.slots
        for i, cache in enumerate(kv):
            h = _rms(x)
            if fused:
                q, k, v = (h @ self.qkv[i]).split(HIDDEN, dim=-1)
            else:
                q, k, v = (h @ w[f"{n}{i}"] for n in "qkv")
            k = k.reshape(-1, HEADS, HEAD_DIM)
            v = v.reshape(-1, HEADS, HEAD_DIM)
            quant = quantize_fused if fused else quantize_looped
            k_codes, k_scale = quant(k, per_head=False)
            v_codes, v_scale = quant(v, per_head=True)
            cache["k"].view(torch.uint8).index_copy_(0, safe, k_codes.view(torch.uint8))
            cache["v"].view(torch.uint8).index_copy_(0, safe, v_codes.view(torch.uint8))
            if fused:  # the graph path's separate scale store
                cache["ks"][scale_slots] = k_scale
                cache["vs"][scale_slots] = v_scale
            else:
                cache["ks"].index_copy_(0, safe, k_scale)
                cache["vs"].index_copy_(0, safe, v_scale)
            attn = attention_scale_after if fused else attention_dequant_first
            x = x + attn(q, cache, inputs) @ w[f"o{i}"]
            x = x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        if inputs.last is not None:
            x = x[inputs.last]
        return (_rms(x) @ w["head"]).float()


def sample(logits: Tensor, inputs: StepInputs) -> Tensor:
    positions = inputs.positions if inputs.last is None else inputs.positions[inputs.last]
    key = _mix(_mix(inputs.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inputs.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inputs.sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class Fp8KvRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, guard_scales: bool = True
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.guard_scales = guard_scales
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.device = device
        with torch.inference_mode():
            self.model = Fp8KvDecoder(seed, device)
            n = SPEC.num_slots
            self.kv = [
                {
                    "k": torch.zeros(n, HEADS, HEAD_DIM, device=device).to(FP8),
                    "v": torch.zeros(n, HEADS, HEAD_DIM, device=device).to(FP8),
                    "ks": torch.zeros(n, device=device),
                    "vs": torch.zeros(n, HEADS, device=device),
                }
                for _ in range(LAYERS)
            ]
            self.graphs: dict[int, Any] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            if mode == "graph":
                self.buffers = self.allocate_buffers(SPEC.capture_sizes[-1])
                self.capture()

    # -- graph mode -------------------------------------------------------------------------

    def allocate_buffers(self, rows: int) -> dict[str, Tensor]:
        d, i64 = self.device, torch.int64
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=d),
            "positions": torch.zeros(rows, dtype=i64, device=d),
            "slots": torch.full((rows,), PAD_SLOT, dtype=i64, device=d),
            "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=d),
            "seeds": torch.zeros(rows, dtype=i64, device=d),
            "temperatures": torch.ones(rows, device=d),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=d),
        }

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{name: buf[:size] for name, buf in self.buffers.items()})

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inputs = self.static_inputs(size)
            self.run_model(inputs, fused=True)  # warm-up
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(inputs, fused=True)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = _decode_rows(batch.requests)
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(_PADDING[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes -------------------------------------------------------------------------

    def run_model(self, inputs: StepInputs, fused: bool) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv, fused=fused, guard_scales=self.guard_scales)
        return logits, sample(logits, inputs)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(len(r.tokens) != 1 or r.context_len == 0 for r in batch.requests):
            return f"{batch.phase} batch"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            if reason is None:
                return self.replay(batch)
            if batch.num_reqs == 0:
                empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
                return StepResult(
                    empty,
                    torch.zeros(0, dtype=torch.int64, device=self.device),
                    "eager",
                    None,
                    reason=reason,
                )
            logits, tokens = self.run_model(_eager_inputs(batch, self.device), fused=False)
            return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        out: dict[str, Tensor] = {}
        for i, cache in enumerate(self.kv):
            for name in ("k", "v", "ks", "vs"):
                out[f"{name}{i}"] = cache[name]
        return out

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


_PADDING: dict[str, float | int | bool] = {
    "tokens": 0,
    "positions": 0,
    "slots": PAD_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def _table(r: Request) -> list[int]:
    blocks = list(r.block_ids)[: SPEC.max_blocks_per_req]
    return blocks + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(blocks))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & _MASK32, float(r.temperature), True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    sampling = [_sampling(r) for r in requests]
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_slot(r, r.context_len) for r in requests],
        "tables": [_table(r) for r in requests],
        "seeds": [s[0] for s in sampling],
        "temperatures": [s[1] for s in sampling],
        "sampled": [s[2] for s in sampling],
    }


def _eager_inputs(batch: Batch, device: torch.device) -> StepInputs:
    tokens, positions, slots, tables, last = [], [], [], [], []
    for r in batch.requests:
        for j, tok in enumerate(r.tokens):
            tokens.append(tok)
            positions.append(r.context_len + j)
            slots.append(_slot(r, r.context_len + j))
            tables.append(_table(r))
        last.append(len(tokens) - 1)
    sampling = [_sampling(r) for r in batch.requests]

    def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return StepInputs(
        tokens=t(tokens),
        positions=t(positions),
        slots=t(slots),
        tables=t(tables).view(-1, SPEC.max_blocks_per_req),
        seeds=t([s[0] for s in sampling]),
        temperatures=t([s[1] for s in sampling], torch.float32),
        sampled=t([s[2] for s in sampling], torch.bool),
        last=t(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Fp8KvRunner:
    return Fp8KvRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Fp8KvRunner:
    return Fp8KvRunner(mode, seed=seed, backend=backend, guard_scales=False)
