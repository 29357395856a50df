"""bfloat16 decoder whose graph decode path uses flash-decoding (split-KV) attention.

What it is: a 2-layer bfloat16 decoder (hidden 64, 4 heads of dim 16, vocab 384) over a
bfloat16 slot-major paged KV cache. Both twins run one plain eager forward for prefill,
speculative decode and batches above the largest capture size: separate Q/K/V projections and
plain attention (bfloat16 scores, float32 softmax rounded to bfloat16 probabilities, bfloat16
probs @ values), as an unfused reference implementation does. The graph twin's decode steps
replay CUDA graphs that compute the same mathematics the way a serving engine does: a fused QKV
projection (one [H, 3H] GEMM) and flash-decoding attention: the context is cut into fixed-size
chunks (SPLIT positions); each chunk computes, in float32, its softmax-weighted partial output
(stored in bfloat16, as vLLM's paged_attention_v2 keeps `tmp_out` in the model dtype) and its
log-sum-exp (float32); the partials are then merged by LSE. Chunks past a row's context are
empty (LSE -inf, weight 0). Logits come out of a bfloat16 LM head and are upcast to float32.

Graphs are captured lazily: the first decode batch that needs a capture size captures it
(warm-up, capture, replay), one shared pool. The correct runner sizes the split grid from the
largest possible context (max_blocks_per_req * block_size), a static bound.

Bug (make_buggy_target): the number of splits is computed on the host from the capture batch's
longest sequence (ceil(max seq_len / SPLIT)) and baked into the captured graph (the kernel grid
and the merge loop bound are launch parameters). A graph captured on short contexts then replays
longer ones with their tail splits dropped: the merge never sees the newest tokens. Public
sources of this bug class:
- vLLM PR #53384 (https://github.com/vllm-project/vllm/pull/53384): "The partition grid must not
  be sized from the runtime max_seq_len ... a grid derived from it is captured at ~1 partition
  and then silently truncates the tail of every long sequence".
- PaddlePaddle/FastDeploy PR #3223 (https://github.com/PaddlePaddle/FastDeploy/pull/3223):
  num_chunks computed from the batch's longest seq_len was frozen at capture; graphs captured
  with few chunks replayed requests needing more and decoded <unk>; fixed by sizing from
  max_model_len.
- vLLM PR #51119 (https://github.com/vllm-project/vllm/pull/51119): AITER MLA's host-side split
  selection run once at FULL graph capture with dummy metadata specialises the graph to the
  one-split path (there a performance issue, since that kernel still covers the whole context).
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
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=384,
    max_num_reqs=6,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS, FFN = 64, 4, 16, 2, 128
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size  # 32 positions
SPLIT = 8  # positions per flash-decoding chunk (two blocks)
MAX_SPLITS = CONTEXT // SPLIT
NULL_SLOT = SPEC.null_block * SPEC.block_size
DT = torch.bfloat16
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] last token of each request (None: decode, T == R)


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes: dict[str, tuple[tuple[int, ...], float]] = {
            "embed": ((SPEC.vocab_size, HIDDEN), 1.0),
            "pos": ((CONTEXT, HIDDEN), 0.5),
            "head": ((HIDDEN, SPEC.vocab_size), 2.0 / math.sqrt(HIDDEN)),  # a hotter LM head
            "norm_f": ((HIDDEN,), 0.0),
        }
        for i in range(LAYERS):
            for n in "qkvo":
                shapes[f"{n}{i}"] = ((HIDDEN, HIDDEN), 1.0 / math.sqrt(HIDDEN))
            shapes[f"up{i}"] = ((HIDDEN, 2 * FFN), 1.0 / math.sqrt(HIDDEN))
            shapes[f"down{i}"] = ((FFN, HIDDEN), 1.0 / math.sqrt(FFN))
            shapes[f"norm_a{i}"] = ((HIDDEN,), 0.0)
            shapes[f"norm_m{i}"] = ((HIDDEN,), 0.0)
        self.scales = {n: s for n, (_, s) in shapes.items()}
        self.w = {
            n: torch.empty(shape, device=device, dtype=DT) for n, (shape, _) in shapes.items()
        }
        # fused copies the graph path reads (remade in place by load)
        self.qkv = [torch.empty(HIDDEN, 3 * HIDDEN, device=device, dtype=DT) for _ in range(LAYERS)]
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            fresh = torch.randn(t.shape, generator=g)
            fresh = 1.0 + 0.1 * fresh if name.startswith("norm") else fresh * self.scales[name]
            t.copy_(fresh.to(t.device, DT))
        for i in range(LAYERS):
            self.qkv[i].copy_(torch.cat([self.w[f"{n}{i}"] for n in "qkv"], dim=1))

    # -- shared pieces -----------------------------------------------------------------------

    def embed(self, inputs: StepInputs) -> Tensor:
        return self.w["embed"][inputs.tokens] + self.w["pos"][inputs.positions]

    def mlp(self, x: Tensor, i: int) -> Tensor:
        gate, up = (_rms(x, self.w[f"norm_m{i}"]) @ self.w[f"up{i}"]).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ self.w[f"down{i}"]

    def head(self, x: Tensor) -> Tensor:
        return (_rms(x, self.w["norm_f"]) @ self.w["head"]).float()

    # -- eager reference: separate projections, plain attention ------------------------------

    def forward_eager(self, inputs: StepInputs, kv: list[tuple[Tensor, Tensor]]) -> Tensor:
        x = self.embed(inputs)
        for i, (kc, vc) in enumerate(kv):
            h = _rms(x, self.w[f"norm_a{i}"])
            q, k, v = (h @ self.w[f"{n}{i}"] for n in "qkv")
            kc.index_copy_(0, inputs.slots, k.view(-1, HEADS, HEAD_DIM))
            vc.index_copy_(0, inputs.slots, v.view(-1, HEADS, HEAD_DIM))
            x = x + _plain_attention(q, kc, vc, inputs) @ self.w[f"o{i}"]
            x = x + self.mlp(x, i)
        if inputs.last is not None:
            x = x[inputs.last]
        return self.head(x)

    # -- graph decode path: fused QKV, flash-decoding split-KV -------------------------------

    def forward_decode(
        self, inputs: StepInputs, kv: list[tuple[Tensor, Tensor]], num_splits: int
    ) -> Tensor:
        x = self.embed(inputs)
        for i, (kc, vc) in enumerate(kv):
            q, k, v = (_rms(x, self.w[f"norm_a{i}"]) @ self.qkv[i]).split(HIDDEN, dim=-1)
            kc.index_copy_(0, inputs.slots, k.reshape(-1, HEADS, HEAD_DIM))
            vc.index_copy_(0, inputs.slots, v.reshape(-1, HEADS, HEAD_DIM))
            x = x + _split_kv_attention(q, kc, vc, inputs, num_splits) @ self.w[f"o{i}"]
            x = x + self.mlp(x, i)
        return self.head(x)


def _rms(x: Tensor, weight: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(DT) * weight


def _gather(cache: Tensor, tables: Tensor) -> Tensor:
    offsets = torch.arange(SPEC.block_size, device=tables.device)
    slots = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT]
    return cache[slots]  # [T, CONTEXT, heads, dim]


def _plain_attention(q: Tensor, kc: Tensor, vc: Tensor, inputs: StepInputs) -> Tensor:
    keys, values = _gather(kc, inputs.tables), _gather(vc, inputs.tables)
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inputs.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) * HEAD_DIM**-0.5
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(DT)
    values = torch.where(
        visible[:, :, None, None], values, torch.zeros((), dtype=DT, device=q.device)
    )
    return torch.einsum("thc,tchd->thd", probs, values).reshape(-1, HIDDEN)


def _split_kv_attention(
    q: Tensor, kc: Tensor, vc: Tensor, inputs: StepInputs, num_splits: int
) -> Tensor:
    """Flash-decoding: `num_splits` chunks of SPLIT positions, partials merged by LSE."""
    span = num_splits * SPLIT
    keys = _gather(kc, inputs.tables)[:, :span]  # [R, span, heads, dim]
    values = _gather(vc, inputs.tables)[:, :span]
    r = q.shape[0]
    visible = torch.arange(span, device=q.device)[None, :] <= inputs.positions[:, None]  # [R, span]
    qf = q.reshape(r, HEADS, HEAD_DIM).float()
    scores = torch.einsum("rhd,rchd->rhc", qf, keys.float()) * HEAD_DIM**-0.5
    scores = torch.where(
        visible[:, None, :], scores, torch.full((), float("-inf"), device=q.device)
    )
    scores = scores.view(r, HEADS, num_splits, SPLIT)
    chunk_max = scores.amax(-1, keepdim=True)  # [R, H, S, 1], -inf for an empty chunk
    safe_max = torch.where(torch.isfinite(chunk_max), chunk_max, torch.zeros((), device=q.device))
    p = torch.exp(scores - safe_max)  # 0 where masked
    denom = p.sum(-1)  # [R, H, S]
    vals = values.view(r, num_splits, SPLIT, HEADS, HEAD_DIM).permute(0, 3, 1, 2, 4).float()
    vis = visible.view(r, 1, num_splits, SPLIT, 1)
    vals = torch.where(vis, vals, torch.zeros((), device=q.device))  # NaN in masked slots
    partial = torch.einsum("rhsc,rhscd->rhsd", p, vals)
    partial = (partial / denom.clamp_min(1e-30)[..., None]).to(DT)  # tmp_out in the model dtype
    lse = safe_max.squeeze(-1) + torch.log(denom)  # -inf for an empty chunk
    # merge kernel: weights exp(lse_s - max lse)
    top = lse.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros((), device=q.device))
    weight = torch.exp(lse - top)  # [R, H, S]
    out = torch.einsum("rhs,rhsd->rhd", weight, partial.float()) / weight.sum(-1)[..., None]
    return out.to(DT).reshape(r, HIDDEN)


def sample(
    logits: Tensor, positions: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor
) -> Tensor:
    key = _mix(_mix(seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class SplitKVRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, bake_splits: bool = False) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.bake_splits = bake_splits
        self.backend: Any = get_backend(backend)
        device = self.backend.device
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
            self.buffers: dict[str, Tensor] = {}
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
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.pool: Any = None

    # -- graph mode ---------------------------------------------------------------------------

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{n: b[:size] for n, b in self.buffers.items()})

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        for name, values in _decode_rows(batch.requests).items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(_PADDING[name])

    def decode_model(self, inputs: StepInputs, num_splits: int) -> tuple[Tensor, Tensor]:
        logits = self.model.forward_decode(inputs, self.kv, num_splits)
        return logits, sample(
            logits, inputs.positions, inputs.seeds, inputs.temperatures, inputs.sampled
        )

    def capture(self, batch: Batch, size: int) -> None:
        """Lazy capture on the first batch that needs `size`; its inputs are already prepared."""
        if self.bake_splits:  # BUG: host value from the capture batch, frozen into the graph
            longest = max(r.seq_len for r in batch.requests)
            num_splits = -(-longest // SPLIT)
        else:
            num_splits = MAX_SPLITS
        if self.pool is None:
            self.pool = self.backend.graph_pool_handle()
        inputs = self.static_inputs(size)
        self.decode_model(inputs, num_splits)  # warm-up (rewrites this step's slots alike)
        self.backend.synchronize()
        graph = self.backend.Graph()
        with self.backend.graph(graph, pool=self.pool):
            self.outputs[size] = self.decode_model(inputs, num_splits)
        self.graphs[size] = graph

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        if size not in self.graphs:
            self.capture(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ---------------------------------------------------------------------------

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SplitKVRunner:
    return SplitKVRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SplitKVRunner:
    return SplitKVRunner(mode, seed=seed, backend=backend, bake_splits=True)
