"""A graph runner whose decode replays advance positions and slot mappings on the device.

Graph mode keeps each row's last position and slot in persistent device buffers (owned by the
runner: neither state() nor static_buffers()). A decode step whose batch continues the last step
row for row is not re-uploaded: positions += 1 and the slot is recomputed from the block table on
the device (a multi-step scheduler's "advance step"). Any other batch is uploaded from the host.
Decode batches up to the largest capture size replay a graph captured through the backend facade;
everything else runs eagerly. `make_buggy_target` decides "same batch" from the request ids alone.
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
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
BS = SPEC.block_size
NULL_SLOT = SPEC.null_block * BS
M32 = 0xFFFFFFFF


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x7FEB352D) & M32
    x = (((x >> 15) ^ x) * 0x846CA68B) & M32
    return (x >> 16) ^ x


class Model:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "emb": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_POS, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "w1": (HIDDEN, 2 * HIDDEN),
            "w2": (2 * HIDDEN, HIDDEN),
            "out": (HIDDEN, SPEC.vocab_size),
        }
        self.device = device
        self.w = {k: torch.zeros(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for k in sorted(self.w):
            t = self.w[k]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(self.device))

    def forward(
        self, x_in: dict[str, Tensor], k_cache: Tensor, v_cache: Tensor
    ) -> tuple[Tensor, Tensor]:
        w = self.w
        tok, pos, slot, table = x_in["tokens"], x_in["positions"], x_in["slots"], x_in["tables"]
        x = w["emb"][tok] + w["pos"][pos]
        h = _norm(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, slot, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, slot, v.view(-1, HEADS, HEAD_DIM))
        ctx = (table[:, :, None] * BS + torch.arange(BS, device=tok.device)).flatten(
            1
        )  # [T, MAX_POS]
        keys, vals = k_cache[ctx], v_cache[ctx]
        seen = torch.arange(MAX_POS, device=tok.device)[None, :] <= pos[:, None]  # [T, MAX_POS]
        sc = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
        p = sc.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(seen[:, :, None, None], vals, torch.zeros((), device=tok.device))
        x = x + torch.einsum("thc,tchd->thd", p, vals).flatten(1) @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["w1"]) @ w["w2"]
        last = x_in.get("last")
        if last is not None:
            x, pos = x[last], pos[last]
        logits = _norm(x) @ w["out"]
        # Gumbel-max, noise hashed from (seed, position, token id).
        key = _hash(_hash(x_in["seeds"]) ^ ((pos * 0x9E3779B1) & M32))
        ids = torch.arange(SPEC.vocab_size, device=tok.device)
        bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
        u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = logits / x_in["temps"][:, None] - torch.log(-torch.log(u))
        return logits, torch.where(x_in["sampled"], noisy.argmax(-1), logits.argmax(-1))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _slot(r: Request, p: int) -> int:
    return r.block_ids[p // BS] * BS + p % BS


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


PADDING = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
}


class AdvanceRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, buggy: bool) -> None:
        assert mode in ("graph", "eager")
        self.spec, self.mode, self.buggy = SPEC, mode, buggy
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k, self.v = torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buf: dict[str, Tensor] = {}
        # the runner's own shortcut: each row's last position and slot, on the device
        self.row_pos = torch.zeros(SPEC.max_num_reqs, dtype=torch.int64, device=dev)
        self.row_slot = torch.zeros(SPEC.max_num_reqs, dtype=torch.int64, device=dev)
        self.last: list[tuple[int, int, tuple[int, ...]]] | None = None  # (req_id, seq_len, blocks)
        if mode == "graph":
            n, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buf = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.zeros(n, dtype=i64, device=dev),
                "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(n, dtype=i64, device=dev),
                "temps": torch.ones(n, device=dev),
                "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
            }
            self._capture()

    # -- graph mode ------------------------------------------------------------------------------
    def _inputs(self, size: int) -> dict[str, Tensor]:
        return {k: b[:size] for k, b in self.buf.items()}

    def _capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            for k, b in self.buf.items():
                b.fill_(PADDING[k])
            inp = self._inputs(size)
            self.model.forward(inp, self.k, self.v)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outs[size] = self.model.forward(inp, self.k, self.v)
            self.graphs[size] = g

    def _continues(self, batch: Batch) -> bool:
        """Does this decode batch continue the last step row for row?"""
        last = self.last
        if last is None or len(last) != batch.num_reqs:
            return False
        if self.buggy:
            return [r.req_id for r in batch.requests] == [e[0] for e in last]
        return all(
            r.req_id == rid and r.context_len == seq_len and r.block_ids[: len(blocks)] == blocks
            for r, (rid, seq_len, blocks) in zip(batch.requests, last, strict=True)
        )

    def _upload_rows(self, batch: Batch) -> None:
        """Host upload of each row's last-token position and slot into the persistent buffers."""
        n = batch.num_reqs
        pos = [r.seq_len - 1 for r in batch.requests]
        slots = [_slot(r, r.seq_len - 1) for r in batch.requests]
        self.row_pos[:n].copy_(torch.tensor(pos, dtype=torch.int64))
        self.row_slot[:n].copy_(torch.tensor(slots, dtype=torch.int64))

    def _replay(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        size = next(s for s in SPEC.capture_sizes if s >= n)
        b = self.buf
        reqs = batch.requests
        samp = [_sampling(r) for r in reqs]
        host = {
            "tokens": [r.tokens[0] for r in reqs],
            "tables": [_table(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temps": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        for k, vals in host.items():
            b[k][:n].copy_(torch.tensor(vals, dtype=b[k].dtype))
        if self._continues(batch):  # advance step on the device
            self.row_pos[:n] += 1
            p = self.row_pos[:n]
            col = torch.div(p, BS, rounding_mode="floor").clamp(max=SPEC.max_blocks_per_req - 1)
            blk = b["tables"][:n].gather(1, col[:, None])[:, 0]
            self.row_slot[:n].copy_(blk * BS + p % BS)
        else:
            self._upload_rows(batch)
        b["positions"][:n].copy_(self.row_pos[:n])
        b["slots"][:n].copy_(self.row_slot[:n])
        for k, buf in b.items():
            buf[n:size].fill_(PADDING[k])
        self.graphs[size].replay()
        logits, toks = self.outs[size]
        return StepResult(logits[:n].clone(), toks[:n].clone(), "full", ("decode", size))

    # -- both modes ------------------------------------------------------------------------------
    def _eager(self, batch: Batch, reason: str) -> StepResult:
        if batch.num_reqs == 0:
            dev = self.be.device
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=dev),
                torch.zeros(0, dtype=torch.int64, device=dev),
                "eager",
                None,
                reason,
            )
        tok, pos, slot, tab, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                p = r.context_len + i
                tok.append(t), pos.append(p), slot.append(_slot(r, p)), tab.append(_table(r))
            last.append(len(tok) - 1)
        samp = [_sampling(r) for r in batch.requests]
        dev = self.be.device

        def t(v: list[Any], dt: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(v, dtype=dt, device=dev)

        inp = {
            "tokens": t(tok),
            "positions": t(pos),
            "slots": t(slot),
            "tables": t(tab),
            "seeds": t([s[0] for s in samp]),
            "temps": t([s[1] for s in samp], torch.float32),
            "sampled": t([s[2] for s in samp], torch.bool),
            "last": t(last),
        }
        logits, toks = self.model.forward(inp, self.k, self.v)
        if self.mode == "graph":
            self._upload_rows(batch)  # any other batch is uploaded from the host
        return StepResult(logits, toks, "eager", None, reason)

    def _reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode" or batch.query_lens[0] != 1:
            return f"{batch.phase} batch with query lengths {batch.query_lens}"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self._reason(batch)
        res = self._replay(batch) if reason is None else self._eager(batch, reason)
        self.last = [(r.req_id, r.seq_len, tuple(r.block_ids)) for r in batch.requests]
        return res

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.k, "v0": self.v}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buf

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> AdvanceRunner:
    return AdvanceRunner(mode, seed=seed, backend=backend, buggy=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> AdvanceRunner:
    return AdvanceRunner(mode, seed=seed, backend=backend, buggy=True)
