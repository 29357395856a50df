"""A greedy decode runner with an SGLang-style persistent running batch.

Design (after SGLang's ``ScheduleBatch`` and its CUDA-graph runner): the runner keeps the running
requests of the last step as a batch of its own. Each request holds a slot of a ``req_to_token``
pool (one row of token-to-KV-slot entries per slot, row 0 kept for padding), and the batch keeps two
per-row device tensors that persist from step to step: ``req_pool_indices`` (the request's pool
row) and ``seq_lens`` (its cached tokens, advanced in place after every forward). A step reconciles
the harness's batch with the running batch the way the scheduler does: requests that left (or no
longer match what the runner knows of them: another ``context_len``, other blocks) are dropped with
``filter_batch(keep_indices)``, the new ones get a pool slot and are appended with
``merge_batch``; the host mirrors of ``seq_lens`` and the block lists are what the batch is checked
against. Rows keep the runner's order and the results are put back into the batch's order. Decode
rows take their KV slot on the device, as SGLang's paged decode allocation does from
``get_last_loc``: the slot after the last one of their pool row, or the first slot of the next block
(handed out by the host) when they start one; other tokens get their slot from the host. The
slot is written into the pool row at the row's device length, and attention reads the pool row.
Decode steps (every row one query token, at most the largest capture size) replay one full CUDA
graph per capture size, keyed by the padded request count; prefill and mixed steps run eagerly on
the same persistent batch. Greedy only: the spec has no ``sampling``.

The bug (``make_buggy_target``): ``filter_batch`` keeps the per-row device tensors by truncating
them to the new length (``t[: len(keep)]``) instead of gathering the kept rows (``t[keep]``), while
the host request list is gathered correctly. This is SGLang's ``EagleDraftInput.filter_batch``
before https://github.com/sgl-project/sglang/pull/9252 (fixing
https://github.com/sgl-project/sglang/issues/8671, "Got unexpected answer while using EAGLE3"):
per-request spec state (``topk_p``, ``topk_index``, ``hidden_states``, ``verified_id``) was kept
with ``[: len(new_indices)]`` on the assumption that finished requests had already been dropped
from the tail; when a request that is not the last one left (filtered right after draft extend),
the state of the removed request stayed and every later request took the row before its own, and
concurrent requests got meaningless answers. Here the truncated rows are the pool index and the
device length: once a request leaves from anywhere but the tail, each later request attends
through the departed (or previous) request's pool row, at its length, and places its new key and
value after that row's last slot. The host mirrors the batch is checked against are right, so the
runner trusts the device rows. A batch that never changes (no request leaves or returns) never
shows it.

What the contract could not express: nothing. The running batch is per-row state the runner owns
(neither ``state()`` nor ``static_buffers()``), checked against each batch before it is trusted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill"}),
    null_block=0,
)
MAX_LEN = SPEC.max_blocks_per_req * SPEC.block_size
HIDDEN, HEADS, HEAD_DIM, MLP = 32, 2, 16, 64
NULL_SLOT = SPEC.null_block * SPEC.block_size


def _weights(seed: int, device: torch.device) -> dict[str, Tensor]:
    """float32 weights, a pure function of the seed (drawn on the CPU, then moved)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shapes = {
        "embed": (SPEC.vocab_size, HIDDEN),
        "pos": (MAX_LEN, HIDDEN),
        "qkv": (HIDDEN, 3 * HEADS * HEAD_DIM),
        "out": (HEADS * HEAD_DIM, HIDDEN),
        "up": (HIDDEN, MLP),
        "down": (MLP, HIDDEN),
        "head": (HIDDEN, SPEC.vocab_size),
    }
    weights = {}
    for name, shape in shapes.items():
        scale = 1.0 if name in ("embed", "pos") else 1.0 / math.sqrt(shape[0])
        w = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
        weights[name] = w.to(device)
    return weights


@dataclass
class _Req:
    """What the runner knows of a running request (host side)."""

    req_id: int
    pool_slot: int
    cached: int  # host mirror of the row's device seq_len
    block_ids: tuple[int, ...]


