"""A paged-KV decode runner with Phi-3 style LongRoPE: short or long rotary tables by length.

The model: a one-layer decoder (token embedding, rotary attention over a slot-major paged KV
cache read through block tables, SiLU MLP, LM head) written against plain `torch.cuda`
(`device="cuda"`, `torch.cuda.CUDAGraph`, `torch.cuda.graph`, one shared pool), so on the sim the
harness's drop-in runs it unchanged. Its rotary embedding is LongRoPE-like: two cos/sin tables
are precomputed once, a "short" one (per-dimension rescale factors near 1) and a "long" one
(rescale factors up to 4 and an attention-scale `mscale` > 1). A request whose length (`seq_len`,
the tokens in its cache after this step) exceeds ORIGINAL_MAX_POSITIONS (half the per-request
limit) rotates its query and key with the long table, as Phi-3's `original_max_position_embeddings`
switch does. Keys are cached after rotation. Decode batches of up to 4 requests replay a graph
captured lazily, the first time a batch needs that size (the capture batch is the live one);
prefill, mixed, speculative and larger batches run eagerly. Sampling is Gumbel-max with noise
hashed from (seed, position, token id).

Correct runner (`make_target`): the short/long choice is made per row on the device,
`torch.where(seq_lens > ORIGINAL_MAX_POSITIONS, long, short)`, where `seq_lens` is a static graph
input rewritten every step, so one captured graph serves both regimes and mixed rows.

Buggy runner (`make_buggy_target`), one realistic bug: the rotary embedding picks the table on the
host from the step's attention metadata, `long if meta.max_seq_len > ORIGINAL_MAX_POSITIONS else
short`, where `max_seq_len` is the host-side batch maximum that engines keep in their attention
metadata. Eagerly that is merely batch-level (a short row sharing a batch with a long one gets the
long table, the review concern raised on vLLM's first Phi-3 LongRoPE port); in graph mode the
Python branch runs once, at capture, so a graph captured on short contexts keeps the short table
for long ones, and one captured on long contexts rotates every later short row with the long one.

Public source. vLLM's Phi-3 port chose the table for the whole batch
(`torch.any(positions > k)`, reviewed in https://github.com/vllm-project/vllm/pull/4298);
https://github.com/vllm-project/vllm/pull/8254 ("[Bugfix] Fix LongRoPE bug") plumbed a per-sequence
length through the attention metadata (padded for CUDA graphs) instead; the transition itself kept
producing random tokens under concurrent serving (https://github.com/vllm-project/vllm/issues/27414,
fixed in https://github.com/vllm-project/vllm/pull/27431 by fixing the choice at start-up).
The host-branch-in-capture form is https://github.com/vllm-project/vllm/pull/58064 (transformers'
`dynamic_rope_update` branches on `max(position_ids)` on the host, which CUDA refuses during
capture) and onnxruntime-genai's https://github.com/microsoft/onnxruntime-genai/pull/1921 (CUDA
graphs disabled for Phi LongRoPE models whose table choice is an If node). No code copied.
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
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size  # 24 positions a request can reach
ORIGINAL_MAX_POSITIONS = CONTEXT // 2  # 12: past this a request uses the long table
ROPE_BASE = 500.0
NULL_SLOT = SPEC.null_block * SPEC.block_size
MASK32 = 0xFFFFFFFF


@dataclass
class Meta:
    """One step's inputs, vLLM-style: device tensors plus the host-side batch maximum."""

    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    seq_lens: Tensor  # [T] the seq_len of each token's request (0 for padding)
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    max_seq_len: int  # host value, as engines keep in their attention metadata
    last: Tensor | None = None  # [R] last token of each request; None for decode (T == R)


class LongRoPE:
    """Two precomputed cos/sin tables; the choice between them is per row, on the device."""

    def __init__(self, device: torch.device) -> None:
        half = HEAD_DIM // 2
        i = torch.arange(half, dtype=torch.float64)
        inv_freq = ROPE_BASE ** (-2.0 * i / HEAD_DIM)
        short_factor = 1.0 + 0.05 * i / (half - 1)
        long_factor = 1.0 + 3.0 * (i / (half - 1)) ** 2
        scale = CONTEXT / ORIGINAL_MAX_POSITIONS
        mscale = math.sqrt(1.0 + math.log(scale) / math.log(ORIGINAL_MAX_POSITIONS))
        pos = torch.arange(CONTEXT, dtype=torch.float64)[:, None]
        short = pos * (inv_freq / short_factor)[None, :]
        long = pos * (inv_freq / long_factor)[None, :]
        # [CONTEXT, half] each, filled once: not static buffers (the harness must not poison them)
        self.short_cos = short.cos().float().to(device)
        self.short_sin = short.sin().float().to(device)
        self.long_cos = (long.cos() * mscale).float().to(device)
        self.long_sin = (long.sin() * mscale).float().to(device)

    def cos_sin(self, meta: Meta) -> tuple[Tensor, Tensor]:
        long = (meta.seq_lens > ORIGINAL_MAX_POSITIONS)[:, None]  # [T, 1] per row, on the device
        pos = meta.positions
        cos = torch.where(long, self.long_cos[pos], self.short_cos[pos])
        sin = torch.where(long, self.long_sin[pos], self.short_sin[pos])
        return cos, sin

    def apply(self, x: Tensor, meta: Meta) -> Tensor:
        """Neox-style rotation of [T, heads, dim]."""
        cos, sin = self.cos_sin(meta)
        cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class HostSwitchLongRoPE(LongRoPE):
    """THE BUG: the table is chosen on the host from the batch's max_seq_len (a Python branch)."""

    def cos_sin(self, meta: Meta) -> tuple[Tensor, Tensor]:
        pos = meta.positions
        if meta.max_seq_len > ORIGINAL_MAX_POSITIONS:
            return self.long_cos[pos], self.long_sin[pos]
        return self.short_cos[pos], self.short_sin[pos]


