"""Speculative-decoding verify graphs with per-request varlen attention (FA-style query_start_loc).

Graph mode (backend facade) captures at start-up one verify graph per key (T, q): T a capture size in
tokens, q = 1 + k the uniform query length of every row (decode is q = 1). Its rows are padded to
R_pad = min(T // q, max_num_reqs); tokens are laid out row-major (row r owns tokens
qsl[r] .. qsl[r+1]-1), padding tokens (and rows) point at the null block. Attention is per row:
a window of q query tokens starting at query_start_loc[r] (`qsl`, the cumulative offsets,
cu_num_tokens = cumsum(1 + num_draft)), causal from the row's seq_len, and the kernel writes each
window token's output back into its token row (last writer wins, as concurrent CTAs would).
The graph computes logits for every query token and gathers the bonus token's (qsl[r+1] - 1,
`logits_indices`) per row. qsl is staged in a pinned host buffer and uploaded whole every step
(an event guards the staging against the previous upload); every other input is a device buffer
rewritten (prefix + padding sentinels) before each replay. Non-uniform / oversize batches run
eagerly (same kernels, unpadded: R rows, window = longest query).

Correct (`make_target`): qsl[R+1:] = qsl[R] (padding rows have empty query ranges).
Buggy (`make_buggy_target`): only qsl[:R+1] is written; the padding entries keep what an earlier
step (e.g. a larger decode batch, one token a row) left in the host staging buffer, so a padding
row's query range can cover valid tokens and its (empty-context) attention output overwrites
theirs (vLLM-style: query_start_loc padding not filled for the full-cudagraph spec-decode pad).
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
    capture_sizes=(1, 2, 4, 8, 16, 24),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
D, NH, HD, NLAYERS = 32, 2, 16, 2
K_MAX = 4  # drafts per row a verify graph serves
MAXPOS = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def attend(
    q: Tensor, kc: Tensor, vc: Tensor, qsl: Tensor, seq_lens: Tensor, tables: Tensor, window: int
) -> Tensor:
    """Varlen paged attention, one program per row: q [T, NH, HD], qsl [R+1], seq_lens [R],
    tables [R, MB]; returns [T, NH, HD] (token rows no row's range covers stay zero)."""
    T, dev = q.shape[0], q.device
    R = seq_lens.shape[0]
    j = torch.arange(window, device=dev)
    start = qsl[:R]
    qlen = (qsl[1 : R + 1] - start).clamp(min=0)
    tok = start[:, None] + j[None, :]  # [R, W]
    valid = j[None, :] < qlen[:, None]
    qq = q[tok.clamp(0, T - 1)]  # [R, W, NH, HD]
    bs = SPEC.block_size
    ctx = (tables[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)  # [R, MAXPOS]
    keys, vals = kc[ctx], vc[ctx]  # [R, MAXPOS, NH, HD]
    c = torch.arange(MAXPOS, device=dev)
    qpos = seq_lens[:, None] - qlen[:, None] + j[None, :]  # [R, W]
    in_seq = c[None, :] < seq_lens[:, None]  # [R, MAXPOS]
    vis = (c[None, None, :] <= qpos[:, :, None]) & in_seq[:, None, :]  # [R, W, MAXPOS]
    s = torch.einsum("rwnd,rcnd->rwnc", qq, keys) / math.sqrt(HD)
    s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
    p = torch.where(vis.any(-1)[:, :, None, None], s.softmax(-1), torch.zeros((), device=dev))
    vals = torch.where(in_seq[:, :, None, None], vals, torch.zeros((), device=dev))
    o = torch.einsum("rwnc,rcnd->rwnd", p, vals)
    dest = torch.where(valid, tok, torch.full_like(tok, T))  # T: a trash row
    out = torch.zeros(T + 1, NH, HD, device=dev, dtype=q.dtype)
    out.index_copy_(0, dest.flatten(), o.flatten(0, 1))
    return out[:T]


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

    def logits(
        self,
        tok: Tensor,
        pos: Tensor,
        slots: Tensor,
        qsl: Tensor,
        seq_lens: Tensor,
        tables: Tensor,
        kv: list[tuple[Tensor, Tensor]],
        window: int,
    ) -> Tensor:
        """[T] token inputs, [R(+1)] row inputs -> logits of every token [T, vocab]."""
        w = self.w
        x = w["emb"][tok] + w["pos"][pos]
        for i, (kc, vc) in enumerate(kv):
            q, k, v = (_norm(x) @ w[f"wqkv{i}"]).split(D, dim=-1)
            kc.index_copy_(0, slots, k.reshape(-1, NH, HD))
            vc.index_copy_(0, slots, v.reshape(-1, NH, HD))
            a = attend(q.reshape(-1, NH, HD), kc, vc, qsl, seq_lens, tables, window)
            x = x + a.reshape(-1, D) @ w[f"wo{i}"]
            x = x + torch.nn.functional.gelu(_norm(x) @ w[f"w1{i}"]) @ w[f"w2{i}"]
        return _norm(x) @ w["lm"]


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


def _flat(batch: Batch) -> dict[str, list[Any]]:
    tok, pos, slots, qsl = [], [], [], [0]
    for r in batch.requests:
        for j, t in enumerate(r.tokens):
            tok.append(t)
            pos.append(r.context_len + j)
            slots.append(_slot(r, r.context_len + j))
        qsl.append(len(tok))
    smp = [_samp(r) for r in batch.requests]
    return {
        "tokens": tok,
        "positions": pos,
        "slots": slots,
        "qsl": qsl,
        "seq_lens": [r.seq_len for r in batch.requests],
        "tables": [_table(r) for r in batch.requests],
        "seeds": [s[0] for s in smp],
        "temps": [s[1] for s in smp],
        "sampled": [s[2] for s in smp],
    }


class VerifyRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, pad_qsl: bool = True
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.pad_qsl = pad_qsl
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_blocks * SPEC.block_size, NH, HD)
        self.kv = [
            (torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)) for _ in range(NLAYERS)
        ]
        self.graphs: dict[tuple[int, int], Any] = {}
        self.outs: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self.bufs: dict[str, Tensor] = {}
        self.pool = None
        if mode == "graph":
            n, r, i64 = SPEC.capture_sizes[-1], SPEC.max_num_reqs, torch.int64
            self.bufs = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.full((n,), NULL_SLOT, dtype=i64, device=dev),
                "qsl": torch.zeros(r + 1, dtype=i64, device=dev),
                "seq_lens": torch.zeros(r, dtype=i64, device=dev),
                "tables": torch.zeros(r, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(r, dtype=i64, device=dev),
                "temps": torch.ones(r, device=dev),
                "sampled": torch.zeros(r, dtype=torch.bool, device=dev),
            }
            self.qsl_host = self.be.empty_pinned(r + 1, dtype=i64)
            self.qsl_host.zero_()
            self.qsl_np = self.qsl_host.numpy()
            self.uploaded = self.be.Event()
            self.uploaded_once = False
            self.pool = self.be.graph_pool_handle()
            keys = {
                self._key(r, q)
                for q in range(1, K_MAX + 2)
                for r in range(1, SPEC.max_num_reqs + 1)
            }
            for key in sorted(k for k in keys if k is not None):
                self.capture(key)  # at start-up, as engines do

    @staticmethod
    def _key(num_reqs: int, q: int) -> tuple[int, int] | None:
        for s in SPEC.capture_sizes:
            if s >= num_reqs * q and min(s // q, SPEC.max_num_reqs) >= num_reqs:
                return (s, q)
        return None

    # -- graph mode ---------------------------------------------------------------------------
    def stage_qsl(self, qsl: list[int]) -> None:
        """cu_num_tokens into the pinned staging buffer, uploaded whole (every step)."""
        if self.uploaded_once:
            self.uploaded.synchronize()  # the last upload has read the staging buffer
        n = len(qsl)
        self.qsl_np[:n] = qsl
        if self.pad_qsl:
            self.qsl_np[n:] = qsl[-1]  # padding rows: empty query ranges
        self.bufs["qsl"].copy_(self.qsl_host, non_blocking=True)
        self.uploaded.record()
        self.uploaded_once = True

    def stage(self, batch: Batch, key: tuple[int, int]) -> None:
        T, q = key
        rows = min(T // q, SPEC.max_num_reqs)
        f = _flat(batch)
        pad = {
            "tokens": 0,
            "positions": 0,
            "slots": NULL_SLOT,
            "seq_lens": 0,
            "tables": SPEC.null_block,
            "seeds": 0,
            "temps": 1.0,
            "sampled": False,
        }
        per_row = {"seq_lens", "tables", "seeds", "temps", "sampled"}
        for name, v in pad.items():
            b, vals = self.bufs[name], f[name]
            size = rows if name in per_row else T
            if vals:
                b[: len(vals)].copy_(torch.tensor(vals, dtype=b.dtype).view(-1, *b.shape[1:]))
            b[len(vals) : size].fill_(v)
        self.stage_qsl(f["qsl"])

    def forward(self, key: tuple[int, int]) -> tuple[Tensor, Tensor]:
        T, q = key
        rows = min(T // q, SPEC.max_num_reqs)
        b = self.bufs
        logits_all = self.model.logits(
            b["tokens"][:T],
            b["positions"][:T],
            b["slots"][:T],
            b["qsl"][: rows + 1],
            b["seq_lens"][:rows],
            b["tables"][:rows],
            self.kv,
            q,
        )
        idx = (b["qsl"][1 : rows + 1] - 1).clamp(0, T - 1)  # logits_indices: each bonus token
        logits = logits_all[idx]
        toks = sample(
            logits,
            b["positions"][:T][idx],
            b["seeds"][:rows],
            b["temps"][:rows],
            b["sampled"][:rows],
        )
        return logits, toks

    def capture(self, key: tuple[int, int]) -> None:
        self.stage(Batch(()), key)  # every row padding during warm-up and capture
        self.forward(key)
        self.be.synchronize()
        g = self.be.Graph()
        with self.be.graph(g, pool=self.pool):
            self.outs[key] = self.forward(key)
        self.graphs[key] = g

    def replay(self, batch: Batch, key: tuple[int, int]) -> StepResult:
        self.stage(batch, key)
        self.graphs[key].replay()
        logits, toks = self.outs[key]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), toks[:n].clone(), "full", ("verify", *key))

    def graph_key(self, batch: Batch) -> tuple[tuple[int, int] | None, str | None]:
        if self.mode == "eager":
            return None, "eager twin"
        if batch.num_reqs == 0:
            return None, "empty batch"
        qs = set(batch.query_lens)
        if len(qs) != 1:
            return None, "query lengths differ"
        q = qs.pop()
        if q > 1 + K_MAX:
            return None, "query longer than a verify graph"
        key = self._key(batch.num_reqs, q)
        return (
            (key, None) if key is not None else (None, "more tokens than the largest capture size")
        )

    # -- eager ---------------------------------------------------------------------------------
    def run_eager(self, batch: Batch, reason: str | None) -> StepResult:
        dev = self.be.device
        f = _flat(batch)
        i64 = torch.int64
        T = lambda v, dt=i64: torch.tensor(v, dtype=dt, device=dev)  # noqa: E731
        window = max(batch.query_lens)
        logits_all = self.model.logits(
            T(f["tokens"]),
            T(f["positions"]),
            T(f["slots"]),
            T(f["qsl"]),
            T(f["seq_lens"]),
            T(f["tables"]).view(-1, SPEC.max_blocks_per_req),
            self.kv,
            window,
        )
        idx = T(f["qsl"][1:]) - 1
        logits = logits_all[idx]
        toks = sample(
            logits,
            T(f["positions"])[idx],
            T(f["seeds"]),
            T(f["temps"], torch.float32),
            T(f["sampled"], torch.bool),
        )
        return StepResult(logits, toks, "eager", None, reason=reason)

    # -- contract ------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        key, reason = self.graph_key(batch)
        if key is not None:
            return self.replay(batch, key)
        if self.mode == "graph" and batch.num_reqs:
            self.stage_qsl(_flat(batch)["qsl"])  # input prep runs for every step
        if batch.num_reqs == 0:
            v = SPEC.vocab_size
            return StepResult(
                torch.zeros(0, v, device=self.be.device),
                torch.zeros(0, dtype=torch.int64, device=self.be.device),
                "eager",
                None,
                reason=reason,
            )
        return self.run_eager(batch, reason)

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> VerifyRunner:
    return VerifyRunner(mode, seed=seed, backend=backend, pad_qsl=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> VerifyRunner:
    return VerifyRunner(mode, seed=seed, backend=backend, pad_qsl=False)
