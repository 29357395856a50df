"""A decode-graph runner with a persistent per-request table keyed by req_id.

A one-layer decoder (token + position embeddings, attention over a slot-major paged KV cache read
through block tables, SiLU MLP, LM head) with counter-based Gumbel sampling. Graph mode captures one
decode graph per capture size through the backend facade, largest first, into one shared pool; a
decode batch that fits replays the smallest graph that holds it, anything else runs eagerly.

Both modes keep a host-side table `req_id -> RequestEntry` (sampling seed, temperature and greedy
flag as first seen, plus where the request left off), filled the first time a request is seen and
reused on its later steps, as a serving engine's persistent input batch does. The contract never
says a request finished: the correct variant trusts an entry only when the request continues it
(its context_len advances past the entry's and does not pass the entry's seq_len, its block table
extends the entry's) and rebuilds it otherwise. The buggy variant (`evict_stale=False`) never
evicts or refreshes an entry, so a later request with the same id inherits the old one's sampling
parameters.
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
    max_blocks_per_req=8,
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
D_MODEL, N_HEADS, D_HEAD = 32, 2, 16
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


# -- the model ----------------------------------------------------------------------------------


@dataclass
class Inputs:
    tokens: Tensor  # [T] int64
    positions: Tensor  # [T]
    slots: Tensor  # [T] KV slot written by each token
    tables: Tensor  # [T, max_blocks_per_req] block table of each token's request
    seeds: Tensor  # [R] 32-bit seeds
    temps: Tensor  # [R] float32
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] index of each request's last token; None: T == R


class Model:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "tok": (SPEC.vocab_size, D_MODEL),
            "pos": (MAX_POS, D_MODEL),
            "wq": (D_MODEL, D_MODEL),
            "wk": (D_MODEL, D_MODEL),
            "wv": (D_MODEL, D_MODEL),
            "wo": (D_MODEL, D_MODEL),
            "w1": (D_MODEL, 64),
            "w2": (64, D_MODEL),
            "out": (D_MODEL, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.device = device
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def __call__(self, x_in: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["tok"][x_in.tokens] + w["pos"][x_in.positions]
        h = norm(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, x_in.slots, k.view(-1, N_HEADS, D_HEAD))
        v_cache.index_copy_(0, x_in.slots, v.view(-1, N_HEADS, D_HEAD))
        bs = SPEC.block_size
        ctx = (x_in.tables[:, :, None] * bs + torch.arange(bs, device=x.device)).flatten(1)
        keys, vals = k_cache[ctx], v_cache[ctx]  # [T, MAX_POS, H, D]
        mask = torch.arange(MAX_POS, device=x.device)[None, :] <= x_in.positions[:, None]
        s = torch.einsum("thd,tchd->thc", q.view(-1, N_HEADS, D_HEAD), keys) / math.sqrt(D_HEAD)
        p = s.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(mask[:, :, None, None], vals, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", p, vals).flatten(1) @ w["wo"]
        x = x + torch.nn.functional.silu(norm(x) @ w["w1"]) @ w["w2"]
        if x_in.last is not None:
            x = x[x_in.last]
        return norm(x) @ w["out"]


def norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def sample(logits: Tensor, x_in: Inputs) -> Tensor:
    """Gumbel-max, noise from hash(seed, position of the last query token, token id)."""
    pos = x_in.positions if x_in.last is None else x_in.positions[x_in.last]
    key = hash32(hash32(x_in.seeds) ^ ((pos * 0x9E3779B1) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = hash32(key[:, None] ^ ((ids * 0x7FEB352D) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / x_in.temps[:, None] - torch.log(-torch.log(u))
    return torch.where(x_in.sampled, noisy.argmax(-1), logits.argmax(-1))


# -- the per-request table ----------------------------------------------------------------------


@dataclass
class RequestEntry:
    seed: int
    temp: float
    sampled: bool
    context_len: int  # where the request's last step started
    seq_len: int  # where it left off
    block_ids: tuple[int, ...]


def entry_for(request: Request) -> RequestEntry:
    sampled = request.seed is not None
    return RequestEntry(
        seed=(request.seed & M32) if sampled else 0,
        temp=float(request.temperature) if sampled else 1.0,
        sampled=sampled,
        context_len=request.context_len,
        seq_len=request.seq_len,
        block_ids=tuple(request.block_ids),
    )


def continues(entry: RequestEntry, request: Request) -> bool:
    """Whether `request` is the same request as the one `entry` was made for, a step later."""
    if not entry.context_len < request.context_len <= entry.seq_len:
        return False
    covered = -(-entry.seq_len // SPEC.block_size)
    return tuple(request.block_ids[:covered]) == entry.block_ids[:covered]


# -- the runner ---------------------------------------------------------------------------------

PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
}


class Runner:
    def __init__(self, mode: str, *, seed: int, backend: str, evict_stale: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.evict_stale = evict_stale
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        self.k = torch.zeros(SPEC.num_slots, N_HEADS, D_HEAD, device=dev)
        self.v = torch.zeros(SPEC.num_slots, N_HEADS, D_HEAD, device=dev)
        self.table: dict[int, RequestEntry] = {}
        self.graphs: dict[int, Any] = {}
        self.outs: dict[int, tuple[Tensor, Tensor]] = {}
        self.bufs: dict[str, Tensor] = {}
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            i64 = torch.int64
            self.bufs = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.zeros(rows, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(rows, dtype=i64, device=dev),
                "temps": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
            }
            self._capture()

    # per-request bookkeeping (both modes)

    def lookup(self, request: Request) -> RequestEntry:
        entry = self.table.get(request.req_id)
        if entry is None or (self.evict_stale and not continues(entry, request)):
            entry = self.table[request.req_id] = entry_for(request)
        else:
            entry.context_len, entry.seq_len = request.context_len, request.seq_len
            entry.block_ids = tuple(request.block_ids)
        return entry

    # graph mode

    def _static(self, size: int) -> Inputs:
        b = self.bufs
        return Inputs(
            b["tokens"][:size],
            b["positions"][:size],
            b["slots"][:size],
            b["tables"][:size],
            b["seeds"][:size],
            b["temps"][:size],
            b["sampled"][:size],
        )

    def _forward(self, x_in: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model(x_in, self.k, self.v)
        return logits, sample(logits, x_in)

    def _capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._write_rows([], [], size)
            x_in = self._static(size)
            self._forward(x_in)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outs[size] = self._forward(x_in)
            self.graphs[size] = g

    def _write_rows(
        self, reqs: Sequence[Request], entries: Sequence[RequestEntry], size: int
    ) -> None:
        n = len(reqs)
        rows: dict[str, list[Any]] = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [slot_of(r, r.context_len) for r in reqs],
            "tables": [table_of(r) for r in reqs],
            "seeds": [e.seed for e in entries],
            "temps": [e.temp for e in entries],
            "sampled": [e.sampled for e in entries],
        }
        for name, buf in self.bufs.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[n:size].fill_(PAD[name])

    def _replay(self, batch: Batch, entries: list[RequestEntry]) -> StepResult:
        n = batch.num_reqs
        size = next(s for s in SPEC.capture_sizes if s >= n)
        self._write_rows(batch.requests, entries, size)
        self.graphs[size].replay()
        logits, toks = self.outs[size]
        return StepResult(logits[:n].clone(), toks[:n].clone(), "full", ("decode", size))

    def _eager(self, batch: Batch, entries: list[RequestEntry], reason: str) -> StepResult:
        dev = self.be.device
        toks, pos, slots, tabs, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                toks.append(t)
                pos.append(r.context_len + i)
                slots.append(slot_of(r, r.context_len + i))
                tabs.append(table_of(r))
            last.append(len(toks) - 1)
        i64 = torch.int64
        x_in = Inputs(
            torch.tensor(toks, dtype=i64, device=dev),
            torch.tensor(pos, dtype=i64, device=dev),
            torch.tensor(slots, dtype=i64, device=dev),
            torch.tensor(tabs, dtype=i64, device=dev).view(-1, SPEC.max_blocks_per_req),
            torch.tensor([e.seed for e in entries], dtype=i64, device=dev),
            torch.tensor([e.temp for e in entries], dtype=torch.float32, device=dev),
            torch.tensor([e.sampled for e in entries], dtype=torch.bool, device=dev),
            torch.tensor(last, dtype=i64, device=dev),
        )
        logits, next_tokens = self._forward(x_in)
        return StepResult(logits, next_tokens, "eager", None, reason=reason)

    def _why_eager(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "batch above the largest capture size"
        return None

    # the contract

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            dev = self.be.device
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=dev),
                torch.zeros(0, dtype=torch.int64, device=dev),
                "eager",
                None,
                reason="empty batch",
            )
        entries = [self.lookup(r) for r in batch.requests]
        reason = self._why_eager(batch)
        if reason is None:
            return self._replay(batch, entries)
        return self._eager(batch, entries, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k, "v": self.v}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.bufs

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outs.clear()
        self.table.clear()


def slot_of(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def table_of(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, backend=backend, evict_stale=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, backend=backend, evict_stale=False)
