"""A float16 decoder runner with GPTQ/AWQ-style INT4 weight-only quantized linear layers.

Written by an outside author against the public docs only (docs/own-runner.md, docs/contract.md),
in plain `torch.cuda` (on sim the harness's drop-in stands in for CUDA).

Model: two decoder layers, float16 activations and KV cache (slot-major paged cache read through
block tables), attention scores in float32. Every projection (fused QKV, O, MLP up/down) is an
`Int4Linear`: int4 codes packed two per uint8 along the input dimension (low nibble = even input
index), one float16 scale and one uint8 zero point per group of 32 inputs (asymmetric min/max
quantization, as GPTQ/AWQ checkpoints carry). Embedding, learned positions and the LM head stay
float16. Sampling is Gumbel-max from a hash of (seed, position, token id).

Two arithmetic orders, both correct:
- graph path (captured decode graphs, sizes 1/2/4): dequantize on the fly inside the graph
  (unpack nibbles, subtract zero, multiply by scale) and run one float16 GEMM;
- eager path (prefill, mixed, speculative, large batches and the eager twin): fold the scales
  after the matmul, group by group (x_g @ (q_g - z_g)^T, times s_g, summed over groups), the
  order an exllama/AWQ GEMV kernel uses.

`update_weights(seed)` re-quantizes new float32 weights on the host with the same quantizer on
both twins and copies the codes, scales and zeros into the existing packed tensors in place
(`copy_`), so captured graphs read the new weights.

Bug (`make_buggy_target`): for speed the graph path caches each layer's dequantized float16 weight
once at capture time ("skip the unpack in every replay"), and the captured GEMMs read that cache.
`update_weights` re-quantizes the packed int4 tensors in place but never refreshes the derived
float16 copy, so every replay after a weight update computes with the old weights while the eager
path uses the new ones. Modelled on the derived-tensor-after-reload class of public engine bugs:
vLLM RFC "Weight Reload Correctness for RL" (https://github.com/vllm-project/vllm/issues/48312,
item "Runtime value refresh: derived tensors"), vLLM PR "Preserve Marlin runtime tensor storage
across weight reload" (https://github.com/vllm-project/vllm/pull/48438), vLLM RFC
https://github.com/vllm-project/vllm/issues/54477 (Marlin INT4 repack breaks graph captures on
reload), and SGLang PR "weights update for deepseek when enabling cuda graph"
(https://github.com/sgl-project/sglang/pull/4961: w_kc/w_vc derived from kv_b_proj not kept in
step with a weight reload under CUDA graphs). No code copied from those engines.

Extra variant (`make_buggy_target_rebind`, not part of the brief's one-bug pair): `update_weights`
rebinds the packed weight, scales and zeros to new tensors instead of `copy_` into them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS, GROUP = 64, 2, 32, 128, 2, 32
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
DTYPE = torch.float16
M32 = 0xFFFFFFFF


# -- int4 weight-only quantization ---------------------------------------------------------------


def quantize_int4(weight: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """Host-side asymmetric group-wise int4 quantization of a float32 [out, in] weight.

    Returns (packed uint8 [out, in/2], scales float16 [out, in/group], zeros uint8 [out, in/group]).
    Deterministic float32 arithmetic on the host: both twins get identical codes."""
    out_f, in_f = weight.shape
    groups = weight.view(out_f, in_f // group, group)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo) / 15.0).clamp_min(1e-5).to(torch.float16)
    s32 = scales.to(torch.float32)  # quantize against the scale the kernel will use
    zeros = torch.round(-lo / s32).clamp(0, 15)
    codes = torch.round(groups / s32[..., None] + zeros[..., None]).clamp(0, 15).to(torch.uint8)
    codes = codes.view(out_f, in_f // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.contiguous(), scales.contiguous(), zeros.to(torch.uint8).contiguous()


class Int4Linear:
    """y = x @ dequant(W)^T with W stored as packed int4 codes, group scales and zero points."""

    rebind_on_load = False  # second, optional bug variant (make_buggy_target_rebind)

    def __init__(self, in_features: int, out_features: int, device: torch.device) -> None:
        assert in_features % GROUP == 0 and in_features % 2 == 0
        self.in_features, self.out_features = in_features, out_features
        g = in_features // GROUP
        self.packed = torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        self.scales = torch.ones(out_features, g, dtype=DTYPE, device=device)
        self.zeros = torch.zeros(out_features, g, dtype=torch.uint8, device=device)

    def load(self, weight: Tensor) -> None:
        """Re-quantize in place: the captured graphs keep the same three tensors."""
        packed, scales, zeros = quantize_int4(weight, GROUP)
        if self.rebind_on_load:  # BUG variant: new tensors; captured graphs keep the old ones
            self.packed = packed.to(self.packed.device)
            self.scales = scales.to(self.scales.device)
            self.zeros = zeros.to(self.zeros.device)
            return
        self.packed.copy_(packed.to(self.packed.device))
        self.scales.copy_(scales.to(self.scales.device))
        self.zeros.copy_(zeros.to(self.zeros.device))

    def codes(self) -> Tensor:
        """Unpack the nibbles: uint8 [out, in] codes 0..15."""
        low = self.packed & 0x0F
        high = self.packed >> 4
        return torch.stack((low, high), dim=-1).view(self.out_features, self.in_features)

    def dequantize(self) -> Tensor:
        """Float16 [out, in]: (q - z) * s, group by group."""
        q = self.codes().to(DTYPE).view(self.out_features, -1, GROUP)
        w = (q - self.zeros.to(DTYPE)[..., None]) * self.scales[..., None]
        return w.view(self.out_features, self.in_features)

    def forward_dequant(self, x: Tensor) -> Tensor:
        """Graph path: dequantize on the fly, one GEMM."""
        return x @ self.dequantize().t()

    def forward_folded(self, x: Tensor) -> Tensor:
        """Eager path: integer-valued (q - z) GEMM per group, scales applied after, summed."""
        t = x.shape[0]
        qz = self.codes().to(DTYPE).view(self.out_features, -1, GROUP)
        qz = qz - self.zeros.to(DTYPE)[..., None]  # exact: integers -15..15
        partial = torch.einsum("tgk,ngk->tgn", x.view(t, -1, GROUP), qz)  # [T, groups, out]
        return (partial * self.scales.t()[None]).sum(1)


class Int4Decoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.embed = torch.zeros(SPEC.vocab_size, HIDDEN, dtype=DTYPE, device=device)
        self.pos = torch.zeros(CONTEXT, HIDDEN, dtype=DTYPE, device=device)
        self.head = torch.zeros(HIDDEN, SPEC.vocab_size, dtype=DTYPE, device=device)
        self.linears: dict[str, Int4Linear] = {}
        for i in range(LAYERS):
            self.linears[f"qkv{i}"] = Int4Linear(HIDDEN, 3 * HIDDEN, device)
            self.linears[f"o{i}"] = Int4Linear(HIDDEN, HIDDEN, device)
            self.linears[f"up{i}"] = Int4Linear(HIDDEN, FFN, device)
            self.linears[f"down{i}"] = Int4Linear(FFN, HIDDEN, device)
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, t in (("embed", self.embed), ("pos", self.pos), ("head", self.head)):
            fresh = torch.randn(t.shape, generator=gen) / math.sqrt(
                t.shape[0] if name == "head" else 1
            )
            t.copy_(fresh.to(DTYPE).to(self.device))
        for name in sorted(self.linears):
            lin = self.linears[name]
            w = torch.randn(lin.out_features, lin.in_features, generator=gen)
            lin.load(w / math.sqrt(lin.in_features))


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R] float32
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] row of each request's last token (None: T == R)


def rms(x: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(DTYPE)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: StepInputs) -> Tensor:
    size = SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    ctx = (inp.tables[:, :, None] * size + offsets).flatten(1)  # [T, CONTEXT]
    keys, values = k_cache[ctx].float(), v_cache[ctx].float()
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inp.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.float().view(-1, HEADS, HEAD_DIM), keys)
    scores = scores / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1).to(DTYPE)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def sample(logits: Tensor, inp: StepInputs) -> Tensor:
    positions = inp.positions if inp.last is None else inp.positions[inp.last]
    key = _mix(_mix(inp.seeds) ^ ((positions * 0x9E3779B1) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inp.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


class Int4Runner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        cache_dequant: bool,
        rebind: bool = False,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.cache_dequant = cache_dequant  # the bug switch
        self.device = torch.device("cuda", torch.cuda.current_device())
        with torch.inference_mode():
            self.model = Int4Decoder(seed, self.device)
            for lin in self.model.linears.values():
                lin.rebind_on_load = rebind
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.kv = [
                (
                    torch.zeros(shape, dtype=DTYPE, device=self.device),
                    torch.zeros(shape, dtype=DTYPE, device=self.device),
                )
                for _ in range(LAYERS)
            ]
            self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            self.fp16_weights: dict[str, Tensor] = {}  # bug only: dequantized at capture
            if mode == "graph":
                self.buffers = self._allocate(SPEC.capture_sizes[-1])
                self._capture()

    # -- forward ------------------------------------------------------------------------------

    def _linear(self, name: str, x: Tensor, graph: bool) -> Tensor:
        lin = self.model.linears[name]
        if not graph:
            return lin.forward_folded(x)
        if self.cache_dequant:
            return x @ self.fp16_weights[name].t()
        return lin.forward_dequant(x)

    def _forward(self, inp: StepInputs, graph: bool) -> tuple[Tensor, Tensor]:
        m = self.model
        x = m.embed[inp.tokens] + m.pos[inp.positions]
        for i, (k_cache, v_cache) in enumerate(self.kv):
            qkv = self._linear(f"qkv{i}", rms(x), graph)
            q, k, v = qkv.split(HIDDEN, dim=-1)
            k_cache.index_copy_(0, inp.slots, k.reshape(-1, HEADS, HEAD_DIM))
            v_cache.index_copy_(0, inp.slots, v.reshape(-1, HEADS, HEAD_DIM))
            x = x + self._linear(f"o{i}", attention(q, k_cache, v_cache, inp), graph)
            h = torch.nn.functional.silu(self._linear(f"up{i}", rms(x), graph))
            x = x + self._linear(f"down{i}", h, graph)
        if inp.last is not None:
            x = x[inp.last]
        logits = (rms(x) @ m.head).float()
        return logits, sample(logits, inp)

    # -- graph mode ---------------------------------------------------------------------------

    def _allocate(self, rows: int) -> dict[str, Tensor]:
        i64, dev = torch.int64, self.device
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=dev),
            "positions": torch.zeros(rows, dtype=i64, device=dev),
            "slots": torch.full((rows,), NULL_SLOT, dtype=i64, device=dev),
            "tables": torch.full(
                (rows, SPEC.max_blocks_per_req), SPEC.null_block, dtype=i64, device=dev
            ),
            "seeds": torch.zeros(rows, dtype=i64, device=dev),
            "temperatures": torch.ones(rows, dtype=torch.float32, device=dev),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
        }

    def _static(self, size: int) -> StepInputs:
        return StepInputs(**{k: v[:size] for k, v in self.buffers.items()})

    def _capture(self) -> None:
        if self.cache_dequant:
            # "Unpacking int4 in every replay is wasted work: dequantize once, GEMM on fp16."
            self.fp16_weights = {n: lin.dequantize() for n, lin in self.model.linears.items()}
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._prepare((), size)
            inp = self._static(size)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(inp, graph=True)  # warm-up
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(inp, graph=True)
            self.graphs[size] = graph

    def _prepare(self, requests: Sequence[Request], size: int) -> None:
        n = len(requests)
        rows = _decode_rows(requests)
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype, device=self.device))
            buf[n:size].fill_(_PADDING[name])

    def _replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self._prepare(batch.requests, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length > 1 (prefill, mixed or speculative)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    # -- contract -----------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            if reason is None:
                return self._replay(batch)
            if batch.num_reqs == 0:
                empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
                return StepResult(
                    empty,
                    torch.zeros(0, dtype=torch.int64, device=self.device),
                    "eager",
                    None,
                    reason=reason,
                )
            logits, tokens = self._forward(_eager_inputs(batch, self.device), graph=False)
            return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{kind}{i}": kv[j] for i, kv in enumerate(self.kv) for j, kind in enumerate("kv")}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load(seed)
            # BUG (buggy variant): self.fp16_weights, derived from the packed weights at capture,
            # is not refreshed here. The correct runner has no such cache.

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.fp16_weights.clear()


_PADDING: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    s = [_sampling(r) for r in requests]
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in requests],
        "tables": [_table(r) for r in requests],
        "seeds": [x[0] for x in s],
        "temperatures": [x[1] for x in s],
        "sampled": [x[2] for x in s],
    }


def _eager_inputs(batch: Batch, device: torch.device) -> StepInputs:
    tokens, positions, slots, tables, last = [], [], [], [], []
    for r in batch.requests:
        for i, tok in enumerate(r.tokens):
            p = r.context_len + i
            tokens.append(tok)
            positions.append(p)
            slots.append(kv_slot(r.block_ids, p, SPEC.block_size))
            tables.append(_table(r))
        last.append(len(tokens) - 1)
    s = [_sampling(r) for r in batch.requests]

    def t(v: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(v, dtype=dtype, device=device)

    return StepInputs(
        tokens=t(tokens),
        positions=t(positions),
        slots=t(slots),
        tables=t(tables).view(-1, SPEC.max_blocks_per_req),
        seeds=t([x[0] for x in s]),
        temperatures=t([x[1] for x in s], torch.float32),
        sampled=t([x[2] for x in s], torch.bool),
        last=t(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Int4Runner:
    return Int4Runner(mode, seed=seed, cache_dequant=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Int4Runner:
    return Int4Runner(mode, seed=seed, cache_dequant=True)


def make_buggy_target_rebind(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> Int4Runner:
    """Extra variant (not the module's main bug): `update_weights` rebinds the packed int4
    weight, scales and zeros to new tensors instead of copying into the captured ones (the
    pattern SGLang's `copy_or_rebind_param`, https://github.com/sgl-project/sglang/pull/18085,
    and vLLM's Marlin reload fix https://github.com/vllm-project/vllm/pull/48438 guard against)."""
    return Int4Runner(mode, seed=seed, cache_dequant=False, rebind=True)
