"""A graph runner with multi-LoRA served from fewer device slots than adapters.

One-layer decoder over a slot-major paged KV cache; LoRA on the q and v projections. The spec
serves NUM_ADAPTERS adapters, but only MAX_LORAS of them live on the device at once, stacked in
`lora_a` [MAX_LORAS + 1, 2, HIDDEN, RANK] and `lora_b` [MAX_LORAS + 1, 2, RANK, HIDDEN]; stack slot
0 is all zeros (the base model). Before a step the adapters its batch needs are loaded into slots,
evicting the least recently used ones that this batch does not need; a batch needing more
adapters than slots runs eagerly with a temporary stack. Graph mode captures one decode graph per
capture size at start-up (backend facade), each reading the per-row slot index from a static
buffer. `make_buggy_target` rebuilds the stacks on a load (torch.stack) instead of copying the
adapter into its slot in place, so graphs captured earlier keep reading the old stacks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

NUM_ADAPTERS = 6
MAX_LORAS = 2  # device slots for adapters (plus the zero slot 0 for the base)
SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset(
        {"decode", "prefill", "spec_decode", "sampling", "adapters", "weight_update"}
    ),
    num_adapters=NUM_ADAPTERS,
)
HIDDEN, HEADS, HEAD_DIM, RANK = 32, 2, 16, 4
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] KV slot each token writes
    tables: Tensor  # [T, max_blocks_per_req]
    lora_idx: Tensor  # [T] stack slot of each token's adapter (0: base)
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] each request's last token (None: decode, T == R)


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


class Model:
    """Base weights on the device; adapter weights on the host, made from (seed, adapter id)."""

    SHAPES: ClassVar[dict[str, tuple[int, ...]]] = {
        "embed": (SPEC.vocab_size, HIDDEN),
        "pos": (CONTEXT, HIDDEN),
        "wq": (HIDDEN, HIDDEN),
        "wk": (HIDDEN, HIDDEN),
        "wv": (HIDDEN, HIDDEN),
        "wo": (HIDDEN, HIDDEN),
        "up": (HIDDEN, 3 * HIDDEN),
        "down": (3 * HIDDEN, HIDDEN),
        "head": (HIDDEN, SPEC.vocab_size),
    }

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.w = {k: torch.empty(s, device=device) for k, s in self.SHAPES.items()}
        self.adapters: dict[int, tuple[Tensor, Tensor]] = {}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))
        self.adapters = {}
        for aid in range(1, NUM_ADAPTERS + 1):
            g = torch.Generator().manual_seed((seed * 1_000_003 + aid * 7919) & 0x7FFFFFFF)
            a = torch.randn(2, HIDDEN, RANK, generator=g) / math.sqrt(HIDDEN)
            b = torch.randn(2, RANK, HIDDEN, generator=g) * (1.5 / math.sqrt(RANK))
            self.adapters[aid] = (a, b)

    def forward(self, x_in: Inputs, kv: tuple[Tensor, Tensor], la: Tensor, lb: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][x_in.tokens] + w["pos"][x_in.positions]
        h = _norm(x)
        # LoRA delta for q (0) and v (1): per-token stack slot gathered from the stacks.
        a, b = la[x_in.lora_idx], lb[x_in.lora_idx]  # [T, 2, H, R], [T, 2, R, H]
        delta = torch.einsum("tjr,tjrk->tjk", torch.einsum("th,tjhr->tjr", h, a), b)
        q = h @ w["wq"] + delta[:, 0]
        k = h @ w["wk"]
        v = h @ w["wv"] + delta[:, 1]
        k_cache, v_cache = kv
        k_cache.index_copy_(0, x_in.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x_in.slots, v.view(-1, HEADS, HEAD_DIM))
        ctx = (
            x_in.tables[:, :, None] * SPEC.block_size
            + torch.arange(SPEC.block_size, device=x.device)
        ).flatten(1)  # [T, CONTEXT]
        keys, values = k_cache[ctx], v_cache[ctx]
        seen = torch.arange(CONTEXT, device=x.device)[None, :] <= x_in.positions[:, None]
        s = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
        p = s.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        values = torch.where(seen[:, :, None, None], values, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", p, values).flatten(1) @ w["wo"]
        x = x + torch.nn.functional.gelu(_norm(x) @ w["up"]) @ w["down"]
        if x_in.last is not None:
            x = x[x_in.last]
        return _norm(x) @ w["head"]


def sample(logits: Tensor, x_in: Inputs) -> Tensor:
    pos = x_in.positions if x_in.last is None else x_in.positions[x_in.last]
    key = _hash32((_hash32(x_in.seeds) + pos * 0x61C88647) & M32)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash32(key[:, None] ^ ((vocab * 0x7FEB352D) & M32)[None, :])
    u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24  # never 0 or 1 in float32
    noisy = logits / x_in.temperatures[:, None] - torch.log(-torch.log(u))
    return torch.where(x_in.sampled, noisy.argmax(-1), logits.argmax(-1))


class AdapterSlotsRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, rebuild_on_load: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.rebuild_on_load = rebuild_on_load
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = (torch.zeros(shape, device=dev), torch.zeros(shape, device=dev))
        # Adapter stacks: slot 0 stays zero (base rows), slots 1..MAX_LORAS hold loaded adapters.
        self.lora_a = torch.zeros(MAX_LORAS + 1, 2, HIDDEN, RANK, device=dev)
        self.lora_b = torch.zeros(MAX_LORAS + 1, 2, RANK, HIDDEN, device=dev)
        self.resident: dict[int, int] = {}  # adapter id -> stack slot
        self.recency: list[int] = []  # adapter ids, least recently used first
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            n, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.zeros(n, dtype=i64, device=dev),
                "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "lora_idx": torch.zeros(n, dtype=i64, device=dev),
                "seeds": torch.zeros(n, dtype=i64, device=dev),
                "temperatures": torch.ones(n, device=dev),
                "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
            }
            self.capture()

    # -- adapter slots ---------------------------------------------------------------------------

    def write_slot(self, slot: int, a: Tensor, b: Tensor) -> None:
        a, b = a.to(self.be.device), b.to(self.be.device)
        if self.rebuild_on_load:  # BUG: new stacks; graphs captured earlier read the old ones
            self.lora_a = torch.stack([a if i == slot else t for i, t in enumerate(self.lora_a)])
            self.lora_b = torch.stack([b if i == slot else t for i, t in enumerate(self.lora_b)])
        else:
            self.lora_a[slot].copy_(a)
            self.lora_b[slot].copy_(b)

    def ensure_loaded(self, needed: frozenset[int]) -> None:
        """Load every adapter of `needed` (len <= MAX_LORAS), evicting LRU adapters not needed."""
        for aid in sorted(needed):
            if aid in self.resident:
                continue
            used = set(self.resident.values())
            free = [s for s in range(1, MAX_LORAS + 1) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(x for x in self.recency if x not in needed)
                slot = self.resident.pop(victim)
                self.recency.remove(victim)
            self.write_slot(slot, *self.model.adapters[aid])
            self.resident[aid] = slot
            self.recency.append(aid)
        for aid in sorted(needed):  # most recently used last
            self.recency.remove(aid)
            self.recency.append(aid)

    def temporary_stacks(self, needed: frozenset[int]) -> tuple[Tensor, Tensor, dict[int, int]]:
        ids = sorted(needed)
        dev = self.be.device
        la = torch.zeros(len(ids) + 1, 2, HIDDEN, RANK, device=dev)
        lb = torch.zeros(len(ids) + 1, 2, RANK, HIDDEN, device=dev)
        for i, aid in enumerate(ids, start=1):
            la[i].copy_(self.model.adapters[aid][0].to(dev))
            lb[i].copy_(self.model.adapters[aid][1].to(dev))
        return la, lb, {aid: i for i, aid in enumerate(ids, start=1)}

    # -- graph mode ------------------------------------------------------------------------------

    def static_inputs(self, size: int) -> Inputs:
        return Inputs(**{k: v[:size] for k, v in self.buffers.items()})

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inputs = self.static_inputs(size)
            self.run_model(inputs, self.lora_a, self.lora_b)
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(inputs, self.lora_a, self.lora_b)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = _rows(batch.requests, self.resident)
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[n:size].fill_(_PAD[name])

    def replay(self, batch: Batch) -> StepResult:
        self.ensure_loaded(batch.adapters - {0})
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ------------------------------------------------------------------------------

    def run_model(self, x_in: Inputs, la: Tensor, lb: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(x_in, self.kv, la, lb)
        return logits, sample(logits, x_in)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        needed = batch.adapters - {0}
        if len(needed) <= MAX_LORAS:
            self.ensure_loaded(needed)
            la, lb, where = self.lora_a, self.lora_b, self.resident
        else:
            la, lb, where = self.temporary_stacks(needed)
        logits, tokens = self.run_model(_eager_inputs(batch, where, self.be.device), la, lb)
        return StepResult(logits, tokens, "eager", None, reason=reason)

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
            return "more requests than the largest capture size"
        if len(batch.adapters - {0}) > MAX_LORAS:
            return "more adapters than device slots"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.kv[0], "v": self.kv[1]}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)
        self.resident.clear()  # adapters reload from the new weights on their next use
        self.recency.clear()

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


_PAD: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "lora_idx": 0,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _samp(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


def _rows(reqs: Sequence[Request], where: Mapping[int, int]) -> dict[str, list[Any]]:
    s = [_samp(r) for r in reqs]
    return {
        "tokens": [r.tokens[0] for r in reqs],
        "positions": [r.context_len for r in reqs],
        "slots": [_slot(r, r.context_len) for r in reqs],
        "tables": [_table(r) for r in reqs],
        "lora_idx": [where[r.adapter] if r.adapter else 0 for r in reqs],
        "seeds": [x[0] for x in s],
        "temperatures": [x[1] for x in s],
        "sampled": [x[2] for x in s],
    }


def _eager_inputs(batch: Batch, where: Mapping[int, int], dev: torch.device) -> Inputs:
    tok, pos, slots, tables, idx, last = [], [], [], [], [], []
    for r in batch.requests:
        for i, t in enumerate(r.tokens):
            tok.append(t)
            pos.append(r.context_len + i)
            slots.append(_slot(r, r.context_len + i))
            tables.append(_table(r))
            idx.append(where[r.adapter] if r.adapter else 0)
        last.append(len(tok) - 1)
    s = [_samp(r) for r in batch.requests]

    def t(v: list[Any], dt: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(v, dtype=dt, device=dev)

    return Inputs(
        tokens=t(tok),
        positions=t(pos),
        slots=t(slots),
        tables=t(tables).view(-1, SPEC.max_blocks_per_req),
        lora_idx=t(idx),
        seeds=t([x[0] for x in s]),
        temperatures=t([x[1] for x in s], torch.float32),
        sampled=t([x[2] for x in s], torch.bool),
        last=t(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> AdapterSlotsRunner:
    return AdapterSlotsRunner(mode, seed=seed, backend=backend, rebuild_on_load=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> AdapterSlotsRunner:
    return AdapterSlotsRunner(mode, seed=seed, backend=backend, rebuild_on_load=True)
