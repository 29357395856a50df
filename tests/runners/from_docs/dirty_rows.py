"""A persistent-batch graph runner with dirty-row block-table uploads.

Requests occupy rows of a persistent batch keyed by req_id (as in vLLM's InputBatch). A request
absent from a step's batch is finished: its row is freed, new requests take the first free rows,
and remaining holes are closed by moving the last occupied row into them (condense). Graph mode
keeps a persistent device block table (max_num_reqs rows + one all-null row for padding) and a
host mirror; only rows marked dirty on the host are uploaded. The captured decode graph gathers
its block tables from the persistent device table through a per-step row index (batch order), and
computes each token's KV slot from that table. The eager path builds its tables fresh each step.

make_target: condense marks the destination row dirty.  make_buggy_target: it does not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime import backends

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=128,
    max_num_reqs=8,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling"}),
)
HIDDEN, HEADS, HEAD_DIM = 48, 2, 24
BS = SPEC.block_size
MAXB = SPEC.max_blocks_per_req
CTX = MAXB * BS
NULL = SPEC.null_block
NULL_ROW = SPEC.max_num_reqs  # the extra always-null row of the persistent table
M32 = 0xFFFFFFFF


# -- model ------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    tables: Tensor  # [T, MAXB]
    seeds: Tensor  # [R]
    temps: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R]; None when T == R


class Model:
    def __init__(self, seed: int, device: Any) -> None:
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> Tensor:
            return (torch.randn(shape, generator=g) / math.sqrt(shape[0])).to(device)

        self.embed = w(SPEC.vocab_size, HIDDEN)
        self.pos = w(CTX, HIDDEN)
        self.wq, self.wk, self.wv, self.wo = (w(HIDDEN, HIDDEN) for _ in range(4))
        self.up, self.down = w(HIDDEN, 2 * HIDDEN), w(2 * HIDDEN, HIDDEN)
        self.head = w(HIDDEN, SPEC.vocab_size)

    def forward(self, x_in: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        pos = x_in.positions
        # slot of each token, looked up in its block table (like a GPU slot-mapping kernel)
        col = (pos // BS)[:, None]
        slots = x_in.tables.gather(1, col).squeeze(1) * BS + pos % BS
        x = self.embed[x_in.tokens] + self.pos[pos]
        h = norm(x)
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        ctx_slots = (x_in.tables[:, :, None] * BS + torch.arange(BS, device=pos.device)).flatten(1)
        keys, vals = k_cache[ctx_slots], v_cache[ctx_slots]  # [T, CTX, H, D]
        vis = torch.arange(CTX, device=pos.device)[None, :] <= pos[:, None]  # [T, CTX]
        sc = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
        pr = sc.masked_fill(~vis[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(vis[:, :, None, None], vals, torch.zeros((), device=pos.device))
        x = x + torch.einsum("thc,tchd->thd", pr, vals).flatten(1) @ self.wo
        x = x + torch.nn.functional.gelu(norm(x) @ self.up) @ self.down
        if x_in.last is not None:
            x = x[x_in.last]
        return norm(x) @ self.head


def norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def sample(logits: Tensor, x_in: Inputs) -> Tensor:
    pos = x_in.positions if x_in.last is None else x_in.positions[x_in.last]
    key = hash32(hash32(x_in.seeds) ^ ((pos * 0x27D4EB2F) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = hash32(key[:, None] ^ ((ids * 0x165667B1) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / x_in.temps[:, None] - torch.log(-torch.log(u))
    return torch.where(x_in.sampled, noisy.argmax(-1), logits.argmax(-1))


def table_row(r: Request) -> list[int]:
    return list(r.block_ids) + [NULL] * (MAXB - len(r.block_ids))


def sampling_of(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


# -- persistent batch -------------------------------------------------------------------------------


class PersistentBatch:
    """Rows keyed by req_id; host mirror of the block table plus dirty flags."""

    def __init__(self, mark_moved_dirty: bool) -> None:
        self.mark_moved_dirty = mark_moved_dirty
        self.row_of: dict[int, int] = {}
        self.req_at: list[int | None] = [None] * SPEC.max_num_reqs
        self.seq_len: list[int] = [0] * SPEC.max_num_reqs
        self.host = [[NULL] * MAXB for _ in range(SPEC.max_num_reqs)]
        self.num_blocks = [0] * SPEC.max_num_reqs
        self.dirty: set[int] = set()

    def _continues(self, r: Request) -> bool:
        row = self.row_of.get(r.req_id)
        if row is None:
            return False
        n = self.num_blocks[row]
        # same request only if it picks up where it left off on the same blocks
        return r.context_len == self.seq_len[row] and list(r.block_ids[:n]) == self.host[row][:n]

    def update(self, batch: Batch) -> None:
        keep = {r.req_id for r in batch.requests if self._continues(r)}
        # 1. finished (or not recognisably the same) requests free their rows
        for req_id in [q for q in self.row_of if q not in keep]:
            row = self.row_of.pop(req_id)
            self.req_at[row] = None
            self.num_blocks[row] = 0
        # 2. continuing requests: append new blocks
        for r in batch.requests:
            if r.req_id in keep:
                row = self.row_of[r.req_id]
                n = self.num_blocks[row]
                if len(r.block_ids) > n:
                    self.host[row] = table_row(r)
                    self.num_blocks[row] = len(r.block_ids)
                    self.dirty.add(row)
                self.seq_len[row] = r.seq_len
        # 3. new requests take the first free row
        for r in batch.requests:
            if r.req_id not in keep:
                row = self.req_at.index(None)
                self.row_of[r.req_id] = row
                self.req_at[row] = r.req_id
                self.host[row] = table_row(r)
                self.num_blocks[row] = len(r.block_ids)
                self.seq_len[row] = r.seq_len
                self.dirty.add(row)
        # 4. condense: move the last occupied row into each hole
        n = len(self.row_of)
        last = SPEC.max_num_reqs - 1
        for hole in range(n):
            if self.req_at[hole] is not None:
                continue
            while self.req_at[last] is None:
                last -= 1
            req_id = self.req_at[last]
            assert req_id is not None and last > hole
            self.host[hole] = list(self.host[last])
            self.num_blocks[hole] = self.num_blocks[last]
            self.seq_len[hole] = self.seq_len[last]
            self.req_at[hole], self.req_at[last] = req_id, None
            self.row_of[req_id] = hole
            self.num_blocks[last] = 0
            if self.mark_moved_dirty:
                self.dirty.add(hole)

    def take_dirty(self) -> list[int]:
        rows = sorted(self.dirty)
        self.dirty.clear()
        return rows


# -- runner -----------------------------------------------------------------------------------------


class DirtyRowsRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, bug: bool = False
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.be: Any = backends.get(backend)
        dev = self.dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k = torch.zeros(shape, device=dev)
        self.v = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.pb = PersistentBatch(mark_moved_dirty=not bug)
            # persistent device block table; row NULL_ROW stays all-null for padding rows
            self.dev_table = torch.full(
                (SPEC.max_num_reqs + 1, MAXB), NULL, dtype=torch.int64, device=dev
            )
            rows, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "row_index": torch.full((rows,), NULL_ROW, dtype=i64, device=dev),
                "seeds": torch.zeros(rows, dtype=i64, device=dev),
                "temps": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
            }
            self.capture()

    # graph mode
    def graph_forward(self, size: int) -> tuple[Tensor, Tensor]:
        b = {name: t[:size] for name, t in self.buffers.items()}
        x_in = Inputs(
            b["tokens"],
            b["positions"],
            self.dev_table[b["row_index"]],
            b["seeds"],
            b["temps"],
            b["sampled"],
        )
        logits = self.model.forward(x_in, self.k, self.v)
        return logits, sample(logits, x_in)

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.fill(Batch(()), size)
            self.graph_forward(size)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[size] = self.graph_forward(size)
            self.graphs[size] = g

    def fill(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        samp = [sampling_of(r) for r in reqs]
        values = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "row_index": [self.pb.row_of[r.req_id] for r in reqs],
            "seeds": [s[0] for s in samp],
            "temps": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        pad = {
            "tokens": 0,
            "positions": 0,
            "row_index": NULL_ROW,
            "seeds": 0,
            "temps": 1.0,
            "sampled": False,
        }
        for name, vals in values.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(vals, dtype=buf.dtype, device=self.dev))
            buf[n:size].fill_(pad[name])

    def upload_dirty(self) -> None:
        rows = self.pb.take_dirty()
        if rows:
            idx = torch.tensor(rows, dtype=torch.int64, device=self.dev)
            vals = torch.tensor([self.pb.host[r] for r in rows], dtype=torch.int64, device=self.dev)
            self.dev_table.index_copy_(0, idx, vals)

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.fill(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # both modes
    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        toks, pos, tabs, last = [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                toks.append(t)
                pos.append(r.context_len + i)
                tabs.append(table_row(r))
            last.append(len(toks) - 1)
        samp = [sampling_of(r) for r in batch.requests]

        def t(v: list[Any], dt: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(v, dtype=dt, device=self.dev)

        x_in = Inputs(
            t(toks),
            t(pos),
            t(tabs).view(-1, MAXB),
            t([s[0] for s in samp]),
            t([s[1] for s in samp], torch.float32),
            t([s[2] for s in samp], torch.bool),
            t(last),
        )
        logits = self.model.forward(x_in, self.k, self.v)
        return StepResult(logits, sample(logits, x_in), "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "query length > 1"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "above the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        if self.mode == "graph":
            self.pb.update(batch)
            self.upload_dirty()
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k, "v": self.v}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        raise NotImplementedError("no weight_update feature")

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DirtyRowsRunner:
    return DirtyRowsRunner(mode, seed=seed, backend=backend, bug=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> DirtyRowsRunner:
    return DirtyRowsRunner(mode, seed=seed, backend=backend, bug=True)
