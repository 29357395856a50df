"""A decoder whose captured graph samples from each row's top-k logprobs, k per request.

The runner: a one-layer decoder over a slot-major paged KV cache (block tables, learned positions,
SiLU MLP, LM head). Sampling runs inside the captured decode graph: logprobs =
log_softmax(logits / temperature), then `topk(K_CAP)` of them, then each row keeps only its own
first k candidates and takes the Gumbel-max among them, the noise hashed from (seed, position,
token id) so the draw is the same in any batch, bucket or padding. A request's k is derived
deterministically from the request's own randomness, the one per-request sampling datum the
contract gives besides the temperature: `k = 1 + seed % 11`, clamped to `K_MAX = 8` (greedy
requests take the argmax). The step returns only the raw logits and the next tokens; the top-k
logprobs never leave the graph.

Graphs are captured lazily, the first time a decode batch needs a size (as engines that capture
on demand do), on padding rows, and replayed for every later batch of that size.

Correct runner (`make_target`): per-row k lives in the device buffer `topk` (padding rows: 1),
the graph always computes `topk(K_MAX)` and masks column j of row i where j >= k_i. The eager
twin runs the same sampler with the same K_MAX, so both twins draw from the same distribution.

Bug (`make_buggy_target`): the width of the top-k inside the graph is taken on the host from the
batch that triggered the capture, `K_CAP = max(k of its rows)` (the usual "compute
max_num_logprobs / max top_k over the batch, then one topk call" optimisation), and that Python
int is baked into the captured `topk` call. A later batch on the same graph whose rows ask for a
larger k is silently truncated to the capture batch's k: rows sample among fewer candidates than
eager does. (The per-row mask still reads the live `topk` buffer, so nothing fails loudly.)

Modelled on:
  - https://github.com/sgl-project/sglang-omni/pull/1134 (CUDA-graphed code-predictor sampler:
    the batch's max top_k is a host value the graph is built for, so it must be part of the
    graph key: "Graph keys pin every host branch of the eager sampling path: (bucket, mode,
    quantized_top_k, ...)"; widening it had to keep each row's true k via a per-row mask),
  - https://github.com/sgl-project/sglang-omni/pull/279 (graph sampling uses a fixed
    `_graph_top_k` width and clamps each row's device-side k to it: the correct design here),
  - https://github.com/sgl-project/sglang/pull/775 / issue #747 (return_logprob / top-logprobs
    handling broken under CUDA graph).
No engine code is copied.
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
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
K_MAX = 8  # the widest top-k the sampler serves; larger requested k is clamped
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
_MASK32 = 0xFFFFFFFF


def request_k(r: Request) -> int:
    """Each request's top-k, from its own seed (greedy rows: 1)."""
    if r.seed is None:
        return 1
    return min(1 + r.seed % 11, K_MAX)


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    topk: Tensor  # [R] int64, each row's k (1..K_MAX)
    last: Tensor | None = None


class TinyDecoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.device = device
        self.w = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            # a hotter head than 1/sqrt(d) so that the top few candidates carry real mass
            scale = 3.0 if name == "head" else 1.0
            fresh = torch.randn(t.shape, generator=gen) * scale / math.sqrt(t.shape[0])
            t.copy_(fresh.to(self.device))

    def forward(self, inp: StepInputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][inp.tokens] + w["pos"][inp.positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, inp.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, inp.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + _attention(q, k_cache, v_cache, inp) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if inp.last is not None:
            x = x[inp.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: StepInputs) -> Tensor:
    size = SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    ctx = (inp.tables[:, :, None] * size + offsets).flatten(1)
    keys, values = k_cache[ctx], v_cache[ctx]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inp.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def sample_topk(logits: Tensor, inp: StepInputs, k_cap: int) -> Tensor:
    """Top-k logprobs (width k_cap, a host int), each row masked to its own k, then Gumbel-max
    among the kept candidates with noise hashed from (seed, position, token id)."""
    positions = inp.positions if inp.last is None else inp.positions[inp.last]
    logprobs = torch.log_softmax(logits / inp.temperatures[:, None], dim=-1)
    top_lp, top_ids = logprobs.topk(k_cap, dim=-1)  # [R, k_cap]
    cols = torch.arange(k_cap, device=logits.device)
    keep = cols[None, :] < inp.topk[:, None]
    key = _mix(_mix(inp.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    bits = _mix(key[:, None] ^ ((top_ids * 0x85EBCA6B) & _MASK32))
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    score = torch.where(keep, top_lp - torch.log(-torch.log(uniform)), float("-inf"))
    choice = score.argmax(-1, keepdim=True)
    drawn = top_ids.gather(1, choice).squeeze(1)
    return torch.where(inp.sampled, drawn, logits.argmax(-1))


def _slot(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & _MASK32, r.temperature, True


_PADDING: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
    "topk": 1,
}


class TopKRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, k_from_batch: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.k_from_batch = k_from_batch
        self.backend: Any = get_backend(backend)
        dev = self.backend.device
        self.model = TinyDecoder(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.full((rows,), NULL_SLOT, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(rows, dtype=i64, device=dev),
                "temperatures": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
                "topk": torch.ones(rows, dtype=i64, device=dev),
            }

    # -- graph mode ---------------------------------------------------------------------------

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{name: buf[:size] for name, buf in self.buffers.items()})

    def capture(self, size: int, batch: Batch) -> None:
        """Capture the graph of `size` rows, the first time `batch` needs it."""
        # BUG (k_from_batch): the top-k width is read on the host from the batch being captured
        # and baked into the graph's topk call.
        k_cap = max(request_k(r) for r in batch.requests) if self.k_from_batch else K_MAX
        self.prepare(Batch(()), size)  # warm-up and capture on padding rows
        inputs = self.static_inputs(size)
        self.run_model(inputs, k_cap)
        self.backend.synchronize()
        graph = self.backend.Graph()
        with self.backend.graph(graph):
            self.outputs[size] = self.run_model(inputs, k_cap)
        self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        samp = [_sampling(r) for r in reqs]
        rows: dict[str, list[Any]] = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temperatures": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
            "topk": [request_k(r) for r in reqs],
        }
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(_PADDING[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        if size not in self.graphs:
            self.capture(size, batch)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ---------------------------------------------------------------------------

    def run_model(self, inp: StepInputs, k_cap: int) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, self.k_cache, self.v_cache)
        return logits, sample_topk(logits, inp, k_cap)

    def eager_inputs(self, batch: Batch) -> StepInputs:
        dev = self.backend.device
        tokens, positions, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                tokens.append(t)
                positions.append(r.context_len + i)
                slots.append(_slot(r, r.context_len + i))
                tables.append(_table(r))
            last.append(len(tokens) - 1)
        samp = [_sampling(r) for r in batch.requests]

        def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        return StepInputs(
            tokens=t(tokens),
            positions=t(positions),
            slots=t(slots),
            tables=t(tables).view(-1, SPEC.max_blocks_per_req),
            seeds=t([s[0] for s in samp]),
            temperatures=t([s[1] for s in samp], torch.float32),
            sampled=t([s[2] for s in samp], torch.bool),
            topk=t([request_k(r) for r in batch.requests]),
            last=t(last),
        )

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens) or any(r.context_len == 0 for r in batch.requests):
            return "not a plain decode batch"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            return self.replay(batch)
        logits, tokens = self.run_model(self.eager_inputs(batch), K_MAX)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.k_cache, "v0": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> TopKRunner:
    return TopKRunner(mode, seed=seed, backend=backend, k_from_batch=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> TopKRunner:
    return TopKRunner(mode, seed=seed, backend=backend, k_from_batch=True)
