"""Decode graphs padded by requests, with a dynamic per-tensor activation scale (FP8-style).

One-layer decoder, float32, learned position embeddings, paged attention over a slot-major KV
cache read through block tables, counter-based Gumbel sampling. Before the MLP the normed
activation is fake-quantized to 15 levels with ONE scale for the step: amax(|h|) over the batch's
real rows / 7, as dynamic per-tensor FP8 activation quantization does; the scale mixes the rows of
a batch by design, so the spec says `batch_invariant=False`.

Graph mode (backend facade) captures one decode graph per capture size at start-up (rows = size,
one query token per row). Padding rows get token 0, position 0, the null slot, an all-null block
table and seq_len 0 (as vLLM / SGLang padded decode rows once did). Attention masks keys past each
row's seq_len with -inf before the softmax, so a padding row, having no key at all, softmaxes an
all -inf row: NaN. The quantizer keeps padding rows out of the amax through a `valid` static
buffer (1.0 for real rows). Everything that is not a decode batch fitting a graph runs eagerly,
unpadded (no padding rows, no NaN).

make_target:        padding rows are kept out of the amax with torch.where(valid, |h|, 0): the
                    NaN of the empty softmax stays in the padding rows.
make_buggy_target:  padding rows are kept out of the amax by multiplying with the mask,
                    |h| * valid: 0 * NaN = NaN, so the scale is NaN and every real row of the
                    padded batch turns NaN (vLLM #38436 / SGLang #1779: seq_lens=0 padding gives
                    NaN attention, which a shared quantization scale spreads into real tokens).
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
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
    null_block=0,
    batch_invariant=False,
)
D, NH, HD, FFN = 32, 2, 16, 64
QMAX = 7
MAXPOS = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def fake_quant(h: Tensor, valid: Tensor | None, nan_safe: bool) -> Tensor:
    mag = h.abs()
    if valid is not None:  # [T] float 1.0 real / 0.0 padding
        if nan_safe:
            mag = torch.where(valid[:, None] > 0, mag, torch.zeros((), device=h.device))
        else:
            mag = mag * valid[:, None]  # the bug: 0 * NaN is NaN
    scale = mag.amax().clamp_min(1e-6) / QMAX
    return torch.round(h / scale).clamp(-QMAX, QMAX) * scale


def sample(logits: Tensor, pos: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor) -> Tensor:
    key = _hash(_hash(seeds) ^ ((pos * 0x61C88647) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x3C6EF372) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class Model:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "emb": (SPEC.vocab_size, D),
            "pos": (MAXPOS, D),
            "wqkv": (D, 3 * D),
            "wo": (D, D),
            "w1": (D, FFN),
            "w2": (FFN, D),
            "lm": (D, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.device = device
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for k in sorted(self.w):
            t = self.w[k]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(self.device))

    def forward(
        self,
        tok: Tensor,  # [T]
        pos: Tensor,  # [T]
        slots: Tensor,  # [T]
        row: Tensor,  # [T] request row of each token
        seq_lens: Tensor,  # [R]
        tables: Tensor,  # [R, MB]
        kc: Tensor,
        vc: Tensor,
        valid: Tensor | None,
        nan_safe: bool,
    ) -> Tensor:
        w = self.w
        x = w["emb"][tok] + w["pos"][pos]
        q, k, v = (_norm(x) @ w["wqkv"]).split(D, dim=-1)
        kc.index_copy_(0, slots, k.reshape(-1, NH, HD))
        vc.index_copy_(0, slots, v.reshape(-1, NH, HD))
        bs = SPEC.block_size
        ctx = (tables[:, :, None] * bs + torch.arange(bs, device=tok.device)).flatten(
            1
        )  # [R, MAXPOS]
        tctx = ctx[row]  # [T, MAXPOS]
        keys, vals = kc[tctx], vc[tctx]  # [T, MAXPOS, NH, HD]
        c = torch.arange(MAXPOS, device=tok.device)
        in_seq = c[None, :] < seq_lens[row][:, None]  # [T, MAXPOS]
        vis = in_seq & (c[None, :] <= pos[:, None])
        s = torch.einsum("tnd,tcnd->tnc", q.reshape(-1, NH, HD), keys) / math.sqrt(HD)
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
        p = s.softmax(-1)  # an all -inf row (seq_len 0) gives NaN
        vals = torch.where(vis[:, :, None, None], vals, torch.zeros((), device=tok.device))
        o = torch.einsum("tnc,tcnd->tnd", p, vals).reshape(-1, D)
        x = x + o @ w["wo"]
        h = fake_quant(_norm(x), valid, nan_safe)
        x = x + torch.nn.functional.silu(h @ w["w1"]) @ w["w2"]
        return _norm(x) @ w["lm"]


def _slot(r: Request, p: int) -> int:
    return r.block_ids[p // SPEC.block_size] * SPEC.block_size + p % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _samp(r: Request) -> tuple[int, float, bool]:
    return (0, 1.0, False) if r.seed is None else (r.seed & M32, float(r.temperature), True)


class Runner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, nan_safe: bool
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.nan_safe = nan_safe
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_blocks * SPEC.block_size, NH, HD)
        self.kc = torch.zeros(shape, device=dev)
        self.vc = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outs: dict[int, tuple[Tensor, Tensor]] = {}
        self.bufs: dict[str, Tensor] = {}
        if mode == "graph":
            n, i64 = SPEC.capture_sizes[-1], torch.int64
            self.bufs = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.full((n,), NULL_SLOT, dtype=i64, device=dev),
                "seq_lens": torch.zeros(n, dtype=i64, device=dev),
                "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "valid": torch.zeros(n, device=dev),
                "seeds": torch.zeros(n, dtype=i64, device=dev),
                "temps": torch.ones(n, device=dev),
                "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
            }
            self.rows = torch.arange(n, device=dev)
            self.pool = self.be.graph_pool_handle()
            for size in sorted(SPEC.capture_sizes, reverse=True):
                self.capture(size)

    def stage(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        smp = [_samp(r) for r in reqs]
        vals = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "seq_lens": [r.seq_len for r in reqs],
            "tables": [_table(r) for r in reqs],
            "valid": [1.0 for _ in reqs],
            "seeds": [s[0] for s in smp],
            "temps": [s[1] for s in smp],
            "sampled": [s[2] for s in smp],
        }
        pad = {
            "tokens": 0,
            "positions": 0,
            "slots": NULL_SLOT,
            "seq_lens": 0,
            "tables": SPEC.null_block,
            "valid": 0.0,
            "seeds": 0,
            "temps": 1.0,
            "sampled": False,
        }
        n = len(reqs)
        for name, v in vals.items():
            b = self.bufs[name]
            if n:
                b[:n].copy_(torch.tensor(v, dtype=b.dtype).view(-1, *b.shape[1:]))
            b[n:size].fill_(pad[name])

    def forward_graph(self, size: int) -> tuple[Tensor, Tensor]:
        b = self.bufs
        logits = self.model.forward(
            b["tokens"][:size],
            b["positions"][:size],
            b["slots"][:size],
            self.rows[:size],
            b["seq_lens"][:size],
            b["tables"][:size],
            self.kc,
            self.vc,
            b["valid"][:size],
            self.nan_safe,
        )
        toks = sample(
            logits, b["positions"][:size], b["seeds"][:size], b["temps"][:size], b["sampled"][:size]
        )
        return logits, toks

    def capture(self, size: int) -> None:
        self.stage(Batch(()), size)
        self.forward_graph(size)
        self.be.synchronize()
        g = self.be.Graph()
        with self.be.graph(g, pool=self.pool):
            self.outs[size] = self.forward_graph(size)
        self.graphs[size] = g

    def run_eager(self, batch: Batch, reason: str | None) -> StepResult:
        dev = self.be.device
        tok, pos, slots, row, last = [], [], [], [], []
        for i, r in enumerate(batch.requests):
            for j, t in enumerate(r.tokens):
                tok.append(t)
                pos.append(r.context_len + j)
                slots.append(_slot(r, r.context_len + j))
                row.append(i)
            last.append(len(tok) - 1)
        T = lambda v, dt=torch.int64: torch.tensor(v, dtype=dt, device=dev)  # noqa: E731
        smp = [_samp(r) for r in batch.requests]
        logits_all = self.model.forward(
            T(tok),
            T(pos),
            T(slots),
            T(row),
            T([r.seq_len for r in batch.requests]),
            T([_table(r) for r in batch.requests]).view(-1, SPEC.max_blocks_per_req),
            self.kc,
            self.vc,
            None,
            self.nan_safe,
        )
        li = T(last)
        logits = logits_all[li]
        toks = sample(
            logits,
            T(pos)[li],
            T([s[0] for s in smp]),
            T([s[1] for s in smp], torch.float32),
            T([s[2] for s in smp], torch.bool),
        )
        return StepResult(logits, toks, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        if n == 0:
            v = SPEC.vocab_size
            return StepResult(
                torch.zeros(0, v, device=self.be.device),
                torch.zeros(0, dtype=torch.int64, device=self.be.device),
                "eager",
                None,
                reason="empty batch",
            )
        if self.mode == "eager":
            return self.run_eager(batch, "eager twin")
        if any(q != 1 for q in batch.query_lens):
            return self.run_eager(batch, "not a one-token decode batch")
        size = next((s for s in SPEC.capture_sizes if s >= n), None)
        if size is None:
            return self.run_eager(batch, "more rows than the largest graph")
        self.stage(batch, size)
        self.graphs[size].replay()
        logits, toks = self.outs[size]
        return StepResult(logits[:n].clone(), toks[:n].clone(), "full", size)

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, backend=backend, nan_safe=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, backend=backend, nan_safe=False)
