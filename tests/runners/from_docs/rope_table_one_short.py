"""A tiny rotary-embedding decoder with a paged, slot-major KV cache.

Graph mode captures one decode graph per capture size (request rows padded up to it) through the
backend facade, largest first into one pool; every other batch runs eagerly. Rotary embeddings use
a precomputed cos/sin table gathered on the device by each token's position, with the same code in
both modes. `make_buggy_target` builds that table one position short (positions 0 .. max_len - 2),
so a request that reaches the longest context the spec allows indexes past it.
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
    max_blocks_per_req=6,
    vocab_size=128,
    max_num_reqs=8,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_LEN = SPEC.max_blocks_per_req * SPEC.block_size  # a sequence may reach MAX_LEN tokens
NULL_SLOT = SPEC.null_block * SPEC.block_size
ROPE_BASE = 10000.0
M32 = 0xFFFFFFFF


def rope_table(length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos/sin for positions 0 .. length - 1, [length, HEAD_DIM // 2]."""
    inv = ROPE_BASE ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, dim]; cos/sin: [T, dim/2] (rotate-half form)."""
    half = HEAD_DIM // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def hash32(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x7FEB352D) & M32
    x = (((x >> 15) ^ x) * 0x846CA68B) & M32
    return (x >> 16) ^ x


class RopeModel:
    def __init__(self, seed: int, device: torch.device, table_len: int) -> None:
        self.device = device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "w1": (HIDDEN, 2 * HIDDEN),
            "w2": (2 * HIDDEN, HIDDEN),
            "lm": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.cos, self.sin = rope_table(table_len, device)
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def forward(self, inp: dict[str, Tensor], k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        pos = inp["positions"]
        x = w["embed"][inp["tokens"]]
        h = rms(x)
        cos, sin = self.cos[pos], self.sin[pos]  # the table gathered by position, no clamping
        q = apply_rope((h @ w["wq"]).view(-1, HEADS, HEAD_DIM), cos, sin)
        k = apply_rope((h @ w["wk"]).view(-1, HEADS, HEAD_DIM), cos, sin)
        v = (h @ w["wv"]).view(-1, HEADS, HEAD_DIM)
        k_cache.index_copy_(0, inp["slots"], k)
        v_cache.index_copy_(0, inp["slots"], v)
        bs = SPEC.block_size
        ctx = (inp["tables"][:, :, None] * bs + torch.arange(bs, device=x.device)).flatten(1)
        keys, vals = k_cache[ctx], v_cache[ctx]  # [T, MAX_LEN, heads, dim]
        seen = torch.arange(MAX_LEN, device=x.device)[None, :] <= pos[:, None]  # [T, MAX_LEN]
        keys = torch.where(seen[:, :, None, None], keys, torch.zeros((), device=x.device))
        vals = torch.where(seen[:, :, None, None], vals, torch.zeros((), device=x.device))
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        attn = torch.einsum("thc,tchd->thd", probs, vals).reshape(-1, HIDDEN)
        x = x + attn @ w["wo"]
        x = x + torch.nn.functional.silu(rms(x) @ w["w1"]) @ w["w2"]
        if "last" in inp:
            x = x[inp["last"]]
        return rms(x) @ w["lm"]


def sample(logits: Tensor, inp: dict[str, Tensor]) -> Tensor:
    pos = inp["positions"] if "last" not in inp else inp["positions"][inp["last"]]
    key = hash32(hash32(inp["seeds"]) ^ ((pos * 0x9E3779B1) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = hash32(key[:, None] ^ ((ids * 0x27D4EB2F) & M32)[None, :])
    u = (bits >> 9).float() * 2.0**-23 + 2.0**-24
    noisy = logits / inp["temperatures"][:, None] - torch.log(-torch.log(u))
    return torch.where(inp["sampled"], noisy.argmax(-1), logits.argmax(-1))


PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def slot_of(r: Request, p: int) -> int:
    return r.block_ids[p // SPEC.block_size] * SPEC.block_size + p % SPEC.block_size


def table_of(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def sampling_of(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


class RopeRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, table_len: int) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = RopeModel(seed, dev, table_len)
        self.k = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outs: dict[int, tuple[Tensor, Tensor]] = {}
        self.bufs: dict[str, Tensor] = {}
        if mode == "graph":
            n, i64 = SPEC.capture_sizes[-1], torch.int64
            self.bufs = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.full((n,), NULL_SLOT, dtype=i64, device=dev),
                "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(n, dtype=i64, device=dev),
                "temperatures": torch.ones(n, device=dev),
                "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
            }
            self._capture()

    def _run(self, inp: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, self.k, self.v)
        return logits, sample(logits, inp)

    def _view(self, size: int) -> dict[str, Tensor]:
        return {k: b[:size] for k, b in self.bufs.items()}

    def _capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in reversed(SPEC.capture_sizes):
            self._stage(Batch(()), size)
            inp = self._view(size)
            self._run(inp)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outs[size] = self._run(inp)
            self.graphs[size] = g

    def _stage(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        samp = [sampling_of(r) for r in reqs]
        rows = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [slot_of(r, r.context_len) for r in reqs],
            "tables": [table_of(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temperatures": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        for name, vals in rows.items():
            buf = self.bufs[name]
            if n:
                buf[:n].copy_(torch.tensor(vals, dtype=buf.dtype))
            buf[n:size].fill_(PAD[name])

    def _fallback(self, batch: Batch) -> str | None:
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

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.be.device
        tok, pos, slots, tabs, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                p = r.context_len + i
                tok.append(t)
                pos.append(p)
                slots.append(slot_of(r, p))
                tabs.append(table_of(r))
            last.append(len(tok) - 1)
        samp = [sampling_of(r) for r in batch.requests]
        i64 = torch.int64
        inp = {
            "tokens": torch.tensor(tok, dtype=i64, device=dev),
            "positions": torch.tensor(pos, dtype=i64, device=dev),
            "slots": torch.tensor(slots, dtype=i64, device=dev),
            "tables": torch.tensor(tabs, dtype=i64, device=dev).view(-1, SPEC.max_blocks_per_req),
            "seeds": torch.tensor([s[0] for s in samp], dtype=i64, device=dev),
            "temperatures": torch.tensor([s[1] for s in samp], dtype=torch.float32, device=dev),
            "sampled": torch.tensor([s[2] for s in samp], dtype=torch.bool, device=dev),
            "last": torch.tensor(last, dtype=i64, device=dev),
        }
        logits, tokens = self._run(inp)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        reason = self._fallback(batch)
        if reason is not None:
            return self._eager(batch, reason)
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self._stage(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

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


def _make(mode: Literal["graph", "eager"], seed: int, backend: str, buggy: bool) -> RopeRunner:
    table_len = MAX_LEN - 1 if buggy else MAX_LEN  # the bug: one position short
    return RopeRunner(mode, seed=seed, backend=backend, table_len=table_len)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RopeRunner:
    return _make(mode, seed, backend, buggy=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> RopeRunner:
    return _make(mode, seed, backend, buggy=True)
