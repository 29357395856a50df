"""A double-buffered ("ping"/"pong") graph runner that overlaps host preparation of step N+1 with
the device work of step N, as engines with asynchronous scheduling do.

Two sets of persistent inputs, each a pinned host staging buffer uploaded with non_blocking copies
into a device buffer, and one captured decode graph per capture size per set. Every step (graph
or eager) stages its inputs into the set the previous step did not use; before the host rewrites a
set's staging it waits for the event recorded after the step that last used that set. Nothing
else orders the sets and nothing synchronizes the device between steps.

`make_buggy_target` flips the set only after graph steps (not after eager ones), so a graph step
right after an eager step rewrites the staging the eager step's upload may still be reading, and
waits only for the older step that used that set before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
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
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling"}),
)
HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 64
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
T_MAX, R_MAX, MB = SPEC.max_num_tokens, SPEC.max_num_reqs, SPEC.max_blocks_per_req
M32 = 0xFFFFFFFF
SET_NAMES = ("ping", "pong")

# Packed int64 layout of one set: (name, words per row, rows)
INT_FIELDS = (
    ("tokens", 1, T_MAX),
    ("positions", 1, T_MAX),
    ("slots", 1, T_MAX),
    ("tables", MB, T_MAX),
    ("last", 1, R_MAX),
    ("seeds", 1, R_MAX),
    ("sampled", 1, R_MAX),
)
INT_WORDS = sum(w * r for _, w, r in INT_FIELDS)
PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "last": 0,
    "seeds": 0,
    "sampled": 0,
    "temperatures": 1.0,
}


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, MB]
    seeds: Tensor  # [R]
    sampled: Tensor  # [R] int64 0/1
    temperatures: Tensor  # [R] float32
    last: Tensor | None  # [R] or None when every row is one token (decode graph)


# ---------------------------------------------------------------------------------------------
# model


class Model:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "emb": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_POS, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "w1": (HIDDEN, FFN),
            "w2": (FFN, HIDDEN),
            "lm": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.device = device
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed * 7919 + 17)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def forward(self, x: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        h = w["emb"][x.tokens] + w["pos"][x.positions]
        n = _norm(h)
        q, k, v = n @ w["wq"], n @ w["wk"], n @ w["wv"]
        k_cache.index_copy_(0, x.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x.slots, v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        ctx = (x.tables[:, :, None] * bs + torch.arange(bs, device=h.device)).flatten(1)  # [T, P]
        keys, vals = k_cache[ctx], v_cache[ctx]  # [T, P, H, D]
        seen = torch.arange(MAX_POS, device=h.device)[None, :] <= x.positions[:, None]  # [T, P]
        att = torch.einsum("thd,tphd->thp", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
        att = att.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(seen[:, :, None, None], vals, torch.zeros((), device=h.device))
        h = h + torch.einsum("thp,tphd->thd", att, vals).flatten(1) @ w["wo"]
        h = h + torch.nn.functional.gelu(_norm(h) @ w["w1"]) @ w["w2"]
        if x.last is not None:
            h = h[x.last]
        return _norm(h) @ w["lm"]


def _norm(h: Tensor) -> Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def sample(logits: Tensor, x: Inputs) -> Tensor:
    """Gumbel-max, noise from a hash of (seed, position of the last query token, token id)."""
    pos = x.positions if x.last is None else x.positions[x.last]
    key = _hash(_hash(x.seeds) ^ ((pos * 0x61C88647) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x7FEB352D) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / x.temperatures[:, None] - torch.log(-torch.log(u))
    return torch.where(x.sampled != 0, noisy.argmax(-1), logits.argmax(-1))


# ---------------------------------------------------------------------------------------------
# host-side rows


def _slot(r: Request, p: int) -> int:
    return r.block_ids[p // SPEC.block_size] * SPEC.block_size + p % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (MB - len(r.block_ids))


def _rows(batch: Batch) -> dict[str, list[Any]]:
    """Token rows (every query token) and request rows of a batch."""
    out: dict[str, list[Any]] = {k: [] for k in PAD}
    for r in batch.requests:
        for i, tok in enumerate(r.tokens):
            p = r.context_len + i
            out["tokens"].append(tok)
            out["positions"].append(p)
            out["slots"].append(_slot(r, p))
            out["tables"].append(_table(r))
        out["last"].append(len(out["tokens"]) - 1)
        greedy = r.seed is None
        out["seeds"].append(0 if greedy else r.seed & M32)
        out["sampled"].append(0 if greedy else 1)
        out["temperatures"].append(1.0 if greedy else r.temperature)
    return out


# ---------------------------------------------------------------------------------------------
# runner


class PingPongRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, bug: bool = False
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.bug = bug
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        self.k = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.graphs: list[dict[int, Any]] = [{}, {}]
        self.outputs: list[dict[int, tuple[Tensor, Tensor]]] = [{}, {}]
        self.buffers: dict[str, Tensor] = {}
        self.index = 0  # the set the next step uses
        if mode == "graph":
            self._allocate()
            self._capture()

    # -- the two sets ---------------------------------------------------------------------------

    def _allocate(self) -> None:
        dev = self.be.device
        self.dev_ints, self.dev_floats, self.pin_ints, self.pin_floats = [], [], [], []
        self.views: list[dict[str, Tensor]] = []
        self.staging: list[dict[str, np.ndarray]] = []
        self.events = [self.be.Event(), self.be.Event()]
        for name in SET_NAMES:
            d_i = torch.zeros(INT_WORDS, dtype=torch.int64, device=dev)
            d_f = torch.ones(R_MAX, dtype=torch.float32, device=dev)
            p_i = self.be.empty_pinned(INT_WORDS, dtype=torch.int64)
            p_f = self.be.empty_pinned(R_MAX, dtype=torch.float32)
            views, stage, off = {}, {}, 0
            for field, width, rows in INT_FIELDS:
                shape = (rows, width) if field == "tables" else (rows,)
                views[field] = d_i[off : off + width * rows].view(shape)
                stage[field] = p_i[off : off + width * rows].view(shape).numpy()
                off += width * rows
            views["temperatures"] = d_f
            stage["temperatures"] = p_f.numpy()
            for field, arr in stage.items():
                arr[...] = PAD[field]
            self.dev_ints.append(d_i)
            self.dev_floats.append(d_f)
            self.pin_ints.append(p_i)
            self.pin_floats.append(p_f)
            self.views.append(views)
            self.staging.append(stage)
            for field, view in views.items():
                self.buffers[f"{name}.{field}"] = view

    def _stage(self, s: int, rows: dict[str, list[Any]], token_rows: int, req_rows: int) -> None:
        """Host writes into set s's pinned staging: valid rows, then padding up to the given rows."""
        st = self.staging[s]
        for field, arr in st.items():
            values = rows[field]
            n = len(values)
            limit = token_rows if field in ("tokens", "positions", "slots", "tables") else req_rows
            if n:
                arr[:n] = np.asarray(values, dtype=arr.dtype)
            arr[n:limit] = PAD[field]

    def _upload(self, s: int) -> None:
        self.dev_ints[s].copy_(self.pin_ints[s], non_blocking=True)
        self.dev_floats[s].copy_(self.pin_floats[s], non_blocking=True)

    def _set_inputs(self, s: int, tokens: int, reqs: int, decode: bool) -> Inputs:
        v = self.views[s]
        return Inputs(
            tokens=v["tokens"][:tokens],
            positions=v["positions"][:tokens],
            slots=v["slots"][:tokens],
            tables=v["tables"][:tokens],
            seeds=v["seeds"][:reqs],
            sampled=v["sampled"][:reqs],
            temperatures=v["temperatures"][:reqs],
            last=None if decode else v["last"][:reqs],
        )

    def _flip(self) -> None:
        """Mark the end of the current set's use and move to the other set."""
        self.events[self.index].record()
        self.index ^= 1

    def _capture(self) -> None:
        for s in range(2):
            pool = self.be.graph_pool_handle()
            for size in sorted(SPEC.capture_sizes, reverse=True):
                self._stage(s, _rows(Batch(())), size, size)
                self._upload(s)
                inputs = self._set_inputs(s, size, size, decode=True)
                self._run(inputs)  # warm-up
                self.be.synchronize()
                g = self.be.Graph()
                with self.be.graph(g, pool=pool):
                    self.outputs[s][size] = self._run(inputs)
                self.graphs[s][size] = g
        self.be.synchronize()

    # -- steps ----------------------------------------------------------------------------------

    def _run(self, x: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(x, self.k, self.v)
        return logits, sample(logits, x)

    def _graph_size(self, batch: Batch) -> int | None:
        if self.mode != "graph" or batch.phase != "decode" or batch.query_lens[0] != 1:
            return None
        return next((c for c in SPEC.capture_sizes if c >= batch.num_reqs), None)

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        dev = self.be.device
        if n == 0:
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=dev),
                torch.zeros(0, dtype=torch.int64, device=dev),
                "eager",
                None,
                "empty",
            )
        rows = _rows(batch)
        if self.mode == "eager":
            x = Inputs(
                tokens=torch.tensor(rows["tokens"], dtype=torch.int64, device=dev),
                positions=torch.tensor(rows["positions"], dtype=torch.int64, device=dev),
                slots=torch.tensor(rows["slots"], dtype=torch.int64, device=dev),
                tables=torch.tensor(rows["tables"], dtype=torch.int64, device=dev).view(-1, MB),
                seeds=torch.tensor(rows["seeds"], dtype=torch.int64, device=dev),
                sampled=torch.tensor(rows["sampled"], dtype=torch.int64, device=dev),
                temperatures=torch.tensor(rows["temperatures"], dtype=torch.float32, device=dev),
                last=torch.tensor(rows["last"], dtype=torch.int64, device=dev),
            )
            logits, tokens = self._run(x)
            return StepResult(logits, tokens, "eager", None, "eager twin")

        size = self._graph_size(batch)
        s = self.index
        self.events[s].synchronize()  # the step that last used this set is done with it
        if size is not None:
            self._stage(s, rows, size, size)
            self._upload(s)
            self.graphs[s][size].replay()
            logits, tokens = self.outputs[s][size]
            result = StepResult(
                logits[:n].clone(), tokens[:n].clone(), "full", (SET_NAMES[s], size)
            )
        else:
            t = batch.num_tokens
            self._stage(s, rows, t, n)
            self._upload(s)
            logits, tokens = self._run(self._set_inputs(s, t, n, decode=False))
            reason = (
                f"{batch.phase} batch"
                if batch.phase != "decode"
                else "more requests than the largest capture size"
            )
            result = StepResult(logits, tokens, "eager", None, reason)
        if size is not None or not self.bug:
            self._flip()
        return result

    # -- contract -------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k, "v": self.v}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for graphs in self.graphs:
            for g in graphs.values():
                g.reset()
            graphs.clear()
        for outs in self.outputs:
            outs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PingPongRunner:
    return PingPongRunner(mode, seed=seed, backend=backend, bug=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PingPongRunner:
    return PingPongRunner(mode, seed=seed, backend=backend, bug=True)
