"""fp8_scaled_linear: a paged-KV decode runner whose linear layers run in float8, as on Hopper.

Model: a two-layer bfloat16 decoder (token + learned position embeddings, attention over a
slot-major paged KV cache read through block tables, a gated SiLU MLP, a bfloat16 LM head).
Every projection (fused QKV, output, fused gate/up, down) is a float8 linear:

- weights are kept as `torch.float8_e4m3fn` `[out, in]` (row-major) with float32 scales: one per
  tensor for QKV and the output projection, one per output channel (row-wise) for the MLP;
- activations are quantized at every call with a dynamic per-tensor scale computed on the device
  (amax of the activation / 448), never read on the host;
- the product is `torch._scaled_mm(x_fp8, w_fp8.t(), scale_a, scale_b, out_dtype=bfloat16)`:
  the first matrix row-major, the second column-major (the transpose of a row-major `[out, in]`
  weight), inner size and both sizes of the second matrix multiples of 16. Row counts are the
  batch's (graph buckets 1, 2, 4, 8), which cuBLASLt accepts.

Graph mode captures one decode graph per bucket (largest first, one shared pool) through the
backend facade; everything else (prefill, mixed, speculative, too many requests) runs eagerly.
`update_weights` requantizes into the same float8 weight and scale tensors (`copy_`), so the
captured graphs read the new weights.

Dynamic per-tensor scaling makes a request's logits depend on its batch (the scale is the amax of
the whole batch), so the spec says `batch_invariant=False`. A padded graph must still compute what
the unpadded eager step computes: the amax that sets the per-tensor activation scale is taken over
the valid rows only (a device-side row mask, a static input rewritten at every replay).

BUG (make_buggy_target): on the graph path the activation amax is taken over the whole padded
tensor, padding rows included, so the scale of a padded replay depends on what the padding rows
compute and differs from the eager step's. The eager path has no padding rows and stays correct.
Modelled on flashinfer-ai/flashinfer#3057 ("NaNs in CUDA Graph padded regions corrupt (unpadded)
scales in nvfp4 quant functions": the scale computation reads padding rows of a CUDA-graph batch;
vllm-project/vllm#39743 is the engine-side workaround), and more generally on dynamic per-tensor
FP8 quantization kernels whose amax reduction runs over the padded token count of a graph bucket
(e.g. NVIDIA/TensorRT-LLM#16569 describes the per-tensor dynamic amax over the whole input).
No engine code was copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    batch_invariant=False,  # dynamic per-tensor activation scales: the amax of the whole batch
)
HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS = 64, 2, 32, 128, 2
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BF16 = torch.bfloat16
_MASK32 = 0xFFFFFFFF


def quantize_activation(x: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    """Dynamic per-tensor float8 quantization on the device. `valid` [rows] bool masks padding
    rows out of the amax (None: every row is valid)."""
    xf = x.float()
    mag = xf.abs()
    if valid is not None:
        mag = torch.where(valid[:, None], mag, torch.zeros((), device=x.device))
    scale = (mag.amax() / FP8_MAX).clamp(min=1e-12)  # 0-dim float32 on the device
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear:
    """`[out, in]` float8 weight with a per-tensor or per-output-channel float32 scale."""

    def __init__(self, out_features: int, in_features: int, per_channel: bool, device: Any):
        assert out_features % 16 == 0 and in_features % 16 == 0
        self.per_channel = per_channel
        self.weight = torch.empty(out_features, in_features, dtype=FP8, device=device)
        shape = (1, out_features) if per_channel else ()
        self.scale = torch.empty(shape, dtype=torch.float32, device=device)

    def load(self, w: Tensor) -> None:
        """Quantize `w` (float32 [out, in], on the device) into the same tensors."""
        if self.per_channel:
            scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [out, 1]
            self.weight.copy_((w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8))
            self.scale.copy_(scale.t())
        else:
            scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
            self.weight.copy_((w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8))
            self.scale.copy_(scale)

    def __call__(self, x: Tensor, valid: Tensor | None) -> Tensor:
        x_fp8, x_scale = quantize_activation(x, valid)
        if self.per_channel:  # row-wise scaling: scale_a [M, 1], scale_b [1, N]
            scale_a = x_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
        else:
            scale_a = x_scale
        return torch._scaled_mm(
            x_fp8, self.weight.t(), scale_a=scale_a, scale_b=self.scale, out_dtype=BF16
        )


class Fp8Decoder:
    def __init__(self, seed: int, device: Any) -> None:
        self.device = device
        self.embed = torch.empty(SPEC.vocab_size, HIDDEN, dtype=BF16, device=device)
        self.pos = torch.empty(CONTEXT, HIDDEN, dtype=BF16, device=device)
        self.head = torch.empty(HIDDEN, SPEC.vocab_size, dtype=BF16, device=device)
        self.layers = [
            {
                "qkv": Fp8Linear(3 * HIDDEN, HIDDEN, False, device),
                "o": Fp8Linear(HIDDEN, HIDDEN, False, device),
                "gate_up": Fp8Linear(2 * FFN, HIDDEN, True, device),
                "down": Fp8Linear(HIDDEN, FFN, True, device),
            }
            for _ in range(LAYERS)
        ]
        self.load(seed)

    def load(self, seed: int) -> None:
        """(Re)load and requantize in place: the graphs keep reading the same tensors."""
        g = torch.Generator().manual_seed(seed)

        def randn(*shape: int) -> Tensor:
            return (torch.randn(shape, generator=g) / math.sqrt(shape[-1])).to(self.device)

        self.embed.copy_(randn(SPEC.vocab_size, HIDDEN) * math.sqrt(HIDDEN))
        self.pos.copy_(randn(CONTEXT, HIDDEN) * math.sqrt(HIDDEN) * 0.5)
        self.head.copy_(randn(HIDDEN, SPEC.vocab_size) * 4.0)
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                lin = layer[name]
                lin.load(randn(*lin.weight.shape))

    def forward(
        self, inp: dict[str, Tensor], kv: list[tuple[Tensor, Tensor]], valid: Tensor | None
    ) -> Tensor:
        x = self.embed[inp["tokens"]] + self.pos[inp["positions"]]  # [T, hidden] bf16
        for layer, (k_cache, v_cache) in zip(self.layers, kv, strict=True):
            qkv = layer["qkv"](_rms(x), valid)
            q, k, v = qkv.split(HIDDEN, dim=-1)
            k_cache.index_copy_(0, inp["slots"], k.reshape(-1, HEADS, HEAD_DIM))
            v_cache.index_copy_(0, inp["slots"], v.reshape(-1, HEADS, HEAD_DIM))
            x = x + layer["o"](_attention(q, k_cache, v_cache, inp), valid)
            gate, up = layer["gate_up"](_rms(x), valid).chunk(2, dim=-1)
            x = x + layer["down"](torch.nn.functional.silu(gate) * up, valid)
        if "last" in inp:
            x = x[inp["last"]]
        return (_rms(x) @ self.head).float()  # bfloat16 products, upcast logits


def _rms(x: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16)


def _attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: dict[str, Tensor]) -> Tensor:
    size = SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    context = (inp["tables"][:, :, None] * size + offsets).flatten(1)  # [T, CONTEXT]
    keys, values = k_cache[context].float(), v_cache[context].float()
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inp["positions"][:, None]
    scores = torch.einsum("thd,tchd->thc", q.float().view(-1, HEADS, HEAD_DIM), keys)
    scores = scores / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1).to(BF16)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def sample(
    logits: Tensor, seeds: Tensor, positions: Tensor, temps: Tensor, sampled: Tensor
) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id)."""
    key = _mix(_mix(seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


_PADDING: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
    "valid": False,
}


class Fp8Runner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        mask_padding_in_scale: bool = True,
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.mask_padding = mask_padding_in_scale
        self.backend: Any = get_backend(backend)
        dev = self.backend.device
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        with torch.inference_mode():
            self.model = Fp8Decoder(seed, dev)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.kv = [
                (
                    torch.zeros(shape, dtype=BF16, device=dev),
                    torch.zeros(shape, dtype=BF16, device=dev),
                )
                for _ in range(LAYERS)
            ]
            if mode == "graph":
                rows, i64 = SPEC.capture_sizes[-1], torch.int64
                self.buffers = {
                    "tokens": torch.zeros(rows, dtype=i64, device=dev),
                    "positions": torch.zeros(rows, dtype=i64, device=dev),
                    "slots": torch.zeros(rows, dtype=i64, device=dev),
                    "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                    "seeds": torch.zeros(rows, dtype=i64, device=dev),
                    "temperatures": torch.ones(rows, device=dev),
                    "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
                    "valid": torch.zeros(rows, dtype=torch.bool, device=dev),
                }
                self.capture()

    # -- graph path ------------------------------------------------------------------------------
    def _graph_forward(self, size: int) -> tuple[Tensor, Tensor]:
        inp = {name: buf[:size] for name, buf in self.buffers.items()}
        valid = inp["valid"] if self.mask_padding else None  # BUG when False: padding in amax
        logits = self.model.forward(inp, self.kv, valid)
        tokens = sample(logits, inp["seeds"], inp["positions"], inp["temperatures"], inp["sampled"])
        return logits, tokens

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            self._graph_forward(size)  # warm-up
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self._graph_forward(size)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = _decode_rows(batch.requests)
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[n:size].fill_(_PADDING[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager path ------------------------------------------------------------------------------
    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.backend.device
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=dev)
            return StepResult(
                empty, torch.zeros(0, dtype=torch.int64, device=dev), "eager", None, reason
            )
        tokens, positions, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                tokens.append(t)
                positions.append(r.context_len + i)
                slots.append(_slot(r, r.context_len + i))
                tables.append(_table(r))
            last.append(len(tokens) - 1)

        def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        inp = {
            "tokens": t(tokens),
            "positions": t(positions),
            "slots": t(slots),
            "tables": t(tables).view(-1, SPEC.max_blocks_per_req),
            "last": t(last),
        }
        logits = self.model.forward(inp, self.kv, None)  # no padding rows: every row valid
        s = [_sampling(r) for r in batch.requests]
        next_tokens = sample(
            logits,
            t([x[0] for x in s]),
            inp["positions"][inp["last"]],
            t([x[1] for x in s], torch.float32),
            t([x[2] for x in s], torch.bool),
        )
        return StepResult(logits, next_tokens, "eager", None, reason=reason)

    # -- contract --------------------------------------------------------------------------------
    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length > 1 (prefill, mixed or speculative)"
        if any(r.context_len == 0 for r in batch.requests):
            return "prefill of a one-token prompt"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{kind}{i}": kv[j] for i, kv in enumerate(self.kv) for j, kind in enumerate("kv")}

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


def _slot(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & _MASK32, r.temperature, True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    s = [_sampling(r) for r in requests]
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_slot(r, r.context_len) for r in requests],
        "tables": [_table(r) for r in requests],
        "seeds": [x[0] for x in s],
        "temperatures": [x[1] for x in s],
        "sampled": [x[2] for x in s],
        "valid": [True for _ in requests],
    }


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Fp8Runner:
    return Fp8Runner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Fp8Runner:
    return Fp8Runner(mode, seed=seed, backend=backend, mask_padding_in_scale=False)
