"""A bfloat16 two-layer decoder whose graph path computes the eager path's mathematics in another
order, as serving engines' CUDA-graph decode paths do.

Model: token + learned position embeddings, 2 layers of (RMS norm, Q/K/V projections, attention
over a slot-major paged KV cache read through block tables, output projection, SiLU MLP), final
RMS norm and an LM head; vocabulary 320; weights, activations and the KV cache in bfloat16.

- Eager path (the eager twin, and the graph twin's prefill / mixed / speculative / oversized
  batches): three separate Q, K, V matmuls; single-pass softmax attention in float32 over the
  whole context.
- Graph path (decode batches of up to 8 requests, padded to a capture size 1/2/4/8, captured
  lazily the first time a size is needed): one fused QKV matmul on the concatenated weight (a
  derived copy, refreshed in place by `update_weights`), then a split-K "flash-decoding"
  attention: the block table is cut into NSPLIT=4 splits of `split_blocks` blocks, each split
  computes (max, sum, partial output with P rounded to bfloat16 before the P.V product, as FA
  kernels do), and a log-sum-exp combine merges them (empty splits: output 0, LSE -inf, guarded).
- Logits: the LM head in float32 on the bfloat16 hidden state (an "fp32 lm_head", as engines
  offer for accuracy): float32 values with bfloat16's rounding in them.
- Module constants: SPLIT_LAYERS (the layers whose graph path splits the KV) and GRAPH_P_DTYPE
  (the dtype P is rounded to before P.V in a split; float32 makes the split a pure reordering).
- Sampling: Gumbel-max with counter-based noise hashed from (seed, position, token id), so a
  request's sample depends only on its seed, position and logits.

Correct plan: the graph path's split size is planned from the fixed KV capacity
(max_blocks_per_req), not from the live batch, so a graph serves any context length (the fix of
onnxruntime PR #32239, "Make adaptive FlashDecode splits CUDA-graph safe": plan split-KV from fixed
cache capacity during capture and replay, keep live-length planning for eager execution).

Bug (`make_buggy_target`): the split plan is computed on the host from the batch the graph is
captured with (its longest sequence: split_blocks = ceil(ceil(max_seq_len / block_size) / NSPLIT)),
and is baked into the graph. Replays for longer contexts drop every key past
NSPLIT * split_blocks * block_size positions. Modelled on onnxruntime PR #32239 ("Planning NumSplits
from the current live sequence length can become stale as the cache grows") and on
gittensor-ai-lab/sparkinfer PR #715 ("don't freeze n_splits at a stale pre-transition value": a
decode graph captured with the short-context split count). No code copied from either.
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
    num_blocks=64,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=320,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS, FFN = 64, 4, 16, 2, 128
DTYPE = torch.bfloat16
BS = SPEC.block_size
CONTEXT = SPEC.max_blocks_per_req * BS
NSPLIT = 4
NULL_SLOT = SPEC.null_block * BS
SPLIT_LAYERS = tuple(range(LAYERS))  # layers whose graph path uses split-K
GRAPH_P_DTYPE = torch.bfloat16  # P rounded before P.V in the split kernel, as FA kernels do
LOGIT_GAIN = 3.0  # logits of a few units, like a trained LM's, so bf16 ulps there are ~0.03-0.06
_M32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R] float32
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R]; None for decode (T == R)


def _rms(x: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(DTYPE)


class Decoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes: dict[str, tuple[int, int]] = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
        }
        for i in range(LAYERS):
            for n in "qkvo":
                shapes[f"{n}{i}"] = (HIDDEN, HIDDEN)
            shapes[f"up{i}"] = (HIDDEN, FFN)
            shapes[f"down{i}"] = (FFN, HIDDEN)
        shapes["head"] = (HIDDEN, SPEC.vocab_size)
        self.w = {n: torch.empty(s, device=device, dtype=DTYPE) for n, s in shapes.items()}
        # Derived weight read by the graph path only: refreshed in place after every load.
        self.w_qkv = [
            torch.empty(HIDDEN, 3 * HIDDEN, device=device, dtype=DTYPE) for _ in range(LAYERS)
        ]
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            weight = self.w[name]
            fresh = torch.randn(weight.shape, generator=gen) / math.sqrt(weight.shape[0])
            if name == "head":
                fresh = fresh * LOGIT_GAIN
            weight.copy_(fresh.to(device=self.device, dtype=DTYPE))
        self.post_load()

    def post_load(self) -> None:
        for i in range(LAYERS):
            fused = torch.cat([self.w[f"q{i}"], self.w[f"k{i}"], self.w[f"v{i}"]], dim=1)
            self.w_qkv[i].copy_(fused)

    def forward(
        self, inp: StepInputs, kv: list[tuple[Tensor, Tensor]], split_blocks: int | None
    ) -> Tensor:
        """split_blocks None: eager path; else the graph path with that split plan."""
        w = self.w
        x = w["embed"][inp.tokens] + w["pos"][inp.positions]
        for i, (k_cache, v_cache) in enumerate(kv):
            h = _rms(x)
            if split_blocks is None:
                q, k, v = h @ w[f"q{i}"], h @ w[f"k{i}"], h @ w[f"v{i}"]
            else:
                q, k, v = (h @ self.w_qkv[i]).split(HIDDEN, dim=-1)
            k_cache.index_copy_(0, inp.slots, k.reshape(-1, HEADS, HEAD_DIM))
            v_cache.index_copy_(0, inp.slots, v.reshape(-1, HEADS, HEAD_DIM))
            if split_blocks is None or i not in SPLIT_LAYERS:
                a = _attention(q, k_cache, v_cache, inp)
            else:
                a = _split_attention(q, k_cache, v_cache, inp, split_blocks)
            x = x + a @ w[f"o{i}"]
            x = x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        if inp.last is not None:
            x = x[inp.last]
        h = _rms(x)
        return h.float() @ w["head"].float()


def _attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: StepInputs) -> Tensor:
    """Single-pass softmax attention in float32 over the whole table."""
    offsets = torch.arange(BS, device=q.device)
    context = (inp.tables[:, :, None] * BS + offsets).flatten(1)  # [T, C]
    keys, values = k_cache[context].float(), v_cache[context].float()
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inp.positions[:, None]
    qf = q.float().reshape(-1, HEADS, HEAD_DIM)
    scores = torch.einsum("thd,tchd->thc", qf, keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1).to(DTYPE)


def _split_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: StepInputs, split_blocks: int
) -> Tensor:
    """Flash-decoding: NSPLIT splits of `split_blocks` table columns, combined by log-sum-exp."""
    rows, length = q.shape[0], split_blocks * BS
    offsets = torch.arange(BS, device=q.device)
    tables = inp.tables[:, : NSPLIT * split_blocks]
    context = (tables[:, :, None] * BS + offsets).flatten(1)  # [R, NSPLIT * L]
    keys = k_cache[context].float().view(rows, NSPLIT, length, HEADS, HEAD_DIM)
    values = v_cache[context].float().view(rows, NSPLIT, length, HEADS, HEAD_DIM)
    span = torch.arange(NSPLIT * length, device=q.device)
    visible = (span[None, :] <= inp.positions[:, None]).view(rows, NSPLIT, length)
    qf = q.float().reshape(rows, HEADS, HEAD_DIM)
    scores = torch.einsum("rhd,rslhd->rshl", qf, keys) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    m = scores.amax(-1)  # [R, S, H]; -inf for an empty split
    zero = torch.zeros((), device=q.device)
    m_safe = torch.where(torch.isfinite(m), m, zero)
    p = torch.exp(scores - m_safe[..., None])
    total = p.sum(-1)
    values = torch.where(visible[:, :, :, None, None], values, zero)
    pv = torch.einsum(
        "rshl,rslhd->rshd", p.to(GRAPH_P_DTYPE).float(), values
    )  # P in bf16, as FA does
    has = total > 0
    o = torch.where(has[..., None], pv / total[..., None], zero)  # empty split: O = 0
    lse = torch.where(
        has, m_safe + torch.log(total), torch.full((), float("-inf"), device=q.device)
    )
    big = lse.amax(1, keepdim=True)  # [R, 1, H]
    big = torch.where(torch.isfinite(big), big, zero)
    weight = torch.exp(lse - big)  # empty split: 0
    denom = weight.sum(1)
    denom = torch.where(denom > 0, denom, torch.ones((), device=q.device))
    out = (weight[..., None] * o).sum(1) / denom[..., None]
    return out.flatten(1).to(DTYPE)


def _mix(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def sample(logits: Tensor, inp: StepInputs) -> Tensor:
    positions = inp.positions if inp.last is None else inp.positions[inp.last]
    key = _mix(_mix(inp.seeds) ^ ((positions * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    gumbel = -torch.log(-torch.log(uniform))
    noisy = logits.float() / inp.temperatures[:, None] + gumbel
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


class Runner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        with torch.inference_mode():
            self.model = Decoder(seed, device)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.kv = [
                (
                    torch.zeros(shape, device=device, dtype=DTYPE),
                    torch.zeros(shape, device=device, dtype=DTYPE),
                )
                for _ in range(LAYERS)
            ]
            self.graphs: dict[int, Any] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            self.pool: Any = None
            if mode == "graph":
                self.buffers = self._allocate(SPEC.capture_sizes[-1])
                self.pool = self.backend.graph_pool_handle()

    # -- graph path ---------------------------------------------------------------------------
    def _allocate(self, rows: int) -> dict[str, Tensor]:
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

    def plan(self, batch: Batch) -> int:
        """Blocks per split. Planned from the fixed KV capacity: valid for any batch replayed."""
        return -(-SPEC.max_blocks_per_req // NSPLIT)

    def _static(self, size: int) -> StepInputs:
        return StepInputs(**{n: b[:size] for n, b in self.buffers.items()})

    def _prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = _decode_rows(batch.requests)
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(_PADDING[name])

    def _run_graph_path(self, inp: StepInputs, split_blocks: int) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, self.kv, split_blocks)
        return logits, sample(logits, inp)

    def _capture(self, size: int, batch: Batch) -> None:
        split_blocks = self.plan(batch)
        inp = self._static(size)
        self._run_graph_path(inp, split_blocks)  # warm-up, outside the graph
        self.backend.synchronize()
        graph = self.backend.Graph()
        with self.backend.graph(graph, pool=self.pool):
            self.outputs[size] = self._run_graph_path(inp, split_blocks)
        self.graphs[size] = graph

    def _replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self._prepare(batch, size)
        if size not in self.graphs:
            self._capture(size, batch)  # lazily, the first time a batch needs this size
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both ---------------------------------------------------------------------------------
    def _fallback(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "above the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self._fallback(batch)
            if reason is None:
                return self._replay(batch)
            inp = _eager_inputs(batch, self.backend.device)
            logits = self.model.forward(inp, self.kv, None)
            return StepResult(logits, sample(logits, inp), "eager", None, reason=reason)

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


class BuggyRunner(Runner):
    def plan(self, batch: Batch) -> int:
        """BUG: planned from the capture batch's live longest sequence, then baked in the graph."""
        longest = max((r.seq_len for r in batch.requests), default=1)
        blocks = -(-longest // BS)
        return max(1, -(-blocks // NSPLIT))


_PADDING: dict[str, float | int | bool] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // BS] * BS + pos % BS


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & _M32, r.temperature, True


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

    def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return BuggyRunner(mode, seed=seed, backend=backend)
