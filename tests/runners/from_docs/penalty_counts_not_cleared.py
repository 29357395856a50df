"""A graph runner with a repetition penalty kept in persistent per-slot device counts.

Model: two-layer multi-query decoder (4 query heads share one key/value head), ALiBi distance
bias instead of position embeddings, squared-ReLU MLP, LM head tied to the embedding, float32.
The sampler subtracts a frequency penalty (FREQ per earlier occurrence) and a presence penalty
(PRES once) from the logits of every token the runner has already *produced* for the request
since it was (re)started (`context_len == 0`); the returned logits are the penalised ones, and
greedy and sampled rows both see them. Semantics are the same in both modes.

Bookkeeping (both modes, host side, deterministic): a `SlotTable` hands each request a
persistent slot of `counts` ([NUM_PEN_SLOTS + 1, vocab] int32, the last row a dummy slot for
padding) when it is admitted (first seen, or seen again with `context_len == 0`: a new request
under a known id, or a preempted one recomputing), freeing the slot it held before; slots are
taken lowest-free-first, and when none is free the least recently scheduled request outside the
batch loses its slot. Each row carries its slot and a `fresh` flag; the forward clears a fresh
row's counts, gathers the counts by slot, applies the penalty, samples, and writes the counts
back with the produced token added (padding rows: dummy slot, weight 0, written back unchanged).
Graph mode (backend facade) captures a decode graph per capture size lazily, the first time a
batch needs it, in one shared pool; the gather, clear and update of the counts run in the graph,
through the static `pen_slot` / `fresh` / `valid` buffers. Batches with a query longer than one
token and oversized ones run eagerly with the same forward; one-token prompts replay.

make_target:        every admission (new or recycled slot) sets the row's `fresh` flag.
make_buggy_target:  the graph twin (its replays and its eager fallbacks alike) sets `fresh` only
                    for slots handed out for the first time (it assumes a recycled slot was
                    cleared when its previous request left, which nothing does), so a request
                    that takes a recycled slot inherits the previous occupant's counts. The eager
                    twin keeps clearing, as per-request-id state does.
"""

from __future__ import annotations

import heapq
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
    vocab_size=80,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, QHEADS, HEAD_DIM, LAYERS, FFN = 48, 4, 12, 2, 96
NUM_PEN_SLOTS = 8 * SPEC.max_num_reqs  # live requests never exceed 2 * max_num_reqs
DUMMY = NUM_PEN_SLOTS  # the padding rows' slot of `counts`
FREQ, PRES = 1.5, 2.0  # logits are O(3): a repeated top token loses its place
LOGIT_SCALE = 3.0
NULL_SLOT = SPEC.null_block * SPEC.block_size
MASK32 = 0xFFFFFFFF
ALIBI = [2.0 ** (-(h + 1)) for h in range(QHEADS)]


# ---------------------------------------------------------------------------------------------
# Persistent penalty slots
@dataclass
class _Entry:
    slot: int
    seq_len: int  # where the request's next step must continue
    last_used: int


class SlotTable:
    """req_id -> slot of the counts tensor, lowest free slot first, LRU eviction when full."""

    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots))
        heapq.heapify(self.free)
        self.entries: dict[int, _Entry] = {}
        self.handed_out: set[int] = set()  # slots given to some request at least once
        self.clock = 0

    def _take(self, keep: set[int]) -> int:
        if not self.free:
            victims = [(e.last_used, rid) for rid, e in self.entries.items() if rid not in keep]
            _, rid = min(victims)
            heapq.heappush(self.free, self.entries.pop(rid).slot)
        return heapq.heappop(self.free)

    def assign(self, batch: Batch) -> list[tuple[int, bool, bool]]:
        """Per row: (slot, fresh, recycled). Fresh: the request is (re)admitted this step."""
        self.clock += 1
        ids = {r.req_id for r in batch.requests}
        out = []
        for r in batch.requests:
            e = self.entries.get(r.req_id)
            if e is not None and r.context_len > 0 and r.context_len == e.seq_len:
                e.seq_len, e.last_used = r.seq_len, self.clock
                out.append((e.slot, False, False))
                continue
            if e is not None:  # a new request under a known id, or a preempted one
                heapq.heappush(self.free, self.entries.pop(r.req_id).slot)
            slot = self._take(ids)
            recycled = slot in self.handed_out
            self.handed_out.add(slot)
            self.entries[r.req_id] = _Entry(slot, r.seq_len, self.clock)
            out.append((slot, True, recycled))
        return out


