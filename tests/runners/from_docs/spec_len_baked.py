"""Uniform-decode graphs (decode and speculative decode) keyed by token count.

Graph mode (backend facade) captures, lazily, one graph per capture size T (in tokens) the first
time a uniform decode batch (every row the same query length q = 1 + k, R * q <= T) needs it. All
tokens are staged per token (token, position, slot, block table); the logits are taken at each
row's last query token, index r * q + q - 1. Correct: q is read from a static input on the device.
Buggy (`BAKE_Q`): q is the Python int of the batch the graph was captured with.
Everything else (prefill, mixed, oversize, empty) runs eagerly.
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
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8, 16),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
D, NH, HD, NLAYERS = 32, 2, 16, 2
MAXPOS = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


class Model:
    def __init__(self, seed: int, device: Any) -> None:
        shapes: dict[str, tuple[int, ...]] = {
            "emb": (SPEC.vocab_size, D),
            "pos": (MAXPOS, D),
            "lm": (D, SPEC.vocab_size),
        }
        for i in range(NLAYERS):
            shapes[f"wqkv{i}"] = (D, 3 * D)
            shapes[f"wo{i}"] = (D, D)
            shapes[f"w1{i}"] = (D, 2 * D)
            shapes[f"w2{i}"] = (2 * D, D)
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.device = device
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for k in sorted(self.w):
            t = self.w[k]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(self.device))

    def hidden(
        self,
        tok: Tensor,
        pos: Tensor,
        slots: Tensor,
        tables: Tensor,
        kv: list[tuple[Tensor, Tensor]],
    ) -> Tensor:
        """Per-token forward: [T] inputs -> [T, D] final hidden states (before the LM head)."""
        w = self.w
        x = w["emb"][tok] + w["pos"][pos]
        bs = SPEC.block_size
        ctx_slots = (tables[:, :, None] * bs + torch.arange(bs, device=tok.device)).flatten(1)
        visible = torch.arange(MAXPOS, device=tok.device)[None, :] <= pos[:, None]  # [T, MAXPOS]
        for i, (kc, vc) in enumerate(kv):
            h = _norm(x)
            q, k, v = (h @ w[f"wqkv{i}"]).split(D, dim=-1)
            kc.index_copy_(0, slots, k.reshape(-1, NH, HD))
            vc.index_copy_(0, slots, v.reshape(-1, NH, HD))
            keys, vals = kc[ctx_slots], vc[ctx_slots]  # [T, MAXPOS, NH, HD]
            s = torch.einsum("tnd,tcnd->tnc", q.reshape(-1, NH, HD), keys) / math.sqrt(HD)
            p = s.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
            vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=tok.device))
            x = x + torch.einsum("tnc,tcnd->tnd", p, vals).reshape(-1, D) @ w[f"wo{i}"]
            x = x + torch.nn.functional.gelu(_norm(x) @ w[f"w1{i}"]) @ w[f"w2{i}"]
        return x

    def head(self, x: Tensor) -> Tensor:
        return _norm(x) @ self.w["lm"]


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def sample(logits: Tensor, pos: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position of the row's last token, vocab id)."""
    key = _hash(_hash(seeds) ^ ((pos * 0x61C88647) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x3C6EF372) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _slot(r: Request, p: int) -> int:
    return r.block_ids[p // SPEC.block_size] * SPEC.block_size + p % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _samp(r: Request) -> tuple[int, float, bool]:
    return (0, 1.0, False) if r.seed is None else (r.seed & M32, float(r.temperature), True)


class SpecRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, bake_q: bool = False
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.bake_q = bake_q
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, NH, HD)
        self.kv = [
            (torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)) for _ in range(NLAYERS)
        ]
        self.graphs: dict[int, Any] = {}
        self.outs: dict[int, tuple[Tensor, Tensor]] = {}
        self.bufs: dict[str, Tensor] = {}
        self.pool = None
        if mode == "graph":
            n, i64 = SPEC.capture_sizes[-1], torch.int64
            self.bufs = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.zeros(n, dtype=i64, device=dev),
                "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(n, dtype=i64, device=dev),
                "temps": torch.ones(n, device=dev),
                "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
                "qlen": torch.ones(1, dtype=i64, device=dev),
            }
            self.pool = self.be.graph_pool_handle()

    # -- graph mode ---------------------------------------------------------------------------
    def stage(self, batch: Batch, size: int) -> None:
        """Write the batch's tokens and rows into the buffers' prefix; padding to sentinels."""
        reqs = batch.requests
        tok, pos, slots, tables = [], [], [], []
        for r in reqs:
            for j, t in enumerate(r.tokens):
                tok.append(t)
                pos.append(r.context_len + j)
                slots.append(_slot(r, r.context_len + j))
                tables.append(_table(r))
        nt, nr = len(tok), len(reqs)
        pad = {
            "tokens": 0,
            "positions": 0,
            "slots": NULL_SLOT,
            "tables": SPEC.null_block,
            "seeds": 0,
            "temps": 1.0,
            "sampled": False,
        }
        smp = [_samp(r) for r in reqs]
        rows = {
            "tokens": (tok, nt),
            "positions": (pos, nt),
            "slots": (slots, nt),
            "tables": (tables, nt),
            "seeds": ([s[0] for s in smp], nr),
            "temps": ([s[1] for s in smp], nr),
            "sampled": ([s[2] for s in smp], nr),
        }
        for name, (vals, n) in rows.items():
            b = self.bufs[name]
            if n:
                b[:n].copy_(torch.tensor(vals, dtype=b.dtype))
            b[n:size].fill_(pad[name])
        self.bufs["qlen"].fill_(batch.query_lens[0] if reqs else 1)

    def graph_forward(self, size: int, q_at_capture: int) -> tuple[Tensor, Tensor]:
        b = {k: v[:size] for k, v in self.bufs.items() if k != "qlen"}
        x = self.model.hidden(b["tokens"], b["positions"], b["slots"], b["tables"], self.kv)
        # each row's last query token: row r's tokens are r*q .. r*q + q - 1
        q = q_at_capture if self.bake_q else self.bufs["qlen"]
        last = (torch.arange(size, device=x.device) * q + (q - 1)).clamp(max=size - 1)
        logits = self.model.head(x[last])  # [size rows (at most), vocab]
        toks = sample(logits, b["positions"][last], b["seeds"], b["temps"], b["sampled"])
        return logits, toks

    def capture(self, size: int, batch: Batch) -> None:
        q = batch.query_lens[0]  # the batch this graph is captured with
        self.stage(Batch(()), size)  # capture on padding only
        self.graph_forward(size, q)  # warm-up
        self.be.synchronize()
        g = self.be.Graph()
        with self.be.graph(g, pool=self.pool):
            self.outs[size] = self.graph_forward(size, q)
        self.graphs[size] = g

    def replay(self, batch: Batch, size: int) -> StepResult:
        if size not in self.graphs:
            self.capture(size, batch)
        self.stage(batch, size)
        self.graphs[size].replay()
        logits, toks = self.outs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), toks[:n].clone(), "full", ("uniform", size))

    def graph_size(self, batch: Batch) -> tuple[int | None, str | None]:
        if self.mode == "eager":
            return None, "eager twin"
        if batch.num_reqs == 0:
            return None, "empty batch"
        if batch.phase != "decode":
            return None, f"{batch.phase} batch"
        for s in SPEC.capture_sizes:
            if s >= batch.num_tokens:
                return s, None
        return None, "more tokens than the largest capture size"

    # -- eager ---------------------------------------------------------------------------------
    def run_eager(self, batch: Batch, reason: str | None) -> StepResult:
        dev = self.be.device
        tok, pos, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for j, t in enumerate(r.tokens):
                tok.append(t)
                pos.append(r.context_len + j)
                slots.append(_slot(r, r.context_len + j))
                tables.append(_table(r))
            last.append(len(tok) - 1)
        i64 = torch.int64
        T = lambda v, dt=i64: torch.tensor(v, dtype=dt, device=dev)  # noqa: E731
        x = self.model.hidden(
            T(tok), T(pos), T(slots), T(tables).view(-1, SPEC.max_blocks_per_req), self.kv
        )
        lt = T(last)
        logits = self.model.head(x[lt])
        smp = [_samp(r) for r in batch.requests]
        toks = sample(
            logits,
            T(pos)[lt],
            T([s[0] for s in smp]),
            T([s[1] for s in smp], torch.float32),
            T([s[2] for s in smp], torch.bool),
        )
        return StepResult(logits, toks, "eager", None, reason=reason)

    # -- contract ------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        size, reason = self.graph_size(batch)
        return self.replay(batch, size) if size is not None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{n}{i}": kv[j] for i, kv in enumerate(self.kv) for j, n in enumerate("kv")}

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SpecRunner:
    return SpecRunner(mode, seed=seed, backend=backend, bake_q=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SpecRunner:
    return SpecRunner(mode, seed=seed, backend=backend, bake_q=True)
