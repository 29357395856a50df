"""Uniform decode / speculative-verify graphs, eligibility checked on requests instead of tokens.

One-layer decoder over a slot-major paged KV cache (learned positions, varlen paged attention
driven by query_start_loc, counter-based Gumbel sampling), float32.

Graph mode (backend facade) captures at start-up one graph per key (S, q): S a capture size in
tokens, q = 1 + k the query length every row of a uniform batch has (decode q = 1, k drafts up to
K_MAX). Every graph has MAX_ROWS = max_num_reqs request rows (padding rows: empty query range,
seq_len 0, null block table) and S token rows (padding tokens: token 0, position 0, the null
slot). Token buffers are sized max_num_tokens, row buffers max_num_reqs, as an engine sizes its
persistent input buffers. A uniform batch replays the smallest S with S >= num_reqs * q; prefill,
mixed and everything else runs eagerly (unpadded).

make_target:        a uniform batch whose num_tokens is above the largest capture size runs
                    eagerly.
make_buggy_target:  graph eligibility is checked on the request count only (num_reqs <= the
                    graphs' row count; vLLM's GDN metadata builder checked
                    `num_spec_decodes <= decode_cudagraph_max_bs`, vllm-project/vllm#28054, a
                    request-indexed vs token-indexed mix-up again in #45100); a speculative batch
                    whose num_reqs * (1 + k) exceeds the largest capture size then replays the
                    largest graph, which embeds, writes KV for and attends with only its first S
                    tokens: the rows past S are truncated (their keys never written, their
                    queries clamped to token S - 1).
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
    num_blocks=72,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=20,
    capture_sizes=(1, 2, 4, 8, 16),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
D, NH, HD, FFN = 32, 2, 16, 64
K_MAX = 3
MAX_ROWS = SPEC.max_num_reqs
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
    """q [T, NH, HD]; qsl [R+1]; seq_lens [R]; tables [R, MB] -> [T, NH, HD]. Row r owns the
    tokens qsl[r] .. qsl[r+1]-1 (at most `window`), the last at position seq_len - 1."""
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
    keys, vals = kc[ctx], vc[ctx]
    c = torch.arange(MAXPOS, device=dev)
    qpos = seq_lens[:, None] - qlen[:, None] + j[None, :]
    in_seq = c[None, :] < seq_lens[:, None]
    vis = (c[None, None, :] <= qpos[:, :, None]) & in_seq[:, None, :]  # [R, W, MAXPOS]
    s = torch.einsum("rwnd,rcnd->rwnc", qq, keys) / math.sqrt(HD)
    s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
    p = torch.where(vis.any(-1)[:, :, None, None], s.softmax(-1), torch.zeros((), device=dev))
    vals = torch.where(in_seq[:, :, None, None], vals, torch.zeros((), device=dev))
    o = torch.einsum("rwnc,rcnd->rwnd", p, vals)
    dest = torch.where(valid, tok, torch.full_like(tok, T)).clamp(max=T)  # T: a trash row
    out = torch.zeros(T + 1, NH, HD, device=dev, dtype=q.dtype)
    out.index_copy_(0, dest.flatten(), o.flatten(0, 1))
    return out[:T]


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
        tok: Tensor,
        pos: Tensor,
        slots: Tensor,
        qsl: Tensor,
        seq_lens: Tensor,
        tables: Tensor,
        kc: Tensor,
        vc: Tensor,
        window: int,
    ) -> Tensor:
        w = self.w
        x = w["emb"][tok] + w["pos"][pos]
        q, k, v = (_norm(x) @ w["wqkv"]).split(D, dim=-1)
        kc.index_copy_(0, slots, k.reshape(-1, NH, HD))
        vc.index_copy_(0, slots, v.reshape(-1, NH, HD))
        a = attend(q.reshape(-1, NH, HD), kc, vc, qsl, seq_lens, tables, window)
        x = x + a.reshape(-1, D) @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["w1"]) @ w["w2"]
        return _norm(x) @ w["lm"]


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


class Runner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        check_tokens: bool,
        spec: TargetSpec = SPEC,
    ) -> None:
        self.spec = spec
        self.mode = mode
        self.check_tokens = check_tokens
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_blocks * SPEC.block_size, NH, HD)
        self.kc = torch.zeros(shape, device=dev)
        self.vc = torch.zeros(shape, device=dev)
        self.graphs: dict[tuple[int, int], Any] = {}
        self.outs: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self.bufs: dict[str, Tensor] = {}
        if mode == "graph":
            n, r, i64 = spec.max_num_tokens, MAX_ROWS, torch.int64
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
            self.pool = self.be.graph_pool_handle()
            for S in sorted(SPEC.capture_sizes, reverse=True):
                for q in range(1, K_MAX + 2):
                    self.capture((S, q))

    # -- graph mode ---------------------------------------------------------------------------
    def stage(self, batch: Batch, key: tuple[int, int]) -> None:
        f = _flat(batch)
        n_tok = len(f["tokens"])
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
            end = MAX_ROWS if name in per_row else max(key[0], n_tok)
            if vals:
                b[: len(vals)].copy_(torch.tensor(vals, dtype=b.dtype).view(-1, *b.shape[1:]))
            b[len(vals) : end].fill_(v)
        qsl = f["qsl"] + [f["qsl"][-1]] * (MAX_ROWS + 1 - len(f["qsl"]))
        self.bufs["qsl"].copy_(torch.tensor(qsl, dtype=torch.int64))

    def forward_graph(self, key: tuple[int, int]) -> tuple[Tensor, Tensor]:
        S, q = key
        b = self.bufs
        logits_all = self.model.forward(
            b["tokens"][:S],
            b["positions"][:S],
            b["slots"][:S],
            b["qsl"],
            b["seq_lens"],
            b["tables"],
            self.kc,
            self.vc,
            q,
        )
        idx = (b["qsl"][1:] - 1).clamp(0, S - 1)
        logits = logits_all[idx]
        toks = sample(logits, b["positions"][:S][idx], b["seeds"], b["temps"], b["sampled"])
        return logits, toks

    def capture(self, key: tuple[int, int]) -> None:
        self.stage(Batch(()), key)
        self.forward_graph(key)
        self.be.synchronize()
        g = self.be.Graph()
        with self.be.graph(g, pool=self.pool):
            self.outs[key] = self.forward_graph(key)
        self.graphs[key] = g

    def graph_key(self, batch: Batch) -> tuple[tuple[int, int] | None, str | None]:
        qs = set(batch.query_lens)
        if len(qs) != 1:
            return None, "query lengths differ"
        q = qs.pop()
        if q > 1 + K_MAX:
            return None, "query longer than a graph's"
        if batch.num_reqs > MAX_ROWS:
            return None, "more requests than graph rows"
        for S in SPEC.capture_sizes:
            if batch.num_tokens <= S:
                return (S, q), None
        if self.check_tokens:
            return None, "more tokens than the largest capture size"
        return (SPEC.capture_sizes[-1], q), None  # the bug: eligibility was checked on requests

    # -- eager ---------------------------------------------------------------------------------
    def run_eager(self, batch: Batch, reason: str | None) -> StepResult:
        dev = self.be.device
        f = _flat(batch)
        T = lambda v, dt=torch.int64: torch.tensor(v, dtype=dt, device=dev)  # noqa: E731
        logits_all = self.model.forward(
            T(f["tokens"]),
            T(f["positions"]),
            T(f["slots"]),
            T(f["qsl"]),
            T(f["seq_lens"]),
            T(f["tables"]).view(-1, SPEC.max_blocks_per_req),
            self.kc,
            self.vc,
            max(batch.query_lens),
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
        n = batch.num_reqs
        if n == 0:
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=self.be.device),
                torch.zeros(0, dtype=torch.int64, device=self.be.device),
                "eager",
                None,
                reason="empty batch",
            )
        if self.mode == "eager":
            return self.run_eager(batch, "eager twin")
        key, reason = self.graph_key(batch)
        if key is None:
            return self.run_eager(batch, reason)
        self.stage(batch, key)
        self.graphs[key].replay()
        logits, toks = self.outs[key]
        return StepResult(logits[:n].clone(), toks[:n].clone(), "full", key)

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
    return Runner(mode, seed=seed, backend=backend, check_tokens=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, backend=backend, check_tokens=False)