class RunningBatch:
    """The persistent batch: host requests plus per-row device tensors, filtered and merged."""

    def __init__(self, device: torch.device, truncate_on_filter: bool) -> None:
        self.device = device
        self.truncate_on_filter = truncate_on_filter
        self.reqs: list[_Req] = []
        self.req_pool_indices = torch.zeros(0, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(0, dtype=torch.int64, device=device)

    def filter_batch(self, keep_indices: list[int]) -> None:
        if len(keep_indices) == len(self.reqs):
            return  # every row kept, in order
        self.reqs = [self.reqs[i] for i in keep_indices]
        if self.truncate_on_filter:
            # Departed rows taken to be gone from the tail already: keep the leading rows.
            self.req_pool_indices = self.req_pool_indices[: len(keep_indices)]
            self.seq_lens = self.seq_lens[: len(keep_indices)]
        else:
            keep = torch.tensor(keep_indices, dtype=torch.int64, device=self.device)
            self.req_pool_indices = self.req_pool_indices[keep]
            self.seq_lens = self.seq_lens[keep]

    def merge_batch(self, reqs: list[_Req], pool: Tensor, lens: Tensor) -> None:
        self.reqs.extend(reqs)
        self.req_pool_indices = torch.cat([self.req_pool_indices, pool])
        self.seq_lens = torch.cat([self.seq_lens, lens])


@dataclass
class _StepInputs:
    """One step's flat per-token inputs, in the running batch's row order."""

    input_ids: Tensor
    positions: Tensor
    token_pool: Tensor
    out_loc: Tensor
    last_token: list[int]  # per row: index of its last query token
    q_lens: Tensor  # per row, on the device


class PersistentBatchRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, buggy: bool
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.be = get_backend(backend)
        self.be.activate()
        dev = self.be.device
        self.device = dev
        with torch.inference_mode():
            self.w = _weights(seed, dev)
            rows = SPEC.num_blocks * SPEC.block_size
            self.k_cache = torch.zeros(rows, HEADS, HEAD_DIM, device=dev)
            self.v_cache = torch.zeros(rows, HEADS, HEAD_DIM, device=dev)
            # Pool row 0 is the padding row: every entry the null block's first slot.
            self.req_to_token = torch.full(
                (SPEC.max_num_reqs + 1, MAX_LEN), NULL_SLOT, dtype=torch.int64, device=dev
            )
            self.free_slots = list(range(1, SPEC.max_num_reqs + 1))
            self.running = RunningBatch(dev, truncate_on_filter=buggy)
            self.graphs: dict[int, object] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.static: dict[str, Tensor] = {}
            if mode == "graph":
                self._capture()

    # ---- the model --------------------------------------------------------------------------

    def _forward(
        self, input_ids: Tensor, positions: Tensor, token_pool: Tensor, out_loc: Tensor
    ) -> tuple[Tensor, Tensor]:
        w = self.w
        x = w["embed"][input_ids] + w["pos"][positions]
        q, k, v = (x @ w["qkv"]).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        self.k_cache.index_copy_(0, out_loc, k)
        self.v_cache.index_copy_(0, out_loc, v)
        slots = self.req_to_token[token_pool]  # [T, MAX_LEN]
        keys = self.k_cache[slots]  # [T, MAX_LEN, H, D]
        vals = self.v_cache[slots]
        visible = torch.arange(MAX_LEN, device=self.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tlhd->thl", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(visible[:, None, :], scores, float("-inf"))
        vals = torch.where(visible[:, :, None, None], vals, 0.0)
        attn = torch.einsum("thl,tlhd->thd", scores.softmax(-1), vals).reshape(-1, HEADS * HEAD_DIM)
        h = x + attn @ w["out"]
        h = h + torch.nn.functional.silu(h @ w["up"]) @ w["down"]
        logits = h @ w["head"]
        return logits, logits.argmax(-1)

    # ---- graph mode -------------------------------------------------------------------------

    def _capture(self) -> None:
        n = max(SPEC.capture_sizes)
        dev = self.device
        self.static = {
            "input_ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "positions": torch.zeros(n, dtype=torch.int64, device=dev),
            "token_pool": torch.zeros(n, dtype=torch.int64, device=dev),
            "out_loc": torch.full((n,), NULL_SLOT, dtype=torch.int64, device=dev),
        }
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._pad_static(0, size)
            args = [self.static[k][:size] for k in ("input_ids", "positions", "token_pool")]
            args.append(self.static["out_loc"][:size])
            self._forward(*args)  # warm-up outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self._forward(*args)
            self.graphs[size] = graph

    def _pad_static(self, start: int, end: int) -> None:
        if end > start:
            self.static["input_ids"][start:end] = 0
            self.static["positions"][start:end] = 0
            self.static["token_pool"][start:end] = 0
            self.static["out_loc"][start:end] = NULL_SLOT

    def _graph_size(self, batch: Batch) -> int | None:
        if self.mode != "graph" or any(r.query_len != 1 for r in batch.requests):
            return None
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    # ---- scheduling: the persistent batch ---------------------------------------------------

    def _reconcile(self, batch: Batch) -> list[int]:
        """Filter and merge the running batch to hold the batch's requests; the row of each."""
        listed = {r.req_id: r for r in batch.requests}
        keep = []
        for row, st in enumerate(self.running.reqs):
            r = listed.get(st.req_id)
            if (
                r is not None
                and r.context_len == st.cached
                and r.block_ids[: len(st.block_ids)] == st.block_ids
            ):
                keep.append(row)
            else:
                self.free_slots.append(st.pool_slot)
        self.running.filter_batch(keep)
        kept = {st.req_id for st in self.running.reqs}
        new = [r for r in batch.requests if r.req_id not in kept]
        if new:
            reqs = []
            for r in new:
                slot = self.free_slots.pop(0)
                reqs.append(_Req(r.req_id, slot, r.context_len, r.block_ids))
            # Prefix entries (a request that sat out steps comes back with its KV in place).
            rows, cols, vals = [], [], []
            for st in reqs:
                for pos in range(st.cached):
                    rows.append(st.pool_slot)
                    cols.append(pos)
                    vals.append(kv_slot(st.block_ids, pos, SPEC.block_size))
            if rows:
                idx = (self._upload(rows), self._upload(cols))
                self.req_to_token.index_put_(idx, self._upload(vals))
            self.running.merge_batch(
                reqs,
                self._upload([st.pool_slot for st in reqs]),
                self._upload([st.cached for st in reqs]),
            )
        row_of = {st.req_id: row for row, st in enumerate(self.running.reqs)}
        return [row_of[r.req_id] for r in batch.requests]

    def _upload(self, values: Sequence[int] | Sequence[bool]) -> Tensor:
        dtype = torch.bool if values and isinstance(values[0], bool) else torch.int64
        return torch.tensor(list(values), dtype=dtype, device=self.device)

    def _prepare(self, batch: Batch) -> _StepInputs:
        """Per-token inputs from the batch and the running rows; KV slots into the pool rows."""
        listed = {r.req_id: r for r in batch.requests}
        tokens, tok_row, tok_off, host_loc, on_device, last, q_lens = [], [], [], [], [], [], []
        for row, st in enumerate(self.running.reqs):
            r = listed[st.req_id]
            decode = r.query_len == 1 and r.context_len > 0
            for j, tok in enumerate(r.tokens):
                pos = r.context_len + j
                tokens.append(tok)
                tok_row.append(row)
                tok_off.append(j)
                if decode:  # first slot of the block holding this position: a new page
                    host_loc.append(r.block_ids[pos // SPEC.block_size] * SPEC.block_size)
                else:
                    host_loc.append(kv_slot(r.block_ids, pos, SPEC.block_size))
                on_device.append(decode)
            last.append(len(tokens) - 1)
            q_lens.append(r.query_len)
        rows = self._upload(tok_row)
        positions = self.running.seq_lens[rows] + self._upload(tok_off)
        token_pool = self.running.req_pool_indices[rows]
        # A decode row continues its block after the last slot of its pool row.
        last_loc = self.req_to_token[token_pool, (positions - 1).clamp(min=0)]
        in_block = self._upload(on_device) & (positions % SPEC.block_size != 0)
        out_loc = torch.where(in_block, last_loc + 1, self._upload(host_loc))
        self.req_to_token.index_put_((token_pool, positions), out_loc)
        return _StepInputs(
            self._upload(tokens), positions, token_pool, out_loc, last, self._upload(q_lens)
        )

    # ---- the contract -----------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            return self._step(batch)

    def _step(self, batch: Batch) -> StepResult:
        vocab = SPEC.vocab_size
        if not batch.requests:
            empty = torch.zeros(0, vocab, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        order = self._reconcile(batch)
        inputs = self._prepare(batch)
        size = self._graph_size(batch)
        n = len(self.running.reqs)
        if size is not None:
            for name in ("input_ids", "positions", "token_pool", "out_loc"):
                self.static[name][:n].copy_(getattr(inputs, name))
            self._pad_static(n, size)
            self.graphs[size].replay()
            logits, tokens = (t[:n] for t in self.outputs[size])
            path, key, reason = "full", ("decode", size), None
        else:
            logits, tokens = self._forward(
                inputs.input_ids, inputs.positions, inputs.token_pool, inputs.out_loc
            )
            pick = self._upload(inputs.last_token)
            logits, tokens = logits[pick], tokens[pick]
            path, key = "eager", None
            reason = "eager twin" if self.mode == "eager" else "not a decode step within a graph"
        self.running.seq_lens.add_(inputs.q_lens)
        listed = {r.req_id: r for r in batch.requests}
        for st in self.running.reqs:
            st.cached, st.block_ids = listed[st.req_id].seq_len, listed[st.req_id].block_ids
        back = self._upload(order)
        return StepResult(logits[back].clone(), tokens[back].clone(), path, key, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return dict(self.static)

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        raise NotImplementedError("weight_update is not a feature of this runner")

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.be.deactivate()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PersistentBatchRunner:
    return PersistentBatchRunner(mode, seed=seed, backend=backend, buggy=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PersistentBatchRunner:
    return PersistentBatchRunner(mode, seed=seed, backend=backend, buggy=True)
