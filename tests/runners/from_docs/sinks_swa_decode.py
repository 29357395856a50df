"""gpt-oss-style decode runner: learned attention sinks + alternating sliding-window / full layers.

What it is
----------
A two-layer bfloat16 decoder in the shape of gpt-oss: RoPE, grouped-query attention (4 query heads
over 2 KV heads), a SwiGLU MLP, RMSNorm. Even layers attend over a sliding window of the last
`WINDOW` positions, odd layers over the whole context. Every attention head has one learned
"sink" logit that joins the softmax denominator and nothing else (softmax over [scores, sink],
the sink's column dropped), so a head may attend to "nothing". The KV cache is slot-major and paged
(`[num_blocks * block_size, kv_heads, head_dim]`, read through block tables).

Graph mode captures one decode graph per capture size at start-up (largest first, one pool). The
graph path and the eager path use different attention code on purpose, as engines do:

* graph (decode, one query token per row): a fixed-shape masked computation over the padded
  maximum context: every row gathers all `max_blocks_per_req * block_size` slots of its block
  table; the window start (`position - WINDOW + 1`) is computed on the device from the position
  buffer; the sinks are read from a float32, contiguous per-layer copy that the "attention
  backend" builds once when it is bound to the model at capture (as kernels that want float32
  sinks do);
* eager (prefill, mixed, speculative decode, oversize batches, and the eager twin): per-request
  exact slicing on the host: the slot list of exactly the positions a request's queries can see
  (window start clipped on the host), and the sinks read straight from the bfloat16 parameter.

Weight updates (`update_weights`) copy new values into the parameters in place and refresh every
tensor made from them that a graph reads, i.e. the float32 sink copies.

The bug (`make_buggy_target`)
-----------------------------
The float32 sink copy built for the graph path is never refreshed after a weight update: the
parameters get the new weights in place (so every other weight the graph reads is current), but
the captured graphs keep reading the sinks of the checkpoint they were captured with. Eager
steps read the parameter and are right; replays silently use stale sinks.

Modelled on SGLang PR #29916 "Fix stale _attn_sink_local cache after RL weight updates"
(https://github.com/sgl-project/sglang/pull/29916): DeepSeek-V4's attention layer lazily built a
padded copy of the `attn_sink` parameter that was never invalidated, so after
`update_weights_*` the attention kernels kept reading the step-0 sinks; the fix refreshes the copy
with an in-place `copy_` "because the tensor address is captured by CUDA graphs". The same class
in vLLM: RFC/PR #57795 and PR #57805 (https://github.com/vllm-project/vllm/pull/57795,
https://github.com/vllm-project/vllm/pull/57805), "a live weight update leaves the kernel tensor
that the attention backend reads at its old value" for GPT-OSS sinks. No engine code is copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2
GROUP = Q_HEADS // KV_HEADS
WINDOW = 6  # sliding layers see positions p - WINDOW + 1 .. p (not block aligned on purpose)
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
DTYPE = torch.bfloat16
SCALE = 1.0 / math.sqrt(HEAD_DIM)
_MASK32 = 0xFFFFFFFF


def sliding(layer: int) -> bool:
    return layer % 2 == 0  # gpt-oss alternates: sliding, full, sliding, full, ...


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    tables: Tensor | None = None  # [T, max_blocks_per_req]  (graph path)
    last: Tensor | None = None  # [R] (eager path; None: one token per row)
    plan: list[tuple[int, int, int, tuple[int, ...]]] | None = None  # eager: (t0, n, ctx, blocks)


class SinkDecoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            "norm_f": (HIDDEN,),
        }
        for i in range(LAYERS):
            shapes[f"qkv{i}"] = (HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
            shapes[f"o{i}"] = (Q_HEADS * HEAD_DIM, HIDDEN)
            shapes[f"gate_up{i}"] = (HIDDEN, 2 * FFN)
            shapes[f"down{i}"] = (FFN, HIDDEN)
            shapes[f"norm_attn{i}"] = (HIDDEN,)
            shapes[f"norm_mlp{i}"] = (HIDDEN,)
            shapes[f"sinks{i}"] = (Q_HEADS,)
        self.weights = {n: torch.empty(s, device=device, dtype=DTYPE) for n, s in shapes.items()}
        half = torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM
        self.inv_freq = (1.0 / (10000.0**half)).to(device)  # fixed at construction
        self.load(seed)

    def load(self, seed: int) -> None:
        """(Re)initialise in place, so the captured graphs read the new values."""
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            w = self.weights[name]
            noise = torch.randn(w.shape, generator=gen)
            if name.startswith("sinks"):
                fresh = 2.0 * noise + 1.0  # gpt-oss sinks are O(1) logits, per head
            elif name.startswith("norm"):
                fresh = 1.0 + 0.1 * noise
            elif name == "embed":
                fresh = noise
            else:
                fresh = noise / math.sqrt(w.shape[0])
            w.copy_(fresh.to(device=self.device, dtype=DTYPE))

    def forward(self, inputs: StepInputs, kv: list[tuple[Tensor, Tensor]], attend: Any) -> Tensor:
        w = self.weights
        x = w["embed"][inputs.tokens]  # [T, hidden] bf16
        for i, (k_cache, v_cache) in enumerate(kv):
            h = _rms(x, w[f"norm_attn{i}"])
            q, k, v = (h @ w[f"qkv{i}"]).split(
                [Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1
            )
            q = self.rope(q.reshape(-1, Q_HEADS, HEAD_DIM), inputs.positions)
            k = self.rope(k.reshape(-1, KV_HEADS, HEAD_DIM), inputs.positions)
            k_cache.index_copy_(0, inputs.slots, k)
            v_cache.index_copy_(0, inputs.slots, v.reshape(-1, KV_HEADS, HEAD_DIM))
            x = x + attend(i, q, k_cache, v_cache, inputs) @ w[f"o{i}"]
            gate, up = (_rms(x, w[f"norm_mlp{i}"]) @ w[f"gate_up{i}"]).chunk(2, -1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w[f"down{i}"]
        if inputs.last is not None:
            x = x[inputs.last]
        return (_rms(x, w["norm_f"]) @ w["head"]).float()  # [R, vocab]

    def rope(self, x: Tensor, positions: Tensor) -> Tensor:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(DTYPE)


def _rms(x: Tensor, weight: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(DTYPE)


def _sink_softmax(scores: Tensor, sinks: Tensor) -> Tensor:
    """softmax over [scores..., sink] with the sink's column dropped. scores [..., H, L] float32
    (masked entries -inf), sinks [H] float32."""
    sink = sinks.view(*([1] * (scores.dim() - 2)), -1)  # broadcast over leading dims
    m = torch.maximum(scores.amax(-1), sink)
    e = torch.exp(scores - m[..., None])
    return e / (e.sum(-1) + torch.exp(sink - m))[..., None]


class GraphAttention:
    """Fixed-shape decode attention over the padded max context; float32 sink copies."""

    def __init__(self, model: SinkDecoder) -> None:
        self.model = model
        self.sinks_f32: list[Tensor] = []

    def bind(self) -> None:
        """Called once before capture: the float32 contiguous sinks the kernel reads."""
        w = self.model.weights
        self.sinks_f32 = [w[f"sinks{i}"].float().contiguous() for i in range(LAYERS)]

    def refresh(self) -> None:
        """After a weight update: same tensors (the graphs hold their addresses), new values."""
        w = self.model.weights
        for i, copy in enumerate(self.sinks_f32):
            copy.copy_(w[f"sinks{i}"].float())

    def __call__(
        self, i: int, q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: StepInputs
    ) -> Tensor:
        assert inp.tables is not None
        t, dev = q.shape[0], q.device
        offsets = torch.arange(SPEC.block_size, device=dev)
        ctx = (inp.tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT]
        cpos = torch.arange(CONTEXT, device=dev)[None, :]
        pos = inp.positions[:, None]
        visible = cpos <= pos
        if sliding(i):
            visible = visible & (cpos > pos - WINDOW)  # window start on the device, per row
        keys = k_cache[ctx].float()  # [T, C, KVH, D]
        qg = q.float().view(t, KV_HEADS, GROUP, HEAD_DIM)
        scores = torch.einsum("tkgd,tckd->tkgc", qg, keys).reshape(t, Q_HEADS, CONTEXT) * SCALE
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = _sink_softmax(scores, self.sinks_f32[i])
        values = torch.where(
            visible[:, :, None, None], v_cache[ctx], torch.zeros((), device=dev, dtype=DTYPE)
        )
        out = torch.einsum(
            "tkgc,tckd->tkgd", probs.view(t, KV_HEADS, GROUP, CONTEXT), values.float()
        )
        return out.reshape(t, Q_HEADS * HEAD_DIM).to(DTYPE)


class EagerAttention:
    """Per-request exact slicing; sinks straight from the bf16 parameter."""

    def __init__(self, model: SinkDecoder) -> None:
        self.model = model

    def __call__(
        self, i: int, q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: StepInputs
    ) -> Tensor:
        assert inp.plan is not None
        dev = q.device
        sinks = self.model.weights[f"sinks{i}"].float()
        outs = []
        for t0, n, ctx_len, blocks in inp.plan:
            hi = ctx_len + n
            lo = max(0, ctx_len - WINDOW + 1) if sliding(i) else 0
            slots = torch.tensor(
                [kv_slot(blocks, p, SPEC.block_size) for p in range(lo, hi)], device=dev
            )
            qpos = torch.arange(ctx_len, hi, device=dev)[:, None]
            kpos = torch.arange(lo, hi, device=dev)[None, :]
            visible = kpos <= qpos
            if sliding(i):
                visible = visible & (kpos > qpos - WINDOW)
            qg = q[t0 : t0 + n].float().view(n, KV_HEADS, GROUP, HEAD_DIM)
            keys, values = k_cache[slots].float(), v_cache[slots].float()  # [L, KVH, D]
            scores = torch.einsum("qkgd,lkd->qkgl", qg, keys).reshape(n, Q_HEADS, hi - lo) * SCALE
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            probs = _sink_softmax(scores, sinks).view(n, KV_HEADS, GROUP, hi - lo)
            outs.append(
                torch.einsum("qkgl,lkd->qkgd", probs, values).reshape(n, Q_HEADS * HEAD_DIM)
            )
        return torch.cat(outs).to(DTYPE)


def sample(logits: Tensor, positions: Tensor, inp: StepInputs) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): batch- and bucket-free."""
    key = _mix(_mix(inp.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inp.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & _MASK32, float(r.temperature), True


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


_PADDING: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


class SinksSwaRunner:
    refresh_sinks_on_update = True  # the buggy variant turns this off

    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec, self.mode = SPEC, mode
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        with torch.inference_mode():
            self.model = SinkDecoder(seed, device)
            shape = (SPEC.num_slots, KV_HEADS, HEAD_DIM)
            self.kv = [
                (
                    torch.zeros(shape, device=device, dtype=DTYPE),
                    torch.zeros(shape, device=device, dtype=DTYPE),
                )
                for _ in range(LAYERS)
            ]
            self.graph_attn = GraphAttention(self.model)
            self.eager_attn = EagerAttention(self.model)
            self.graphs: dict[int, Any] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            if mode == "graph":
                self.buffers = self.allocate_buffers(SPEC.capture_sizes[-1])
                self.capture()

    # -- graph path --------------------------------------------------------------------------------
    def allocate_buffers(self, rows: int) -> dict[str, Tensor]:
        dev, i64 = self.backend.device, torch.int64
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=dev),
            "positions": torch.zeros(rows, dtype=i64, device=dev),
            "slots": torch.zeros(rows, dtype=i64, device=dev),
            "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
            "seeds": torch.zeros(rows, dtype=i64, device=dev),
            "temperatures": torch.ones(rows, device=dev),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
        }

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{name: buf[:size] for name, buf in self.buffers.items()})

    def run_graph_model(self, inp: StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, self.kv, self.graph_attn)
        return logits, sample(logits, inp.positions, inp)

    def capture(self) -> None:
        self.graph_attn.bind()
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inp = self.static_inputs(size)
            self.run_graph_model(inp)  # warm-up
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_graph_model(inp)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        reqs, n = batch.requests, batch.num_reqs
        samp = [_sampling(r) for r in reqs]
        rows: dict[str, list[Any]] = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temperatures": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
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

    # -- eager path --------------------------------------------------------------------------------
    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.backend.device
        tokens, positions, slots, last, plan = [], [], [], [], []
        for r in batch.requests:
            plan.append((len(tokens), r.query_len, r.context_len, tuple(r.block_ids)))
            for j, tok in enumerate(r.tokens):
                tokens.append(tok)
                positions.append(r.context_len + j)
                slots.append(kv_slot(r.block_ids, r.context_len + j, SPEC.block_size))
            last.append(len(tokens) - 1)
        samp = [_sampling(r) for r in batch.requests]

        def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        inp = StepInputs(
            tokens=t(tokens),
            positions=t(positions),
            slots=t(slots),
            seeds=t([s[0] for s in samp]),
            temperatures=t([s[1] for s in samp], torch.float32),
            sampled=t([s[2] for s in samp], torch.bool),
            last=t(last),
            plan=plan,
        )
        logits = self.model.forward(inp, self.kv, self.eager_attn)
        next_tokens = sample(logits, inp.positions[inp.last], inp)
        return StepResult(logits, next_tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.query_len != 1 for r in batch.requests):
            return "query length > 1 (prefill, mixed or speculative)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    # -- contract ----------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            if batch.num_reqs == 0:
                empty = torch.zeros(0, SPEC.vocab_size, device=self.backend.device)
                return StepResult(
                    empty,
                    torch.zeros(0, dtype=torch.int64, device=self.backend.device),
                    "eager",
                    None,
                    "empty batch",
                )
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
            if self.mode == "graph" and self.refresh_sinks_on_update:
                self.graph_attn.refresh()

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


class StaleSinksRunner(SinksSwaRunner):
    """The bug: the graph path's float32 sink copy is not refreshed after a weight update."""

    refresh_sinks_on_update = False


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SinksSwaRunner:
    return SinksSwaRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SinksSwaRunner:
    return StaleSinksRunner(mode, seed=seed, backend=backend)
