"""A FlashInfer-style decode runner: attention metadata comes from a planner object.

Graph mode (through the backend facade) captures one decode graph per capture size, largest first,
into one shared pool. Before a replay, the runner writes the per-token inputs (tokens, positions,
sampling parameters) into its static buffers and asks the planner to `plan(batch, size)`: the
planner computes each row's sequence length, block-table row and slot on the host and uploads them
into its own device buffers, which the captured graph reads. Everything else runs eagerly.

`make_buggy_target` caches the planner's work by padded shape: it re-plans only when the graph size
differs from the last one planned (the bug). `make_target` plans every step.
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
    vocab_size=128,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_CTX = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# model


class Model:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "emb": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_CTX, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "w1": (HIDDEN, 2 * HIDDEN),
            "w2": (2 * HIDDEN, HIDDEN),
            "lm": (HIDDEN, SPEC.vocab_size),
        }
        self.device = device
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(int(seed))
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def forward(
        self,
        tokens: Tensor,  # [T]
        positions: Tensor,  # [T]
        slots: Tensor,  # [T]
        tables: Tensor,  # [T, max_blocks]
        limits: Tensor,  # [T] number of context positions visible to each token
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        w = self.w
        x = w["emb"][tokens] + w["pos"][positions]
        h = norm(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=tokens.device)
        ctx = (tables[:, :, None] * SPEC.block_size + offs).flatten(1)  # [T, MAX_CTX]
        keys, vals = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(MAX_CTX, device=tokens.device)[None, :] < limits[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = scores / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = scores.softmax(-1)
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=vals.device))
        att = torch.einsum("thc,tchd->thd", probs, vals).reshape(-1, HIDDEN)
        x = x + att @ w["wo"]
        x = x + torch.nn.functional.silu(norm(x) @ w["w1"]) @ w["w2"]
        return norm(x) @ w["lm"]


def norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def hash32(x: Tensor) -> Tensor:
    x = x & M32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def sample(
    logits: Tensor, seeds: Tensor, positions: Tensor, temps: Tensor, do_sample: Tensor
) -> Tensor:
    """Gumbel-max with noise from hash(seed, position, token id)."""
    key = hash32(hash32(seeds) ^ ((positions * 0x61C88647) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = hash32(key[:, None] ^ ((ids * 0x9E3779B1) & M32)[None, :])
    u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(do_sample, noisy.argmax(-1), logits.argmax(-1))


def slot_of(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def table_of(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def sampling_of(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


# ---------------------------------------------------------------------------------------------
# the planner (FlashInfer-style: plan() computes and uploads metadata into its own buffers)


class DecodePlanner:
    def __init__(self, rows: int, device: Any) -> None:
        i64 = torch.int64
        self.seq_lens = torch.ones(rows, dtype=i64, device=device)
        self.tables = torch.full(
            (rows, SPEC.max_blocks_per_req), SPEC.null_block, dtype=i64, device=device
        )
        self.slots = torch.full((rows,), NULL_SLOT, dtype=i64, device=device)
        self.planned_size: int | None = None

    def plan(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        pad = size - len(reqs)
        seq_lens = [r.seq_len for r in reqs] + [1] * pad
        tables = [table_of(r) for r in reqs] + [[SPEC.null_block] * SPEC.max_blocks_per_req] * pad
        slots = [slot_of(r, r.context_len) for r in reqs] + [NULL_SLOT] * pad
        self.seq_lens[:size].copy_(torch.tensor(seq_lens, dtype=torch.int64))
        self.tables[:size].copy_(torch.tensor(tables, dtype=torch.int64).view(size, -1))
        self.slots[:size].copy_(torch.tensor(slots, dtype=torch.int64))
        self.planned_size = size

    def views(self, size: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.seq_lens[:size], self.tables[:size], self.slots[:size]


# ---------------------------------------------------------------------------------------------
# the runner


class PlannedRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, cache_plan_by_shape: bool) -> None:
        self.spec = SPEC
        self.mode = mode
        self.cache_plan_by_shape = cache_plan_by_shape
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.device = dev
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            i64 = torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "seeds": torch.zeros(rows, dtype=i64, device=dev),
                "temperatures": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
            }
            self.planner = DecodePlanner(rows, dev)
            self.capture()

    # graph mode

    def write_inputs(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        samp = [sampling_of(r) for r in reqs]
        values = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "seeds": [s[0] for s in samp],
            "temperatures": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        padding = {"tokens": 0, "positions": 0, "seeds": 0, "temperatures": 1.0, "sampled": False}
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(values[name], dtype=buf.dtype))
            buf[n:size].fill_(padding[name])

    def plan(self, batch: Batch, size: int) -> None:
        if self.cache_plan_by_shape and self.planner.planned_size == size:
            return  # BUG: same padded shape, metadata assumed unchanged
        self.planner.plan(batch, size)

    def graph_forward(self, size: int) -> tuple[Tensor, Tensor]:
        b = {k: v[:size] for k, v in self.buffers.items()}
        seq_lens, tables, slots = self.planner.views(size)
        logits = self.model.forward(
            b["tokens"], b["positions"], slots, tables, seq_lens, self.k_cache, self.v_cache
        )
        return logits, sample(logits, b["seeds"], b["positions"], b["temperatures"], b["sampled"])

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            empty = Batch(())
            self.write_inputs(empty, size)
            self.planner.plan(empty, size)
            self.graph_forward(size)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[size] = self.graph_forward(size)
            self.graphs[size] = g
        self.planner.planned_size = None  # capture planned dummy (all-padding) batches only

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.write_inputs(batch, size)
        self.plan(batch, size)
        self.graphs[size].replay()
        logits, toks = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), toks[:n].clone(), "full", ("decode", size))

    # eager

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        toks, pos, slots, tables, limits, last = [], [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                p = r.context_len + i
                toks.append(t)
                pos.append(p)
                slots.append(slot_of(r, p))
                tables.append(table_of(r))
                limits.append(p + 1)
            last.append(len(toks) - 1)
        samp = [sampling_of(r) for r in batch.requests]
        dev = self.device

        def t(v: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(v, dtype=dtype, device=dev)

        positions = t(pos)
        logits = self.model.forward(
            t(toks),
            positions,
            t(slots),
            t(tables).view(-1, SPEC.max_blocks_per_req),
            t(limits),
            self.k_cache,
            self.v_cache,
        )
        idx = t(last)
        logits = logits[idx]
        tokens = sample(
            logits,
            t([s[0] for s in samp]),
            positions[idx],
            t([s[1] for s in samp], torch.float32),
            t([s[2] for s in samp], torch.bool),
        )
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode != "graph":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "larger than the largest capture size"
        return None

    # contract

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PlannedRunner:
    return PlannedRunner(mode, seed=seed, backend=backend, cache_plan_by_shape=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PlannedRunner:
    return PlannedRunner(mode, seed=seed, backend=backend, cache_plan_by_shape=True)