# ---------------------------------------------------------------------------------------------
# Model
@dataclass
class Inputs:
    tokens: Tensor  # [T] int64
    positions: Tensor  # [T]
    kv_slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R] int64
    temps: Tensor  # [R] float32
    sampled: Tensor  # [R] bool
    pen_slot: Tensor  # [R] int64, row -> slot of `counts`
    fresh: Tensor  # [R] bool, clear the slot's counts first
    valid: Tensor  # [R] bool, add the produced token to the counts
    last: Tensor | None = None  # [R] the row's last query token (None: one token a row)


def rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5)


def mix32(x: Tensor) -> Tensor:
    """lowbias32 integer hash on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes: dict[str, tuple[int, ...]] = {"embed": (SPEC.vocab_size, HIDDEN)}
        for i in range(LAYERS):
            shapes[f"q{i}"] = (HIDDEN, QHEADS * HEAD_DIM)
            shapes[f"kv{i}"] = (HIDDEN, 2 * HEAD_DIM)
            shapes[f"o{i}"] = (QHEADS * HEAD_DIM, HIDDEN)
            shapes[f"up{i}"] = (HIDDEN, FFN)
            shapes[f"down{i}"] = (FFN, HIDDEN)
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.slopes = torch.tensor(ALIBI, device=device)
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(1000 + seed)
        for name in sorted(self.w):
            t = self.w[name]
            scale = 1.0 if name == "embed" else 1.0 / math.sqrt(t.shape[0])
            t.copy_((torch.randn(t.shape, generator=gen) * scale).to(t.device))

    def hidden(self, inp: Inputs, kv: list[tuple[Tensor, Tensor]]) -> Tensor:
        w = self.w
        x = w["embed"][inp.tokens]
        bs = SPEC.block_size
        dev = x.device
        ctx_slots = (inp.tables[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)
        ctx_pos = torch.arange(ctx_slots.shape[1], device=dev)
        visible = ctx_pos[None, :] <= inp.positions[:, None]  # [T, C]
        dist = (inp.positions[:, None] - ctx_pos[None, :]).float()  # [T, C]
        bias = -self.slopes[None, :, None] * dist[:, None, :]  # [T, H, C]
        for i, (kc, vc) in enumerate(kv):
            h = rms(x)
            q = (h @ w[f"q{i}"]).view(-1, QHEADS, HEAD_DIM)
            k, v = (h @ w[f"kv{i}"]).split(HEAD_DIM, dim=-1)
            kc.index_copy_(0, inp.kv_slots, k)
            vc.index_copy_(0, inp.kv_slots, v)
            keys, vals = kc[ctx_slots], vc[ctx_slots]  # [T, C, D]
            scores = torch.einsum("thd,tcd->thc", q, keys) / math.sqrt(HEAD_DIM) + bias
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            vals = torch.where(visible[:, :, None], vals, torch.zeros((), device=dev))
            att = torch.einsum("thc,tcd->thd", torch.softmax(scores, dim=-1), vals)
            x = x + att.reshape(-1, QHEADS * HEAD_DIM) @ w[f"o{i}"]
            x = x + torch.relu(rms(x) @ w[f"up{i}"]).square() @ w[f"down{i}"]
        return x if inp.last is None else x[inp.last]

    def forward(
        self, inp: Inputs, kv: list[tuple[Tensor, Tensor]], counts: Tensor
    ) -> tuple[Tensor, Tensor]:
        h = self.hidden(inp, kv)
        raw = rms(h) @ self.w["embed"].t() * (LOGIT_SCALE / math.sqrt(HIDDEN))
        seen = counts[inp.pen_slot] * (~inp.fresh).to(counts.dtype)[:, None]  # [R, V]
        logits = raw - FREQ * seen.float() - PRES * (seen > 0).float()
        tokens = sample(logits, inp)
        vocab = torch.arange(SPEC.vocab_size, device=logits.device)
        produced = ((vocab[None, :] == tokens[:, None]) & inp.valid[:, None]).to(counts.dtype)
        counts.index_copy_(0, inp.pen_slot, seen + produced)
        return logits, tokens


def sample(logits: Tensor, inp: Inputs) -> Tensor:
    """Gumbel-max with noise hashed from (seed, last query position, token id)."""
    pos = inp.positions if inp.last is None else inp.positions[inp.last]
    key = mix32((inp.seeds & MASK32) ^ mix32(pos + 0x3C6EF372))
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    bits = mix32(key[:, None] ^ ((vocab + 1) * 0x9E3779B9 & MASK32)[None, :])
    u = ((bits >> 8).float() + 0.5) * 2.0**-24
    noisy = logits / inp.temps[:, None] - torch.log(-torch.log(u))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


# ---------------------------------------------------------------------------------------------
# Runner
def kv_slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def padded_table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def sampling(r: Request) -> tuple[int, float, bool]:
    return (0, 1.0, False) if r.seed is None else (int(r.seed), float(r.temperature), True)


# name -> (dtype, per-row width or None, padding value)
BUFFERS: dict[str, tuple[torch.dtype, int | None, Any]] = {
    "tokens": (torch.int64, None, 0),
    "positions": (torch.int64, None, 0),
    "kv_slots": (torch.int64, None, NULL_SLOT),
    "tables": (torch.int64, SPEC.max_blocks_per_req, SPEC.null_block),
    "seeds": (torch.int64, None, 0),
    "temps": (torch.float32, None, 1.0),
    "sampled": (torch.bool, None, False),
    "pen_slot": (torch.int64, None, DUMMY),
    "fresh": (torch.bool, None, False),
    "valid": (torch.bool, None, False),
}


class PenaltyRunner:
    def __init__(
        self,
        mode: str,
        *,
        seed: int,
        backend: str,
        buggy: bool,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode must be 'graph' or 'eager', not {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.buggy = buggy
        self.be: Any = get_backend(backend)
        dev = self.dev = self.be.device
        self.model = Model(seed, dev)
        self.kv = [
            (
                torch.zeros(SPEC.num_slots, HEAD_DIM, device=dev),
                torch.zeros(SPEC.num_slots, HEAD_DIM, device=dev),
            )
            for _ in range(LAYERS)
        ]
        self.dummy = NUM_PEN_SLOTS
        self.counts = torch.zeros(NUM_PEN_SLOTS + 1, SPEC.vocab_size, dtype=torch.int32, device=dev)
        self.slots = SlotTable(NUM_PEN_SLOTS)
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.pool: Any = None
        if mode == "graph":
            n = SPEC.capture_sizes[-1]
            for name, (dtype, width, _) in BUFFERS.items():
                shape = (n,) if width is None else (n, width)
                self.buffers[name] = torch.zeros(shape, dtype=dtype, device=dev)
            self.pool = self.be.graph_pool_handle()

    # -- graph path ----------------------------------------------------------------------------
    def _graph_size(self, batch: Batch) -> int | None:
        # one query token a row, whether it continues a request or is a one-token prompt: a
        # decode graph serves both (so admissions happen in replays too)
        if self.mode != "graph" or not batch.requests or batch.num_tokens != batch.num_reqs:
            return None
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    def _static(self, size: int) -> Inputs:
        return Inputs(**{k: b[:size] for k, b in self.buffers.items()})

    def _stage(self, batch: Batch, rows: list[tuple[int, bool, bool]], size: int) -> None:
        """Write the batch into the first rows of every static buffer, padding into the rest."""
        values: dict[str, list[Any]] = {k: [] for k in BUFFERS}
        for r, (slot, fresh, recycled) in zip(batch.requests, rows, strict=True):
            seed, temp, sampled = sampling(r)
            values["tokens"].append(r.tokens[0])
            values["positions"].append(r.context_len)
            values["kv_slots"].append(kv_slot(r, r.context_len))
            values["tables"].append(padded_table(r))
            values["seeds"].append(seed)
            values["temps"].append(temp)
            values["sampled"].append(sampled)
            values["pen_slot"].append(slot)
            values["fresh"].append(self._clears(fresh, recycled))
            values["valid"].append(True)
        for name, (dtype, width, pad) in BUFFERS.items():
            pad = self.dummy if name == "pen_slot" else pad
            rows_ = values[name] + [pad if width is None else [pad] * width] * (
                size - batch.num_reqs
            )
            self.buffers[name][:size].copy_(torch.tensor(rows_, dtype=dtype))

    def _capture(self, size: int) -> None:
        self._stage(Batch(()), [], size)  # all padding: dummy slot, null block
        inp = self._static(size)
        self._forward(inp)  # warm-up
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            self.outputs[size] = self._forward(inp)
        self.graphs[size] = graph

    def _replay(self, batch: Batch, size: int) -> StepResult:
        if size not in self.graphs:
            self._capture(size)
        rows = self.slots.assign(batch)
        self._stage(batch, rows, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ----------------------------------------------------------------------------
    def _clears(self, fresh: bool, recycled: bool) -> bool:
        """Whether a row's slot counts are cleared before the gather."""
        if self.buggy and self.mode == "graph":
            # BUG: the graph runner's persistent batch assumes a recycled slot was cleared when
            # its previous request left (nothing does); only never-used slots are cleared.
            return fresh and not recycled
        return fresh  # every admission starts from zero counts, as per-request-id state does

    def _forward(self, inp: Inputs) -> tuple[Tensor, Tensor]:
        return self.model.forward(inp, self.kv, self.counts)

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        rows = self.slots.assign(batch)
        tok, pos, kvs, tab, last = [], [], [], [], []
        for r in batch.requests:
            for j, t in enumerate(r.tokens):
                tok.append(t)
                pos.append(r.context_len + j)
                kvs.append(kv_slot(r, r.context_len + j))
                tab.append(padded_table(r))
            last.append(len(tok) - 1)
        samp = [sampling(r) for r in batch.requests]

        def dev(v: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(v, dtype=dtype, device=self.dev)

        inp = Inputs(
            tokens=dev(tok),
            positions=dev(pos),
            kv_slots=dev(kvs),
            tables=dev(tab).view(-1, SPEC.max_blocks_per_req),
            seeds=dev([s[0] for s in samp]),
            temps=dev([s[1] for s in samp], torch.float32),
            sampled=dev([s[2] for s in samp], torch.bool),
            pen_slot=dev([s for s, _, _ in rows]),
            fresh=dev([self._clears(f, rc) for _, f, rc in rows], torch.bool),
            valid=dev([True] * batch.num_reqs, torch.bool),
            last=dev(last),
        )
        logits, tokens = self._forward(inp)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        if not batch.requests:
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=self.dev),
                torch.zeros(0, dtype=torch.int64, device=self.dev),
                "eager",
                None,
                reason="empty batch",
            )
        size = self._graph_size(batch)
        if size is not None:
            return self._replay(batch, size)
        if self.mode == "eager":
            reason = "eager twin"
        elif batch.num_tokens != batch.num_reqs:
            reason = f"{batch.phase} batch with queries longer than one token"
        else:
            reason = "above the largest capture size"
        return self._eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        out = {f"{n}{i}": kv[j] for i, kv in enumerate(self.kv) for j, n in enumerate("kv")}
        out["penalty_counts"] = self.counts
        return out

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PenaltyRunner:
    return PenaltyRunner(mode, seed=seed, backend=backend, buggy=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PenaltyRunner:
    return PenaltyRunner(mode, seed=seed, backend=backend, buggy=True)
