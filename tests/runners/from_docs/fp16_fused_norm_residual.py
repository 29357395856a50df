"""float16 decoder whose graph decode path fuses residual-add + RMSNorm (FlashInfer style).

What it is: a 4-layer float16 decoder (hidden 96, 4 heads of dim 24, FFN 192, vocab 320) over a
float16 slot-major paged KV cache, returning float16 logits. Both twins run the unfused eager
forward (Hugging Face style) for prefill, speculative decode and oversize batches: the residual
add in float16, then RMSNorm in float32 cast back to float16 before the float16 weight multiply,
separate Q/K/V and gate/up projections, `silu(gate) * up` in float16, plain attention with
float16 scores and float16 probabilities. The graph twin's one-token decode batches replay CUDA
graphs captured at start-up (largest size first, one pool) that compute the same model the way
a serving engine does (vLLM's model code over FlashInfer kernels):
- fused_add_rmsnorm: sum = float(x) + float(residual) in float32; the residual buffer is
  updated in place with float16(sum); the variance and the output use the float32 sum, times
  the float32 weight, one rounding at the end;
- fused QKV and fused gate/up GEMMs, silu_and_mul computed in float32;
- decode attention with float32 scores, softmax and accumulation (one rounding of the output).
Layer 0 has no residual yet; the graph path feeds the fused kernel a persistent max-shape
residual buffer that the graph zeroes first (so every layer runs the same fused kernel).

Bug (make_buggy_target): that persistent residual buffer is zeroed once, after warm-up and
capture, instead of inside the graph. The fused kernel writes residual = x + residual into it in
place, so the next replay's layer 0 starts row i from the residual stream left there by the
previous replay (whatever request held row i then, or a padding row), not from zeros. The eager
path allocates a fresh zero residual each forward and is right. Modelled on the class of
"in-place fused add-norm mutates an argument the caller treats as read-only" under CUDA graphs:
TensorRT-LLM PR #17083 (https://github.com/NVIDIA/TensorRT-LLM/pull/17083), where the piecewise
CUDA-graph compiler's inplace_map named the wrong argument of flashinfer_fused_add_add_rmsnorm
as the mutated one, so the residual's in-place mutation went untracked; and vLLM's persistent
max-shape graph input buffers (pipeline-parallel `intermediate_tensors` hidden_states/residual)
that the fused in-place norm mutates during replay. No public issue with exactly this
zero-once buffer was found.
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
    max_blocks_per_req=6,
    vocab_size=320,
    max_num_reqs=6,
    max_num_tokens=20,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS, FFN = 96, 4, 24, 4, 192
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
DT = torch.float16
EPS = 1e-6
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    tokens: Tensor
    positions: Tensor
    slots: Tensor
    tables: Tensor
    seeds: Tensor
    temperatures: Tensor
    sampled: Tensor
    last: Tensor | None = None


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes: dict[str, tuple[tuple[int, ...], float]] = {
            "embed": ((SPEC.vocab_size, HIDDEN), 1.0),
            "pos": ((CONTEXT, HIDDEN), 0.3),
            "head": ((HIDDEN, SPEC.vocab_size), 1.5 / math.sqrt(HIDDEN)),
            "norm_f": ((HIDDEN,), 0.0),
        }
        for i in range(LAYERS):
            for n in "qkv":
                shapes[f"{n}{i}"] = ((HIDDEN, HIDDEN), 1.0 / math.sqrt(HIDDEN))
            shapes[f"o{i}"] = ((HIDDEN, HIDDEN), 1.0 / math.sqrt(HIDDEN))
            shapes[f"gate{i}"] = ((HIDDEN, FFN), 1.0 / math.sqrt(HIDDEN))
            shapes[f"up{i}"] = ((HIDDEN, FFN), 1.0 / math.sqrt(HIDDEN))
            shapes[f"down{i}"] = ((FFN, HIDDEN), 1.0 / math.sqrt(FFN))
            shapes[f"norm_a{i}"] = ((HIDDEN,), 0.0)
            shapes[f"norm_m{i}"] = ((HIDDEN,), 0.0)
        self.scales = {n: s for n, (_, s) in shapes.items()}
        self.w = {n: torch.empty(s, device=device, dtype=DT) for n, (s, _) in shapes.items()}
        self.qkv = [torch.empty(HIDDEN, 3 * HIDDEN, device=device, dtype=DT) for _ in range(LAYERS)]
        self.gate_up = [
            torch.empty(HIDDEN, 2 * FFN, device=device, dtype=DT) for _ in range(LAYERS)
        ]
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            fresh = torch.randn(self.w[name].shape, generator=g)
            fresh = 1.0 + 0.1 * fresh if name.startswith("norm") else fresh * self.scales[name]
            self.w[name].copy_(fresh.to(self.w[name].device, DT))
        for i in range(LAYERS):  # fused copies, remade in place
            self.qkv[i].copy_(torch.cat([self.w[f"{n}{i}"] for n in "qkv"], dim=1))
            self.gate_up[i].copy_(torch.cat([self.w[f"gate{i}"], self.w[f"up{i}"]], dim=1))

    def embed(self, inputs: StepInputs) -> Tensor:
        return self.w["embed"][inputs.tokens] + self.w["pos"][inputs.positions]

    # -- eager, unfused (HF style) -----------------------------------------------------------

    def forward_eager(self, inputs: StepInputs, kv: list[tuple[Tensor, Tensor]]) -> Tensor:
        x = self.embed(inputs)
        for i, (kc, vc) in enumerate(kv):
            h = _rms_hf(x, self.w[f"norm_a{i}"])
            q, k, v = (h @ self.w[f"{n}{i}"] for n in "qkv")
            kc.index_copy_(0, inputs.slots, k.view(-1, HEADS, HEAD_DIM))
            vc.index_copy_(0, inputs.slots, v.view(-1, HEADS, HEAD_DIM))
            x = x + _attention_fp16(q, kc, vc, inputs) @ self.w[f"o{i}"]  # float16 add
            h = _rms_hf(x, self.w[f"norm_m{i}"])
            act = torch.nn.functional.silu(h @ self.w[f"gate{i}"]) * (h @ self.w[f"up{i}"])
            x = x + act @ self.w[f"down{i}"]
        if inputs.last is not None:
            x = x[inputs.last]
        return _rms_hf(x, self.w["norm_f"]) @ self.w["head"]

    # -- graph decode path: fused add + RMSNorm, fused projections ---------------------------

    def forward_fused(
        self, inputs: StepInputs, kv: list[tuple[Tensor, Tensor]], residual: Tensor
    ) -> Tensor:
        """`residual` is zero on entry (the caller's persistent buffer): layer 0's add is a no-op."""
        x = self.embed(inputs)
        for i, (kc, vc) in enumerate(kv):
            h = _fused_add_rmsnorm(x, residual, self.w[f"norm_a{i}"])  # residual += x, in place
            q, k, v = (h @ self.qkv[i]).split(HIDDEN, dim=-1)
            kc.index_copy_(0, inputs.slots, k.reshape(-1, HEADS, HEAD_DIM))
            vc.index_copy_(0, inputs.slots, v.reshape(-1, HEADS, HEAD_DIM))
            x = _attention_fp32(q, kc, vc, inputs) @ self.w[f"o{i}"]
            h = _fused_add_rmsnorm(x, residual, self.w[f"norm_m{i}"])
            gate, up = (h @ self.gate_up[i]).split(FFN, dim=-1)
            x = (torch.nn.functional.silu(gate.float()) * up.float()).to(DT) @ self.w[f"down{i}"]
        return _fused_add_rmsnorm(x, residual, self.w["norm_f"]) @ self.w["head"]


def _rms_hf(x: Tensor, w: Tensor) -> Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(DT)


def _fused_add_rmsnorm(x: Tensor, residual: Tensor, w: Tensor) -> Tensor:
    s = x.float() + residual.float()
    residual.copy_(s.to(DT))
    return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(DT)


def _gather(cache: Tensor, tables: Tensor) -> Tensor:
    offsets = torch.arange(SPEC.block_size, device=tables.device)
    return cache[(tables[:, :, None] * SPEC.block_size + offsets).flatten(1)]


def _visible(inputs: StepInputs, device: torch.device) -> Tensor:
    return torch.arange(CONTEXT, device=device)[None, :] <= inputs.positions[:, None]


def _attention_fp16(q: Tensor, kc: Tensor, vc: Tensor, inputs: StepInputs) -> Tensor:
    keys, values = _gather(kc, inputs.tables), _gather(vc, inputs.tables)
    visible = _visible(inputs, q.device)
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) * HEAD_DIM**-0.5
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1, dtype=torch.float32)
    values = torch.where(
        visible[:, :, None, None], values, torch.zeros((), dtype=DT, device=q.device)
    )
    return torch.einsum("thc,tchd->thd", probs.to(DT), values).reshape(-1, HIDDEN)


def _attention_fp32(q: Tensor, kc: Tensor, vc: Tensor, inputs: StepInputs) -> Tensor:
    keys, values = _gather(kc, inputs.tables).float(), _gather(vc, inputs.tables).float()
    visible = _visible(inputs, q.device)
    qf = q.reshape(-1, HEADS, HEAD_DIM).float()
    scores = torch.einsum("thd,tchd->thc", qf, keys) * HEAD_DIM**-0.5
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).to(DT).reshape(-1, HIDDEN)


def sample(
    logits: Tensor, positions: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor
) -> Tensor:
    key = _mix(_mix(seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits.float() / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class FusedNormRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, zero_once: bool = False) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.zero_once = zero_once
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        with torch.inference_mode():
            self.model = Model(seed, device)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.kv = [
                (
                    torch.zeros(shape, device=device, dtype=DT),
                    torch.zeros(shape, device=device, dtype=DT),
                )
                for _ in range(LAYERS)
            ]
            if mode == "graph":
                rows, i64 = SPEC.capture_sizes[-1], torch.int64
                self.buffers = {
                    "tokens": torch.zeros(rows, dtype=i64, device=device),
                    "positions": torch.zeros(rows, dtype=i64, device=device),
                    "slots": torch.zeros(rows, dtype=i64, device=device),
                    "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=device),
                    "seeds": torch.zeros(rows, dtype=i64, device=device),
                    "temperatures": torch.ones(rows, device=device),
                    "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
                }
                # the fused kernel's residual stream, persistent at max shape
                self.residual = torch.zeros(rows, HIDDEN, dtype=DT, device=device)
                self.capture()

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{n: b[:size] for n, b in self.buffers.items()})

    def fused_model(self, size: int) -> tuple[Tensor, Tensor]:
        inputs = self.static_inputs(size)
        residual = self.residual[:size]
        if not self.zero_once:
            residual.zero_()  # part of the graph: every replay starts layer 0 from zeros
        logits = self.model.forward_fused(inputs, self.kv, residual)
        return logits, sample(
            logits, inputs.positions, inputs.seeds, inputs.temperatures, inputs.sampled
        )

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            self.fused_model(size)  # warm-up
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.fused_model(size)
            self.graphs[size] = graph
        if self.zero_once:  # BUG: "initialise the static residual once", after warm-up dirtied it
            self.residual.zero_()

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        for name, values in _decode_rows(batch.requests).items():
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

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        inputs = _eager_inputs(batch, self.backend.device)
        logits = self.model.forward_eager(inputs, self.kv)
        pos = inputs.positions[inputs.last]
        tokens = sample(logits, pos, inputs.seeds, inputs.temperatures, inputs.sampled)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(len(r.tokens) != 1 or r.context_len == 0 for r in batch.requests):
            return "not a one-token decode batch"
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


_PADDING: dict[str, float | int | bool] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


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
    }


def _eager_inputs(batch: Batch, device: torch.device) -> StepInputs:
    tokens, positions, slots, tables, last = [], [], [], [], []
    for r in batch.requests:
        for i, t in enumerate(r.tokens):
            tokens.append(t)
            positions.append(r.context_len + i)
            slots.append(_slot(r, r.context_len + i))
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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> FusedNormRunner:
    return FusedNormRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> FusedNormRunner:
    return FusedNormRunner(mode, seed=seed, backend=backend, zero_once=True)
