"""A graph runner that reorders each batch internally (continuing decodes first,
then new one-token requests, then multi-token requests; a stable sort), as engines do for their
kernels (vLLM's reorder_batch), and must hand results back in the batch's order.

Graph mode (backend facade) captures one graph per capture size for batches whose requests all
have one query token (continuing decodes and one-token new prompts alike); anything else runs
eagerly. Both paths build inputs in the internal order. The correct variant applies the inverse
permutation on both paths; the buggy one only on the eager path.
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
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling"}),
)
D, NH, HD = 32, 2, 16
MAXPOS = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temps: Tensor  # [R]
    do_sample: Tensor  # [R] bool
    last: Tensor | None = None  # [R] row of each request's last token (None: one token each)


class Model:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "emb": (SPEC.vocab_size, D),
            "pos": (MAXPOS, D),
            "wq": (D, D),
            "wk": (D, D),
            "wv": (D, D),
            "wo": (D, D),
            "w1": (D, 2 * D),
            "w2": (2 * D, D),
            "lm": (D, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for k in sorted(self.w):
            t = self.w[k]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(t.device))

    def __call__(self, x: Inputs, kc: Tensor, vc: Tensor) -> Tensor:
        w = self.w
        h = w["emb"][x.tokens] + w["pos"][x.positions]
        n = _norm(h)
        q, k, v = n @ w["wq"], n @ w["wk"], n @ w["wv"]
        kc.index_copy_(0, x.slots, k.view(-1, NH, HD))
        vc.index_copy_(0, x.slots, v.view(-1, NH, HD))
        bs = SPEC.block_size
        ctx = (x.tables[:, :, None] * bs + torch.arange(bs, device=h.device)).flatten(
            1
        )  # [T, MAXPOS]
        keys, vals = kc[ctx], vc[ctx]
        seen = torch.arange(MAXPOS, device=h.device)[None, :] <= x.positions[:, None]  # [T, MAXPOS]
        s = torch.einsum("thd,tchd->thc", q.view(-1, NH, HD), keys) / math.sqrt(HD)
        p = s.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(seen[:, :, None, None], vals, torch.zeros((), device=h.device))
        h = h + torch.einsum("thc,tchd->thd", p, vals).flatten(1) @ w["wo"]
        h = h + torch.nn.functional.silu(_norm(h) @ w["w1"]) @ w["w2"]
        if x.last is not None:
            h = h[x.last]
        return _norm(h) @ w["lm"]


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def _sample(logits: Tensor, x: Inputs) -> Tensor:
    pos = x.positions if x.last is None else x.positions[x.last]
    key = _hash(_hash(x.seeds) ^ ((pos * 0x9E3779B1) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
    u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / x.temps[:, None] - torch.log(-torch.log(u))
    return torch.where(x.do_sample, noisy.argmax(-1), logits.argmax(-1))


def _slot(r: Request, p: int) -> int:
    return r.block_ids[p // SPEC.block_size] * SPEC.block_size + p % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _samp(r: Request) -> tuple[int, float, bool]:
    return (0, 1.0, False) if r.seed is None else (r.seed & M32, r.temperature, True)


def internal_order(batch: Batch) -> list[int]:
    """Stable sort: continuing decodes, then new one-token requests, then multi-token ones."""

    def key(i: int) -> int:
        r = batch.requests[i]
        if r.query_len == 1:
            return 0 if r.context_len > 0 else 1
        return 2

    return sorted(range(batch.num_reqs), key=key)


PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temps": 1.0,
    "do_sample": False,
}


class ReorderRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, bug: bool = False
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.bug = bug
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        self.kc = torch.zeros(SPEC.num_slots, NH, HD, device=dev)
        self.vc = torch.zeros(SPEC.num_slots, NH, HD, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outs: dict[int, tuple[Tensor, Tensor]] = {}
        self.bufs: dict[str, Tensor] = {}
        if mode == "graph":
            rows, i64 = SPEC.capture_sizes[-1], torch.int64
            self.bufs = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.zeros(rows, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(rows, dtype=i64, device=dev),
                "temps": torch.ones(rows, device=dev),
                "do_sample": torch.zeros(rows, dtype=torch.bool, device=dev),
            }
            pool = self.be.graph_pool_handle()
            for size in sorted(SPEC.capture_sizes, reverse=True):
                self.prepare([], size)
                x = Inputs(**{k: b[:size] for k, b in self.bufs.items()})
                self.forward(x)
                self.be.synchronize()
                g = self.be.Graph()
                with self.be.graph(g, pool=pool):
                    self.outs[size] = self.forward(x)
                self.graphs[size] = g

    def forward(self, x: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model(x, self.kc, self.vc)
        return logits, _sample(logits, x)

    def prepare(self, reqs: Sequence[Request], size: int) -> None:
        n = len(reqs)
        samp = [_samp(r) for r in reqs]
        rows = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temps": [s[1] for s in samp],
            "do_sample": [s[2] for s in samp],
        }
        for k, vals in rows.items():
            b = self.bufs[k]
            if n:
                b[:n].copy_(torch.tensor(vals, dtype=b.dtype))
            b[n:size].fill_(PAD[k])

    def unpermute(self, logits: Tensor, tokens: Tensor, order: list[int]) -> tuple[Tensor, Tensor]:
        inv = [0] * len(order)
        for row, i in enumerate(order):
            inv[i] = row
        idx = torch.tensor(inv, dtype=torch.int64, device=self.be.device)
        return logits.index_select(0, idx), tokens.index_select(0, idx)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "multi-token requests"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "above largest capture size"
        return None

    def replay(self, batch: Batch, order: list[int]) -> StepResult:
        n = batch.num_reqs
        size = next(s for s in SPEC.capture_sizes if s >= n)
        self.prepare([batch.requests[i] for i in order], size)
        self.graphs[size].replay()
        logits, tokens = self.outs[size]
        logits, tokens = logits[:n].clone(), tokens[:n].clone()
        if not self.bug:  # BUG: the buggy variant returns the graph's rows in internal order
            logits, tokens = self.unpermute(logits, tokens, order)
        return StepResult(logits, tokens, "full", ("one-token", size))

    def run_eager(self, batch: Batch, order: list[int], reason: str) -> StepResult:
        dev = self.be.device
        if batch.num_reqs == 0:
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=dev),
                torch.zeros(0, dtype=torch.int64, device=dev),
                "eager",
                None,
                reason,
            )
        toks, pos, slots, tabs, last = [], [], [], [], []
        reqs = [batch.requests[i] for i in order]
        for r in reqs:
            for j, t in enumerate(r.tokens):
                p = r.context_len + j
                toks.append(t)
                pos.append(p)
                slots.append(_slot(r, p))
                tabs.append(_table(r))
            last.append(len(toks) - 1)
        samp = [_samp(r) for r in reqs]

        def T(v: list[Any], dt: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(v, dtype=dt, device=dev)

        x = Inputs(
            T(toks),
            T(pos),
            T(slots),
            T(tabs).view(-1, SPEC.max_blocks_per_req),
            T([s[0] for s in samp]),
            T([s[1] for s in samp], torch.float32),
            T([s[2] for s in samp], torch.bool),
            T(last),
        )
        logits, tokens = self.forward(x)
        logits, tokens = self.unpermute(logits, tokens, order)
        return StepResult(logits, tokens, "eager", None, reason)

    def step(self, batch: Batch) -> StepResult:
        order = internal_order(batch)
        reason = self.fallback_reason(batch)
        if reason is None:
            return self.replay(batch, order)
        return self.run_eager(batch, order, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.kc, "v": self.vc}

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ReorderRunner:
    return ReorderRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ReorderRunner:
    return ReorderRunner(mode, seed=seed, backend=backend, bug=True)