class Decoder:
    def __init__(self, seed: int, device: torch.device, rope: LongRoPE) -> None:
        self.rope = rope
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            fresh = torch.randn(self.w[name].shape, generator=gen) / math.sqrt(
                self.w[name].shape[0]
            )
            self.w[name].copy_(fresh.to(self.w[name].device))  # in place: graphs keep reading it

    def forward(self, meta: Meta, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][meta.tokens]
        h = _rms(x)
        q = self.rope.apply((h @ w["q"]).view(-1, HEADS, HEAD_DIM), meta)
        k = self.rope.apply((h @ w["k"]).view(-1, HEADS, HEAD_DIM), meta)
        v = (h @ w["v"]).view(-1, HEADS, HEAD_DIM)
        k_cache.index_copy_(0, meta.slots, k)
        v_cache.index_copy_(0, meta.slots, v)
        x = x + _attend(q, k_cache, v_cache, meta) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if meta.last is not None:
            x = x[meta.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: Meta) -> Tensor:
    bs = SPEC.block_size
    slots = (meta.tables[:, :, None] * bs + torch.arange(bs, device=q.device)).flatten(1)
    keys, values = k_cache[slots], v_cache[slots]  # [T, CONTEXT, heads, dim]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= meta.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def sample(logits: Tensor, meta: Meta) -> Tensor:
    pos = meta.positions if meta.last is None else meta.positions[meta.last]
    key = _hash(_hash(meta.seeds) ^ ((pos * 0x9E3779B1) & MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & MASK32)[None, :])
    u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / meta.temperatures[:, None] - torch.log(-torch.log(u))
    return torch.where(meta.sampled, noisy.argmax(-1), logits.argmax(-1))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & MASK32, r.temperature, True


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


PADDING: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "seq_lens": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


class LongRoPERunner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, rope_cls: type[LongRoPE]):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.device = torch.device("cuda", torch.cuda.current_device())
        with torch.inference_mode():
            self.model = Decoder(seed, self.device, rope_cls(self.device))
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.k_cache = torch.zeros(shape, device=self.device)
            self.v_cache = torch.zeros(shape, device=self.device)
            self.buffers: dict[str, Tensor] = {}
            if mode == "graph":
                n, i64 = SPEC.capture_sizes[-1], torch.int64
                self.buffers = {
                    "tokens": torch.zeros(n, dtype=i64, device=self.device),
                    "positions": torch.zeros(n, dtype=i64, device=self.device),
                    "seq_lens": torch.zeros(n, dtype=i64, device=self.device),
                    "slots": torch.zeros(n, dtype=i64, device=self.device),
                    "tables": torch.zeros(
                        n, SPEC.max_blocks_per_req, dtype=i64, device=self.device
                    ),
                    "seeds": torch.zeros(n, dtype=i64, device=self.device),
                    "temperatures": torch.ones(n, device=self.device),
                    "sampled": torch.zeros(n, dtype=torch.bool, device=self.device),
                }
        self.pool: Any = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}

    # -- graph path --------------------------------------------------------------------------------

    def _prepare(self, batch: Batch, size: int) -> Meta:
        reqs = batch.requests
        n = len(reqs)
        samp = [_sampling(r) for r in reqs]
        rows: dict[str, list[Any]] = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "seq_lens": [r.seq_len for r in reqs],
            "slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temperatures": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        for name, values in rows.items():
            buf = self.buffers[name]
            buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(PADDING[name])
        views = {name: buf[:size] for name, buf in self.buffers.items()}
        return Meta(**views, max_seq_len=max(r.seq_len for r in reqs))

    def _run(self, meta: Meta) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(meta, self.k_cache, self.v_cache)
        return logits, sample(logits, meta)

    def _replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        meta = self._prepare(batch, size)
        if size not in self.graphs:  # lazy capture, on the batch at hand
            self._run(meta)  # warm-up (writes this batch's own slots, as the replay will)
            torch.cuda.synchronize()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self._run(meta)
            self.graphs[size] = graph
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager path --------------------------------------------------------------------------------

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        toks, pos, lens, slots, tables, last = [], [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                toks.append(t)
                pos.append(r.context_len + i)
                lens.append(r.seq_len)
                slots.append(kv_slot(r.block_ids, r.context_len + i, SPEC.block_size))
                tables.append(_table(r))
            last.append(len(toks) - 1)
        samp = [_sampling(r) for r in batch.requests]

        def dev(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = Meta(
            tokens=dev(toks),
            positions=dev(pos),
            seq_lens=dev(lens),
            slots=dev(slots),
            tables=dev(tables).view(-1, SPEC.max_blocks_per_req),
            seeds=dev([s[0] for s in samp]),
            temperatures=dev([s[1] for s in samp], torch.float32),
            sampled=dev([s[2] for s in samp], torch.bool),
            max_seq_len=max(r.seq_len for r in batch.requests),
            last=dev(last),
        )
        logits, tokens = self._run(meta)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def _fallback(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    # -- contract ----------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(
                empty,
                torch.zeros(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason="empty batch",
            )
        with torch.inference_mode():
            reason = self._fallback(batch)
            return self._replay(batch) if reason is None else self._eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> LongRoPERunner:
    # `backend` is not the runner's business: on sim the harness's drop-in is active around it.
    return LongRoPERunner(mode, seed=seed, rope_cls=LongRoPE)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> LongRoPERunner:
    return LongRoPERunner(mode, seed=seed, rope_cls=HostSwitchLongRoPE)
