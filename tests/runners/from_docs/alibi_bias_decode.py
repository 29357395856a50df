"""A paged-KV decode runner for an ALiBi model, with CUDA graphs captured lazily per batch bucket.

The model is a two-layer decoder in the BLOOM / MPT / Baichuan style: no position embedding and
no rotary embedding; each head adds a linear bias `slope_h * (key_pos - query_pos)` to its
attention scores (slopes from the ALiBi paper's geometric series, with the interleave for a head
count that is not a power of two: 6 heads here). Attention reads a slot-major paged KV cache
through block tables. The bias is built inside the forward from the step's positions (a static
buffer in graph mode), together with the causal mask `key_pos <= query_pos`, over a key window of
`window` positions.

Graph mode captures one decode graph per bucket (capture sizes 1, 2, 4) the first time a decode
batch needs it (lazy capture, as transformers' continuous batching does), into one shared pool:
warm-up and capture run on all-padding rows, then the batch is written into the static buffers and
the new graph replays. Any other batch (prefill, mixed, speculative, more rows than the largest
bucket) runs eagerly. The eager path sizes its key window to the batch's longest sequence (the
`max_seqlen_k` an attention backend gets); the graph path must use the longest sequence any replay
can have (`max_blocks_per_req * block_size`), since a Python int passed to the forward is frozen
into the graph.

THE BUG (`make_buggy_target`, graph path only): the window is taken from the metadata of the batch
that triggered the capture (its longest `seq_len`, rounded up to a whole block, as a bucketed
`max_seqlen_k`) and baked into that bucket's graph: the gathered context, the key positions of
the ALiBi bias and the causal mask all span that many slots. A later batch of the same bucket whose
sequences are longer replays a graph that never looks at the keys past the capture's window: the
logits of those rows are wrong (the most recent tokens, which ALiBi weights most, drop out of
attention entirely). The eager path recomputes the window every step and stays correct.

Modelled on:
- huggingface/transformers PR #45323 "[CB] Fix capture of max_seqlen"
  (https://github.com/huggingface/transformers/pull/45323): CUDA graphs were keyed by padded
  tensor sizes while FlashAttention's `max_seqlen_k`, a Python int, was baked into the captured
  launch; a batch with a longer `max_seqlen_k` replayed a stale graph (GSM8K 0.45 -> 0.23).
- the ALiBi-bias caches sized for the lengths seen first: lucidrains/x-transformers PR #90
  ("Fix bug with caching AliBi bias for differently shaped inputs",
  https://github.com/lucidrains/x-transformers/pull/90) and EleutherAI/gpt-neox PR #652 (ALiBi
  matrix cached at one length, https://github.com/EleutherAI/gpt-neox/pull/652); vLLM V0 avoided
  the graph form of this by capturing with `max_seq_len_to_capture` as the decode `max_seq_len`.
No engine code was copied.
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
    num_blocks=28,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HEADS, HEAD_DIM, LAYERS = 6, 8, 2
HIDDEN = HEADS * HEAD_DIM
MAX_CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi paper's slopes; for a head count that is not a power of two, the slopes of the
    next power of two fill the rest, every other one."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    lower = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(lower) + power_of_two(2 * lower)[0::2][: num_heads - lower]


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] each request's last token; None for decode (T == R)


class AlibiDecoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes: dict[str, tuple[int, int]] = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        for i in range(LAYERS):
            shapes[f"qkv{i}"] = (HIDDEN, 3 * HIDDEN)
            shapes[f"o{i}"] = (HIDDEN, HIDDEN)
            shapes[f"up{i}"] = (HIDDEN, 2 * HIDDEN)
            shapes[f"down{i}"] = (2 * HIDDEN, HIDDEN)
        self.weights = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        # Fixed at construction; every graph reads this one tensor.
        self.slopes = torch.tensor(alibi_slopes(HEADS), dtype=torch.float32).to(device)
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            w = self.weights[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))

    def forward(self, inp: Inputs, kv: list[tuple[Tensor, Tensor]], window: int) -> Tensor:
        w = self.weights
        device = inp.tokens.device
        bs = SPEC.block_size
        key_pos = torch.arange(window, device=device)  # [W]
        slots = (inp.tables[:, :, None] * bs + torch.arange(bs, device=device)).flatten(1)
        slots = slots[:, :window]  # [T, W] the cache slot of each key position
        visible = key_pos[None, :] <= inp.positions[:, None]  # [T, W]
        distance = (key_pos[None, :] - inp.positions[:, None]).to(torch.float32)  # <= 0 if visible
        bias = self.slopes[None, :, None] * distance[:, None, :]  # [T, H, W]
        x = w["embed"][inp.tokens]
        for i, (k_cache, v_cache) in enumerate(kv):
            q, k, v = (_rms(x) @ w[f"qkv{i}"]).split(HIDDEN, dim=-1)
            k_cache.index_copy_(0, inp.slots, k.reshape(-1, HEADS, HEAD_DIM))
            v_cache.index_copy_(0, inp.slots, v.reshape(-1, HEADS, HEAD_DIM))
            keys, values = k_cache[slots], v_cache[slots]  # [T, W, H, D]
            scores = torch.einsum("thd,twhd->thw", q.reshape(-1, HEADS, HEAD_DIM), keys)
            scores = scores / math.sqrt(HEAD_DIM) + bias
            probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
            # Masked keys may be NaN (the poisoned null block): zero them, 0 * NaN is NaN.
            values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=device))
            attended = torch.einsum("thw,twhd->thd", probs, values).reshape(-1, HIDDEN)
            x = x + attended @ w[f"o{i}"]
            x = x + torch.nn.functional.gelu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        if inp.last is not None:
            x = x[inp.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def sample(logits: Tensor, inp: Inputs) -> Tensor:
    """Gumbel-max with noise from a hash of (seed, position, token id): nothing depends on the
    row, the bucket or the company."""
    pos = inp.positions if inp.last is None else inp.positions[inp.last]
    key = _hash32(_hash32(inp.seeds & M32) ^ ((pos * 0x61C88647) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash32(key[:, None] ^ ((ids * 0x7FEB352D) & M32)[None, :])
    uniform = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    gumbel = -torch.log(-torch.log(uniform))
    noisy = logits / inp.temperatures[:, None] + gumbel
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


PADDING: dict[str, Any] = {
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


class AlibiRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, bake_window: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.bake_window = bake_window
        self.be: Any = get_backend(backend)
        device = self.be.device
        self.model = AlibiDecoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = [
            (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in range(LAYERS)
        ]
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.windows: dict[int, int] = {}
        self.buffers: dict[str, Tensor] = {}
        self.pool: Any = None
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
            self.pool = self.be.graph_pool_handle()

    # -- graph path -------------------------------------------------------------------------------

    def capture_window(self, batch: Batch) -> int:
        """The key window the bucket's graph is captured with."""
        if self.bake_window:
            # BUG: the capture batch's longest sequence (bucketed to whole blocks) is frozen
            # into the graph as its max_seqlen_k.
            longest = max(r.seq_len for r in batch.requests)
            bs = SPEC.block_size
            return min(MAX_CONTEXT, -(-longest // bs) * bs)
        return MAX_CONTEXT  # the longest sequence any replay can have

    def static_inputs(self, size: int) -> Inputs:
        return Inputs(**{name: buf[:size] for name, buf in self.buffers.items()})

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        reqs = batch.requests
        sampling = [_sampling(r) for r in reqs]
        rows: dict[str, list[Any]] = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "seeds": [s[0] for s in sampling],
            "temperatures": [s[1] for s in sampling],
            "sampled": [s[2] for s in sampling],
        }
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype).to(buf.device))
            buf[n:size].fill_(PADDING[name])

    def capture(self, size: int, batch: Batch) -> None:
        window = self.capture_window(batch)
        self.prepare(Batch(()), size)  # warm-up and capture on padding rows only
        inputs = self.static_inputs(size)
        self.run_model(inputs, window)
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            self.outputs[size] = self.run_model(inputs, window)
        self.graphs[size] = graph
        self.windows[size] = window

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        if size not in self.graphs:
            self.capture(size, batch)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both paths -------------------------------------------------------------------------------

    def run_model(self, inputs: Inputs, window: int) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv, window)
        return logits, sample(logits, inputs)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        device = self.be.device
        tokens, positions, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                tokens.append(t)
                positions.append(r.context_len + i)
                slots.append(kv_slot(r.block_ids, r.context_len + i, SPEC.block_size))
                tables.append(_table(r))
            last.append(len(tokens) - 1)
        sampling = [_sampling(r) for r in batch.requests]

        def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        inputs = Inputs(
            tokens=t(tokens),
            positions=t(positions),
            slots=t(slots),
            tables=t(tables).view(-1, SPEC.max_blocks_per_req),
            seeds=t([s[0] for s in sampling]),
            temperatures=t([s[1] for s in sampling], torch.float32),
            sampled=t([s[2] for s in sampling], torch.bool),
            last=t(last),
        )
        window = max(r.seq_len for r in batch.requests)  # this batch's max_seqlen_k
        logits, next_tokens = self.run_model(inputs, window)
        return StepResult(logits, next_tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest bucket"
        return None

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.be.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{kind}{i}": kv[j] for i, kv in enumerate(self.kv) for j, kind in enumerate("kv")}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> AlibiRunner:
    return AlibiRunner(mode, seed=seed, backend=backend, bake_window=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> AlibiRunner:
    return AlibiRunner(mode, seed=seed, backend=backend, bake_window=True)
