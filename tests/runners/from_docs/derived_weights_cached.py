"""A graph runner whose graphs read a fused, transposed QKV weight derived from the live q/k/v.

Like engines that post-process weights after loading (vLLM's process_weights_after_loading), the
graph twin builds a fused copy `cat([wq, wk, wv]).t().contiguous()` once, when it captures, and
the captured decode graphs read that copy. Eager steps read the separate live q/k/v weights.
`update_weights(seed)` copies new values into the live weights; the correct runner also refreshes
the fused copy in place, the buggy one (`refresh_fused=False`) forgets to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

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
    features=frozenset({"decode", "prefill", "weight_update"}),
    null_block=0,
)
D_MODEL, N_HEADS = 48, 3
D_HEAD = D_MODEL // N_HEADS
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size


class Weights:
    """Live weights in nn.Linear layout ([out, in]) and, on demand, the fused QKV copy."""

    SHAPES: ClassVar[dict[str, tuple[int, int]]] = {
        "tok": (SPEC.vocab_size, D_MODEL),
        "pos": (MAX_POS, D_MODEL),
        "wq": (D_MODEL, D_MODEL),
        "wk": (D_MODEL, D_MODEL),
        "wv": (D_MODEL, D_MODEL),
        "wo": (D_MODEL, D_MODEL),
        "w1": (2 * D_MODEL, D_MODEL),
        "w2": (D_MODEL, 2 * D_MODEL),
        "lm": (SPEC.vocab_size, D_MODEL),
    }

    def __init__(self, seed: int, device: torch.device, refresh_fused: bool) -> None:
        self.device = device
        self.refresh_fused = refresh_fused
        self.live = {n: torch.empty(s, device=device) for n, s in self.SHAPES.items()}
        self.fused_qkv: Tensor | None = None  # [D_MODEL, 3 * D_MODEL], built at first capture
        self.load(seed)

    def _fused_value(self) -> Tensor:
        return (
            torch.cat([self.live["wq"], self.live["wk"], self.live["wv"]], dim=0).t().contiguous()
        )

    def build_fused(self) -> None:
        """Post-process once (like process_weights_after_loading): the graphs read this tensor."""
        if self.fused_qkv is None:
            self.fused_qkv = self._fused_value()

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in self.SHAPES:  # dict order is fixed: same seed, same weights
            w = self.live[name]
            fresh = torch.randn(w.shape, generator=gen) * (1.0 / math.sqrt(w.shape[-1]))
            w.copy_(fresh.to(self.device))
        if self.fused_qkv is not None and self.refresh_fused:
            self.fused_qkv.copy_(self._fused_value())


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6)


def forward(
    w: Weights,
    fused: bool,
    k_cache: Tensor,
    v_cache: Tensor,
    tokens: Tensor,  # [T]
    positions: Tensor,  # [T]
    slots: Tensor,  # [T]
    tables: Tensor,  # [T, max_blocks_per_req]
    last: Tensor | None,  # [R] or None (decode: one token per request)
) -> Tensor:
    lw = w.live
    x = lw["tok"][tokens] + lw["pos"][positions]
    h = _norm(x)
    if fused:
        assert w.fused_qkv is not None
        q, k, v = (h @ w.fused_qkv).split(D_MODEL, dim=-1)
    else:
        q, k, v = h @ lw["wq"].t(), h @ lw["wk"].t(), h @ lw["wv"].t()
    k_cache.index_copy_(0, slots, k.reshape(-1, N_HEADS, D_HEAD))
    v_cache.index_copy_(0, slots, v.reshape(-1, N_HEADS, D_HEAD))
    # gather each token's context through its block table; mask by position
    ctx = tables.unsqueeze(-1) * SPEC.block_size + torch.arange(SPEC.block_size, device=x.device)
    ctx = ctx.reshape(tables.shape[0], MAX_POS)  # [T, MAX_POS]
    keys, vals = k_cache[ctx], v_cache[ctx]  # [T, MAX_POS, H, Dh]
    seen = torch.arange(MAX_POS, device=x.device).unsqueeze(0) <= positions.unsqueeze(1)  # [T, P]
    qh = q.reshape(-1, N_HEADS, D_HEAD)
    keys = torch.where(seen[:, :, None, None], keys, torch.zeros((), device=x.device))
    vals = torch.where(seen[:, :, None, None], vals, torch.zeros((), device=x.device))
    scores = torch.einsum("thd,tphd->thp", qh, keys) * (1.0 / math.sqrt(D_HEAD))
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    attn = torch.einsum("thp,tphd->thd", scores.softmax(dim=-1), vals).reshape(-1, D_MODEL)
    x = x + attn @ lw["wo"].t()
    x = x + torch.nn.functional.gelu(_norm(x) @ lw["w1"].t()) @ lw["w2"].t()
    if last is not None:
        x = x[last]
    return _norm(x) @ lw["lm"].t()


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


class FusedQKVRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, refresh_fused: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"bad mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.weights = Weights(seed, dev, refresh_fused)
        shape = (SPEC.num_slots, N_HEADS, D_HEAD)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outs: dict[int, Tensor] = {}
        self.bufs: dict[str, Tensor] = {}
        if mode == "graph":
            n = SPEC.capture_sizes[-1]
            i64 = torch.int64
            self.bufs = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.full((n,), NULL_SLOT, dtype=i64, device=dev),
                "tables": torch.full(
                    (n, SPEC.max_blocks_per_req), SPEC.null_block, dtype=i64, device=dev
                ),
            }
            self._capture_all()

    # graph mode ------------------------------------------------------------------------------
    def _graph_forward(self, size: int) -> Tensor:
        b = self.bufs
        logits = forward(
            self.weights,
            True,
            self.k_cache,
            self.v_cache,
            b["tokens"][:size],
            b["positions"][:size],
            b["slots"][:size],
            b["tables"][:size],
            None,
        )
        return logits

    def _capture_all(self) -> None:
        self.weights.build_fused()  # derived once, when the runner first captures
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._fill(Batch(()), size)
            self._graph_forward(size)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outs[size] = self._graph_forward(size)
            self.graphs[size] = g

    def _fill(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        rows = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
        }
        pad = {"tokens": 0, "positions": 0, "slots": NULL_SLOT, "tables": SPEC.null_block}
        for name, buf in self.bufs.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[n:size].fill_(pad[name])

    def _replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self._fill(batch, size)
        self.graphs[size].replay()
        logits = self.outs[size][: batch.num_reqs].clone()
        return StepResult(logits, logits.argmax(-1), "full", ("decode", size))

    # eager -----------------------------------------------------------------------------------
    def _eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.be.device
        toks, pos, slots, tabs, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                p = r.context_len + i
                toks.append(t)
                pos.append(p)
                slots.append(_slot(r, p))
                tabs.append(_table(r))
            last.append(len(toks) - 1)

        def t(v: list[Any]) -> Tensor:
            return torch.tensor(v, dtype=torch.int64, device=dev)

        logits = forward(
            self.weights,
            False,
            self.k_cache,
            self.v_cache,
            t(toks),
            t(pos),
            t(slots),
            t(tabs).view(-1, SPEC.max_blocks_per_req),
            t(last),
        )
        return StepResult(logits, logits.argmax(-1), "eager", None, reason=reason)

    def _why_eager(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "query length > 1"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "above largest capture size"
        return None

    # contract --------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        reason = self._why_eager(batch)
        return self._replay(batch) if reason is None else self._eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.bufs

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.weights.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> FusedQKVRunner:
    return FusedQKVRunner(mode, seed=seed, backend=backend, refresh_fused=True)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> FusedQKVRunner:
    return FusedQKVRunner(mode, seed=seed, backend=backend, refresh_fused=False)
