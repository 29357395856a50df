"""A graph runner with a lazily grown rotary (RoPE) cos/sin cache.

Two-layer decoder, float32, rotary position embeddings from a cos/sin cache the runner builds
lazily: it covers INITIAL_ROPE positions at construction and grows whenever a batch holds a
position past the cached length (as engines with dynamic/scaled rotary embeddings recompute their
tables for a longer sequence). Both twins grow it the same way, at the start of their own step.
Graph mode (backend facade) captures one decode graph per capture size at start-up; the gather of
the cos/sin rows by the positions static buffer is inside the graph.

make_target:        the tables are allocated at full length (max_blocks_per_req * block_size) at
                    construction and filled in place as the context grows.
make_buggy_target:  growth builds new tensors and rebinds the attributes, so graphs captured
                    before the growth keep reading the old, shorter (freed) tables.
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
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 2, 16, 2
HALF = HEAD_DIM // 2
MAX_POSITIONS = SPEC.max_blocks_per_req * SPEC.block_size  # 32
INITIAL_ROPE = 8
ROPE_BASE = 10000.0
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


def rope_rows(start: int, stop: int) -> tuple[Tensor, Tensor]:
    """cos/sin rows for positions [start, stop) on the host, each element computed on its own in
    float64 (so a row's bits never depend on which range it was computed in)."""
    inv = [ROPE_BASE ** (-2.0 * i / HEAD_DIM) for i in range(HALF)]
    cos = [[math.cos(p * f) for f in inv] for p in range(start, stop)]
    sin = [[math.sin(p * f) for f in inv] for p in range(start, stop)]
    return torch.tensor(cos, dtype=torch.float32), torch.tensor(sin, dtype=torch.float32)


class RopeCache:
    """Lazily grown cos/sin tables [positions, HEAD_DIM / 2]."""

    def __init__(self, device: torch.device, *, rebind_on_growth: bool) -> None:
        self.device = device
        self.rebind_on_growth = rebind_on_growth
        self.length = INITIAL_ROPE
        cos, sin = rope_rows(0, INITIAL_ROPE)
        if self.rebind_on_growth:  # BUG: tables only as long as the context seen so far
            self.cos, self.sin = cos.to(device), sin.to(device)
        else:  # full-length storage, filled as the context grows
            self.cos = torch.zeros(MAX_POSITIONS, HALF, device=device)
            self.sin = torch.zeros(MAX_POSITIONS, HALF, device=device)
            self.cos[:INITIAL_ROPE].copy_(cos)
            self.sin[:INITIAL_ROPE].copy_(sin)

    def ensure(self, positions: int) -> None:
        """Cover positions [0, positions)."""
        if positions <= self.length:
            return
        new_length = min(MAX_POSITIONS, max(positions, 2 * self.length))
        if self.rebind_on_growth:  # BUG: new tensors; captured graphs keep the old ones
            cos, sin = rope_rows(0, new_length)
            self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        else:
            cos, sin = rope_rows(self.length, new_length)
            self.cos[self.length : new_length].copy_(cos)
            self.sin[self.length : new_length].copy_(sin)
        self.length = new_length

    def apply(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x [T, heads, dim] (NeoX halves); the gather by positions runs in the graph."""
        cos = self.cos[positions][:, None, :]  # [T, 1, HALF]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x[..., :HALF], x[..., HALF:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] (None: one token per request)


class Model:
    def __init__(self, seed: int, device: torch.device, rope: RopeCache) -> None:
        self.rope = rope
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        for i in range(LAYERS):
            shapes[f"wqkv{i}"] = (HIDDEN, 3 * HIDDEN)
            shapes[f"wo{i}"] = (HIDDEN, HIDDEN)
            shapes[f"w1{i}"] = (HIDDEN, 2 * HIDDEN)
            shapes[f"w2{i}"] = (2 * HIDDEN, HIDDEN)
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(t.device))

    def forward(self, inp: Inputs, kv: list[tuple[Tensor, Tensor]]) -> Tensor:
        w = self.w
        x = w["embed"][inp.tokens]
        for i, (kc, vc) in enumerate(kv):
            q, k, v = (norm(x) @ w[f"wqkv{i}"]).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
            q = self.rope.apply(q, inp.positions)
            k = self.rope.apply(k, inp.positions)
            kc.index_copy_(0, inp.slots, k)
            vc.index_copy_(0, inp.slots, v)
            x = x + paged_attention(q, kc, vc, inp) @ w[f"wo{i}"]
            x = x + torch.nn.functional.gelu(norm(x) @ w[f"w1{i}"]) @ w[f"w2{i}"]
        if inp.last is not None:
            x = x[inp.last]
        return norm(x) @ w["lm_head"]


def norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)


def paged_attention(q: Tensor, kc: Tensor, vc: Tensor, inp: Inputs) -> Tensor:
    bs = SPEC.block_size
    slot_ids = (inp.tables.unsqueeze(-1) * bs + torch.arange(bs, device=q.device)).flatten(1)
    keys, vals = kc[slot_ids], vc[slot_ids]  # [T, C, H, D]
    ctx_pos = torch.arange(slot_ids.shape[1], device=q.device)
    ok = ctx_pos[None, :] <= inp.positions[:, None]  # [T, C]
    s = torch.einsum("thd,tchd->thc", q, keys) * (1.0 / math.sqrt(HEAD_DIM))
    p = torch.softmax(s.masked_fill(~ok[:, None, :], float("-inf")), dim=-1)
    vals = torch.where(ok[:, :, None, None], vals, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", p, vals).reshape(-1, HIDDEN)


def hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def sample(logits: Tensor, inp: Inputs) -> Tensor:
    pos = inp.positions if inp.last is None else inp.positions[inp.last]
    key = hash32(hash32(inp.seeds) ^ ((pos * 0x61C88647) & M32))
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    bits = hash32(key[:, None] ^ ((vocab * 0x7FEB352D) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    gumbel = -torch.log(-torch.log(u))
    noisy = logits / inp.temperatures[:, None] + gumbel
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def slot_of(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def table_of(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def sampling_of(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


class RopeRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, buggy: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"bad mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.rope = RopeCache(dev, rebind_on_growth=buggy)
        self.model = Model(seed, dev, self.rope)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = [
            (torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)) for _ in range(LAYERS)
        ]
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            n, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.zeros(n, dtype=i64, device=dev),
                "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(n, dtype=i64, device=dev),
                "temperatures": torch.ones(n, device=dev),
                "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
            }
            self.capture_all()

    # graph mode
    def view(self, size: int) -> Inputs:
        return Inputs(**{k: b[:size] for k, b in self.buffers.items()})

    def capture_all(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.fill(Batch(()), size)
            inp = self.view(size)
            self.forward(inp)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[size] = self.forward(inp)
            self.graphs[size] = g

    def fill(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        samp = [sampling_of(r) for r in reqs]
        rows: dict[str, list[Any]] = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [slot_of(r, r.context_len) for r in reqs],
            "tables": [table_of(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temperatures": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[n:size].fill_(PAD[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.fill(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # both modes
    def forward(self, inp: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, self.kv)
        return logits, sample(logits, inp)

    def eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.be.device
        toks, pos, slots, tabs, last = [], [], [], [], []
        for r in batch.requests:
            for j, t in enumerate(r.tokens):
                p = r.context_len + j
                toks.append(t)
                pos.append(p)
                slots.append(slot_of(r, p))
                tabs.append(table_of(r))
            last.append(len(toks) - 1)
        samp = [sampling_of(r) for r in batch.requests]

        def t(v: list[Any], dt: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(v, dtype=dt, device=dev)

        inp = Inputs(
            t(toks),
            t(pos),
            t(slots),
            t(tabs).view(-1, SPEC.max_blocks_per_req),
            t([s[0] for s in samp]),
            t([s[1] for s in samp], torch.float32),
            t([s[2] for s in samp], torch.bool),
            t(last),
        )
        logits, tokens = self.forward(inp)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def why_eager(self, batch: Batch) -> str | None:
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
        if batch.requests:  # grow the rotary cache before any computation of this step
            self.rope.ensure(max(r.seq_len for r in batch.requests))
        reason = self.why_eager(batch)
        return self.replay(batch) if reason is None else self.eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{n}{i}": kv[j] for i, kv in enumerate(self.kv) for j, n in enumerate("kv")}

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RopeRunner:
    return RopeRunner(mode, seed=seed, backend=backend, buggy=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RopeRunner:
    return RopeRunner(mode, seed=seed, backend=backend, buggy=True)
