"""A decode runner whose captured graph includes a per-request top-k / top-p sampler.

What it is: a one-layer decoder over a slot-major paged KV cache, written against the backend
facade (`pytest_graphmode.runtime.backends.get`). Decode batches replay a graph per capture size,
captured lazily the first time a batch needs that size (with that batch in the static buffers);
prefill, mixed, speculative and oversized batches run eagerly. The sampler is part of the graph:
each sampled request gets its own top-k (and, for some, top-p) derived deterministically from its
`req_id` (the contract's Request has no top_k field), and the step returns the FILTERED logits of
sampled requests (tokens outside the kept set are -inf, as engines that hand back processed logits
do). Greedy requests (seed None) are not filtered: their raw logits and argmax are returned.

Correct runner (`make_target`): k, p, temperature and the sampled flag are per-row graph inputs
(static buffers rewritten every step). The filter sorts each row once over the whole vocabulary,
masks ranks >= the row's own k, applies top-p on the survivors, and compares the row's logits
with the value at its last kept rank, gathered on the device: any k from 1 to the vocabulary
works without a host read, and nothing about the batch is baked into the graph.

Buggy runner (`make_buggy_target`), exactly one bug: the candidates come from
`torch.topk(logits, max_k)` with `max_k` the largest k of the batch at hand, a Python int computed
on the host; rows without top-k (greedy, k = vocab) count as 1, as vLLM's top-k-only path masks
them to 1 before taking the max. Eagerly that is right for every batch. A captured graph keeps the
`max_k` of its capture batch, so a later batch replayed on it whose sampled requests need a larger
k (each row's k is clamped to the candidate width, as a graph-fixed-width sampler does) keeps too
few tokens: its filtered logits are -inf where eager's are finite, and its token may change.

Modelled on: sglang-omni's CUDA-graph sampler, whose captured `torch.topk(..., self._graph_top_k)`
has a width fixed at capture and clamps each row's k to it
(https://github.com/sgl-project/sglang-omni/pull/279), and the host-side
`max(bounded_top_ks, default=0)` batch maximum used for a predictor graph's top-k width
(https://github.com/sgl-project/sglang-omni/pull/1134). No code copied.
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

VOCAB = 64
SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=VOCAB,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF

# Per-request sampling parameters, derived from req_id alone (same on every twin, in any batch).
TOP_KS = (2, 24, 5, 40, 11, 3, 17)
TOP_PS = (1.0, 1.0, 0.85, 1.0, 0.7)


def top_k_of(request: Request) -> int:
    if request.seed is None:
        return VOCAB  # greedy: no filter
    return TOP_KS[request.req_id % len(TOP_KS)]


def top_p_of(request: Request) -> float:
    return 1.0 if request.seed is None else TOP_PS[request.req_id % len(TOP_PS)]


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks]
    seeds: Tensor  # [R]
    temps: Tensor  # [R]
    sampled: Tensor  # [R] bool
    top_k: Tensor  # [R] int64, 1..VOCAB
    top_p: Tensor  # [R] float, (0, 1]
    last: Tensor | None = None  # [R] last token index of each request (eager only)


class Decoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (VOCAB, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, VOCAB),
        }
        self.device = device
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            # A sharper head spreads the logits, so filtering changes which tokens survive.
            scale = 3.0 if name == "head" else 1.0
            t.copy_(
                (scale * torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(
                    self.device
                )
            )

    def forward(self, x_in: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][x_in.tokens] + w["pos"][x_in.positions]
        h = _norm(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, x_in.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x_in.slots, v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        ctx = (x_in.tables[:, :, None] * bs + torch.arange(bs, device=x.device)).flatten(1)
        keys, vals = k_cache[ctx], v_cache[ctx]
        seen = torch.arange(CONTEXT, device=x.device)[None, :] <= x_in.positions[:, None]
        s = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
        probs = s.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(seen[:, :, None, None], vals, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", probs, vals).flatten(1) @ w["wo"]
        x = x + torch.nn.functional.gelu(_norm(x) @ w["up"]) @ w["down"]
        if x_in.last is not None:
            x = x[x_in.last]
        return _norm(x) @ w["head"]


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


# -- the sampler -----------------------------------------------------------------------------------


def filter_logits(logits: Tensor, x_in: Inputs, max_k: int | None) -> Tensor:
    """Top-k then top-p per row; rows not sampled keep their raw logits.

    `max_k is None`: candidates are the whole vocabulary, sorted (correct for any k).
    Otherwise: candidates are `torch.topk(logits, max_k)` (the buggy runner's width)."""
    if max_k is None:
        cand = logits.sort(dim=-1, descending=True).values  # [R, V]
        k = x_in.top_k
    else:
        cand = torch.topk(logits, max_k, dim=-1).values  # [R, max_k]
        k = x_in.top_k.clamp(max=max_k)  # a row never asks for more than the width
    width = cand.shape[-1]
    ranks = torch.arange(width, device=logits.device)[None, :]
    in_k = ranks < k[:, None]
    scaled = cand.masked_fill(~in_k, float("-inf")) / x_in.temps[:, None]
    probs = scaled.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the higher-ranked survivors
    in_p = (before < x_in.top_p[:, None]) | (x_in.top_p[:, None] >= 1.0)
    kept = (in_k & in_p).sum(-1).clamp(min=1)  # rank 0 always survives
    threshold = cand.gather(1, (kept - 1)[:, None])  # [R, 1]
    filtered = logits.masked_fill(logits < threshold, float("-inf"))
    return torch.where(x_in.sampled[:, None], filtered, logits)


def sample(filtered: Tensor, x_in: Inputs) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): no generator, nothing baked."""
    pos = x_in.positions if x_in.last is None else x_in.positions[x_in.last]
    key = _hash(_hash(x_in.seeds) ^ ((pos * 0x27D4EB2F) & M32))
    ids = torch.arange(filtered.shape[-1], device=filtered.device)
    bits = _hash(key[:, None] ^ ((ids * 0x165667B1) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25  # in (0, 1)
    gumbel = -torch.log(-torch.log(u))
    noisy = filtered / x_in.temps[:, None] + gumbel
    return torch.where(x_in.sampled, noisy.argmax(-1), filtered.argmax(-1))


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 15) ^ x) * 0x2C1B3C6D) & M32
    x = (((x >> 12) ^ x) * 0x297A2D39) & M32
    return (x >> 15) ^ x


# -- the runner ------------------------------------------------------------------------------------

_PAD: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
    "top_k": VOCAB,
    "top_p": 1.0,
}


def _row(r: Request, pos: int) -> dict[str, Any]:
    table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
    return {
        "tokens": r.tokens[pos - r.context_len],
        "positions": pos,
        "slots": kv_slot(r.block_ids, pos, SPEC.block_size),
        "tables": table,
    }


def _sampling(r: Request) -> dict[str, Any]:
    sampled = r.seed is not None
    return {
        "seeds": (r.seed & M32) if sampled else 0,
        "temps": r.temperature if sampled else 1.0,
        "sampled": sampled,
        "top_k": top_k_of(r),
        "top_p": top_p_of(r),
    }


_DTYPES = {"sampled": torch.bool, "temps": torch.float32, "top_p": torch.float32}


class TopKRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, host_max_k: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.host_max_k = host_max_k  # the bug: candidate width from the batch at hand
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Decoder(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            self.buffers = {
                name: torch.full(
                    (rows, SPEC.max_blocks_per_req) if name == "tables" else (rows,),
                    value,
                    dtype=_DTYPES.get(name, torch.int64),
                    device=dev,
                )
                for name, value in _PAD.items()
            }

    # -- graph path --------------------------------------------------------------------------------

    def _static(self, size: int) -> Inputs:
        return Inputs(**{n: b[:size] for n, b in self.buffers.items()})

    def _prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = [{**_row(r, r.context_len), **_sampling(r)} for r in batch.requests]
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor([row[name] for row in rows], dtype=buf.dtype))
            buf[n:size].fill_(_PAD[name])

    def _replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self._prepare(batch, size)
        if size not in self.graphs:  # lazy capture, on the batch that first needs this size
            inputs = self._static(size)
            max_k = self._max_k(batch)
            self._run(inputs, max_k)  # warm-up outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph):
                self.outputs[size] = self._run(inputs, max_k)
            self.graphs[size] = graph
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes --------------------------------------------------------------------------------

    def _max_k(self, batch: Batch) -> int | None:
        if not self.host_max_k:
            return None
        # Rows without top-k (greedy: k = vocab) count as 1, as vLLM's top-k-only path masks
        # them before taking the max. A host int: baked in when captured.
        ks = [top_k_of(r) for r in batch.requests]
        return max(k if k < VOCAB else 1 for k in ks)

    def _run(self, x_in: Inputs, max_k: int | None) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(x_in, self.k_cache, self.v_cache)
        filtered = filter_logits(logits, x_in, max_k)
        return filtered, sample(filtered, x_in)

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.be.device
        cols: dict[str, list[Any]] = {n: [] for n in _PAD}
        last: list[int] = []
        for r in batch.requests:
            for pos in range(r.context_len, r.seq_len):
                for name, value in _row(r, pos).items():
                    cols[name].append(value)
            last.append(len(cols["tokens"]) - 1)
            for name, value in _sampling(r).items():
                cols[name].append(value)
        t = {
            n: torch.tensor(v, dtype=_DTYPES.get(n, torch.int64), device=dev)
            for n, v in cols.items()
        }
        t["tables"] = t["tables"].view(-1, SPEC.max_blocks_per_req)
        x_in = Inputs(**t, last=torch.tensor(last, dtype=torch.int64, device=dev))
        logits, tokens = self._run(x_in, self._max_k(batch))
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def _fallback(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.query_len != 1 or r.context_len == 0 for r in batch.requests):
            return "not a one-token decode batch"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> TopKRunner:
    return TopKRunner(mode, seed=seed, backend=backend, host_max_k=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> TopKRunner:
    return TopKRunner(mode, seed=seed, backend=backend, host_max_k=True)
