"""A runner that splits a mixed step into a prefill graph and a decode graph sharing one pool.

Written against the backend facade (`pytest_graphmode.runtime.backends.get(backend)`).
Two graph sets: decode graphs keyed by rows (1, 2, 4, 8; one-token rows of continuing requests)
and prefill graphs keyed by tokens (1, 2, 4, 8, 16; every other request's tokens). Both are
captured into ONE graph pool (`graph_pool_handle()`), decode first, to save memory, as engines do
with a global graph pool. A mixed step replays the prefill graph for its new requests, then the
decode graph for its continuing ones, then builds the step's logits in batch order. A part that
does not fit a graph runs eagerly.

The model: one attention layer over a slot-major paged KV cache, then an LM head.

`make_buggy_target`: the step collects each graph's logits only after all graphs replayed. The
prefill graph's output lives in pool memory the decode graphs' capture had freed (their
temporaries), so the decode replay overwrites it before it is read. This is PyTorch's warning on
sharing a pool across captures: safe only when one graph's outputs are not needed after the
other runs.
`make_target`: copies each graph's rows out as soon as it replays (before the next replay).
`make_target_separate_pools`: collects late like the buggy one, but each set has its own pool.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime import backends

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8, 16),
    features=frozenset({"decode", "prefill"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
MAXB = SPEC.max_blocks_per_req
DECODE_SIZES = (1, 2, 4, 8)
PREFILL_SIZES = SPEC.capture_sizes
PADDING = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "seq_lens": 1,
    "tables": SPEC.null_block,
}


class Runner:
    def __init__(
        self, mode: str, *, seed: int, backend: str, collect_early: bool, shared_pool: bool
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.be = backends.get(backend)
        self.collect_early = collect_early
        self.device = torch.device(self.be.device)
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 4 * HIDDEN),
            "down": (4 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {n: torch.empty(s, device=self.device) for n, s in shapes.items()}
        self.update_weights(seed)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=self.device)
        self.static: dict[str, dict[str, Tensor]] = {}
        self.graphs: dict[tuple[str, int], object] = {}
        self.outputs: dict[tuple[str, int], Tensor] = {}
        if mode == "graph":
            for kind, rows in (("decode", max(DECODE_SIZES)), ("prefill", max(PREFILL_SIZES))):
                self.static[kind] = {
                    "tokens": torch.zeros(rows, dtype=torch.int64, device=self.device),
                    "positions": torch.zeros(rows, dtype=torch.int64, device=self.device),
                    "slots": torch.full((rows,), NULL_SLOT, dtype=torch.int64, device=self.device),
                    "seq_lens": torch.ones(rows, dtype=torch.int64, device=self.device),
                    "tables": torch.zeros(rows, MAXB, dtype=torch.int64, device=self.device),
                }
            self._capture(shared_pool)

    # -- model ------------------------------------------------------------------------------------

    def update_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            w = self.weights[name]
            w.copy_(
                (torch.randn(w.shape, generator=generator) / math.sqrt(w.shape[0])).to(w.device)
            )

    def _forward(
        self, tokens: Tensor, positions: Tensor, slots: Tensor, seq_lens: Tensor, tables: Tensor
    ) -> Tensor:
        """Logits [t, V] for t token rows; writes their keys and values first."""
        w = self.weights
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        context = (tables[:, :, None] * bs + torch.arange(bs, device=x.device)).flatten(1)
        keys, values = self.k_cache[context], self.v_cache[context]
        idx = torch.arange(CONTEXT, device=x.device)[None, :]
        visible = (idx <= positions[:, None]) & (idx < seq_lens[:, None])
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(
            HEAD_DIM
        )
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), float("-inf"), device=x.device)
        )
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        h = x + torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1) @ w["o"]
        h = h + torch.nn.functional.gelu(h @ w["up"]) @ w["down"]
        return h @ w["head"]

    def _rows(self, reqs) -> dict[str, list]:
        """Host inputs of the token rows of `reqs`, in order; `last`: each request's last row."""
        out = {"tokens": [], "positions": [], "slots": [], "seq_lens": [], "tables": [], "last": []}
        for r in reqs:
            for j, token in enumerate(r.tokens):
                pos = r.context_len + j
                out["tokens"].append(token)
                out["positions"].append(pos)
                out["slots"].append(kv_slot(r.block_ids, pos, SPEC.block_size))
                out["seq_lens"].append(r.seq_len)
                out["tables"].append(
                    list(r.block_ids) + [SPEC.null_block] * (MAXB - len(r.block_ids))
                )
            out["last"].append(len(out["tokens"]) - 1)
        return out

    def _eager(self, reqs) -> Tensor:
        rows = self._rows(reqs)
        t = {
            n: torch.tensor(rows[n], dtype=torch.int64, device=self.device)
            for n in ("tokens", "positions", "slots", "seq_lens", "tables", "last")
        }
        logits = self._forward(t["tokens"], t["positions"], t["slots"], t["seq_lens"], t["tables"])
        return logits[t["last"]]

    # -- graphs -----------------------------------------------------------------------------------

    def _graph_forward(self, kind: str, size: int) -> Tensor:
        s = self.static[kind]
        return self._forward(
            s["tokens"][:size],
            s["positions"][:size],
            s["slots"][:size],
            s["seq_lens"][:size],
            s["tables"][:size],
        )

    def _capture(self, shared_pool: bool) -> None:
        shared = self.be.graph_pool_handle() if shared_pool else None
        for kind, sizes in (("decode", DECODE_SIZES), ("prefill", PREFILL_SIZES)):
            pool = shared if shared_pool else self.be.graph_pool_handle()
            for size in sorted(sizes, reverse=True):
                self._graph_forward(kind, size)  # warm-up (padding rows: the null slot only)
                self.be.synchronize()
                g = self.be.Graph()
                with self.be.graph(g, pool=pool):
                    self.outputs[(kind, size)] = self._graph_forward(kind, size)
                self.graphs[(kind, size)] = g
        self.be.synchronize()

    def _stage(self, kind: str, reqs, size: int) -> None:
        rows = self._rows(reqs)
        n = len(rows["tokens"])
        s = self.static[kind]
        for name, pad in PADDING.items():
            values = rows[name] + [[pad] * MAXB if name == "tables" else pad] * (size - n)
            s[name][:size].copy_(torch.tensor(values, dtype=torch.int64, device=self.device))

    # -- contract ---------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        reqs = batch.requests
        if not reqs:
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=self.device),
                torch.zeros(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason="empty batch",
            )
        if self.mode == "eager":
            logits = self._eager(reqs)
            return StepResult(logits, logits.argmax(-1), "eager", None, reason="eager twin")
        decode = [i for i, r in enumerate(reqs) if r.context_len > 0 and r.query_len == 1]
        prefill = [i for i in range(len(reqs)) if i not in set(decode)]
        # parts in the order they run: prefill first, then decode
        parts = []
        if prefill:
            parts.append(
                ("prefill", prefill, sum(reqs[i].query_len for i in prefill), PREFILL_SIZES)
            )
        if decode:
            parts.append(("decode", decode, len(decode), DECODE_SIZES))
        logits = torch.empty(len(reqs), SPEC.vocab_size, device=self.device)
        keys, eager_parts, pending = [], [], []
        for kind, idx, rows, sizes in parts:
            part = [reqs[i] for i in idx]
            size = next((s for s in sizes if s >= rows), None)
            index = torch.tensor(idx, dtype=torch.int64, device=self.device)
            if size is None:
                eager_parts.append(kind)
                logits.index_copy_(0, index, self._eager(part))
                continue
            self._stage(kind, part, size)
            self.graphs[(kind, size)].replay()
            keys.append((kind, size))
            out = self.outputs[(kind, size)]
            last = torch.tensor(self._rows(part)["last"], dtype=torch.int64, device=self.device)
            if self.collect_early:
                logits.index_copy_(0, index, out[last])
            else:
                pending.append((index, out, last))
        for index, out, last in pending:  # buggy: read after every graph replayed
            logits.index_copy_(0, index, out[last])
        if not keys:
            return StepResult(logits, logits.argmax(-1), "eager", None, reason="no graph fits")
        path = "piecewise" if eager_parts else "full"
        return StepResult(
            logits,
            logits.argmax(-1),
            path,
            tuple(keys),
            reason=f"eager: {eager_parts}" if eager_parts else None,
        )

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode != "graph":
            return {}
        return {f"{kind}.{n}": t for kind, d in self.static.items() for n, t in d.items()}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def close(self) -> None:
        self.be.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, backend=backend, collect_early=True, shared_pool=True)


def make_target_separate_pools(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> Runner:
    return Runner(mode, seed=seed, backend=backend, collect_early=False, shared_pool=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, backend=backend, collect_early=False, shared_pool=True)
