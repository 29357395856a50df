"""A decode + speculative-verify graph runner whose attention backend routes its multi-token path
on a persistent flag that the last prefill left behind, with one real bug from SGLang.

What it models (own code, written against the contract and the backend facade): SGLang's
`trtllm_mla` attention backend, which subclasses the FlashInfer-MLA backend. Its fast kernel
(trtllm-gen style, here `paged_attention`) reads a dense page table and a sequence length per row
and takes one query length for the whole call, so it serves decode (one token a row) and
target-verify steps (every row 1 + k tokens). Prefill and mixed batches, whose query lengths
differ per request, go to the parent's ragged FlashInfer wrapper (here `RaggedWrapper`): `plan()`
writes qo/kv index pointers and a flat list of KV slots into the wrapper's persistent buffers, and
`run()` reads them. The backend records that choice in `self.prefill_metadata.fallback_to_ragged`
when it prepares an extend step, and its `forward_extend` starts with a short-circuit on that
instance state: if the flag is set, run the ragged wrapper. The eager metadata init for decode and
verify steps clears the stale prefill metadata, so eager steps always route right.

Graph mode: decode graphs per padded row count (1, 2, 4) captured at start-up; verify graphs per
(padded rows, query length), captured lazily the first time a uniform verify batch needs one.
Everything else (prefill, mixed, uneven drafts, oversize) runs eagerly. Static inputs are shared
max-shape buffers (token ids, positions, write slots, page table, sequence lengths) that the
replay prep rewrites whole, padding rows pointing at the null block with length 0.

The bug (`stale_fallback_on_capture=True`): the capture-time metadata init
(`init_forward_metadata_capture_cuda_graph` in SGLang) writes the paged kernel's buffers but does
not clear the prefill metadata, as the eager init does. A verify graph captured while the flag is
still set by the last eager extend step (decode replays never touch it) records the ragged
wrapper's kernel instead of the paged one. Replay prep then refreshes only the paged kernel's
buffers; the recorded ragged kernel reads whatever plan the wrapper holds: the last eager prefill's
query and KV layout, at capture and at every later replay. So it shows only for verify graphs, only
when the last eager step before their capture was a prefill or mixed one (graph replays in between
leave the flag alone), and then on every replay of that graph. Reported and fixed in sgl-project/sglang:
https://github.com/sgl-project/sglang/pull/31198 (diagnosis: a piecewise prefill capture left
`fallback_to_flashinfer_impl=True`, the decode runner's TARGET_VERIFY capture then recorded the
FlashInfer wrapper, illegal memory access at the first generation batch) and
https://github.com/sgl-project/sglang/pull/32288 (merged fix: target-verify and draft-extend
forwards must never consume that stale flag). An eager-path reset of the backend's fallback flag
for decode, verify and draft-extend steps is in https://github.com/sgl-project/sglang/pull/12361.

Where this runner differs: SGLang captures all graphs at start-up, the piecewise prefill graphs
first, so every verify graph was born corrupted; here verify graphs are captured lazily, so
whether one is corrupted depends on the step order before its capture. In SGLang the recorded
FlashInfer kernel read metadata laid out for the other kernel and faulted (an illegal memory
access); here the wrapper's buffers are persistent and always hold valid slots, so the recorded
kernel reads a foreign but valid plan and computes wrong attention silently.

The fix (`stale_fallback_on_capture=False`): the capture path clears the stale prefill metadata
too, so a verify capture always records the paged kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=4,
    max_num_tokens=20,
    capture_sizes=(
        1,
        2,
        4,
    ),  # decode graphs, keyed by padded rows; verify graphs add a query length
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size  # keys a row can attend to
MAX_ROWS, MAX_TOKENS = SPEC.max_num_reqs, SPEC.max_num_tokens
MAX_KV = MAX_ROWS * MAX_CONTEXT  # the ragged wrapper's flat KV list
NULL_SLOT = SPEC.null_block * SPEC.block_size
MASKED = -1.0e30  # finite, so a fully masked row softmaxes to zeros times zero values


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: captured graphs hold these addresses
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attend(q: Tensor, slots: Tensor, valid: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
    """q [T, H, D]; slots, valid [T, L]. Masked keys may hold NaN (the null block): `where`."""
    keys, vals = k_cache[slots], v_cache[slots]  # [T, L, H, D]
    scores = torch.einsum("thd,tlhd->thl", q, keys) / math.sqrt(HEAD_DIM)
    scores = torch.where(valid[:, None, :], scores, torch.full((), MASKED, device=q.device))
    vals = torch.where(valid[:, :, None, None], vals, torch.zeros((), device=q.device))
    return torch.einsum("thl,tlhd->thd", scores.softmax(-1), vals).flatten(1)


@dataclass
class PrefillMetadata:
    fallback_to_ragged: bool


class RaggedWrapper:
    """FlashInfer-style ragged prefill: `plan()` fills persistent buffers, `run()` reads them."""

    def __init__(self, device: Any) -> None:
        self.qo_indptr = torch.zeros(MAX_ROWS + 1, dtype=torch.int64, device=device)
        self.kv_indptr = torch.zeros(MAX_ROWS + 1, dtype=torch.int64, device=device)
        self.kv_indices = torch.full((MAX_KV,), NULL_SLOT, dtype=torch.int64, device=device)
        self.device = device

    def plan(self, batch: Batch) -> None:
        qo, kv, slots = [0], [0], []
        for r in batch.requests:
            qo.append(qo[-1] + r.query_len)
            kv.append(kv[-1] + r.seq_len)
            slots += [kv_slot(r.block_ids, p, SPEC.block_size) for p in range(r.seq_len)]
        qo += [qo[-1]] * (MAX_ROWS + 1 - len(qo))  # empty requests after the last
        kv += [kv[-1]] * (MAX_ROWS + 1 - len(kv))
        slots += [NULL_SLOT] * (MAX_KV - len(slots))
        self.qo_indptr.copy_(torch.tensor(qo, dtype=torch.int64))
        self.kv_indptr.copy_(torch.tensor(kv, dtype=torch.int64))
        self.kv_indices.copy_(torch.tensor(slots, dtype=torch.int64))

    def run(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        t = torch.arange(q.shape[0], device=q.device)
        req = (t[:, None] >= self.qo_indptr[None, 1:]).sum(-1).clamp(max=MAX_ROWS - 1)
        q_start, kv_start = self.qo_indptr[req], self.kv_indptr[req]
        q_len = self.qo_indptr[req + 1] - q_start
        kv_len = self.kv_indptr[req + 1] - kv_start
        pos = kv_len - q_len + (t - q_start)  # the token's index in its request's KV list
        j = torch.arange(MAX_CONTEXT, device=q.device)
        slots = self.kv_indices[(kv_start[:, None] + j[None, :]).clamp(max=MAX_KV - 1)]
        valid = (j[None, :] <= pos[:, None]) & (j[None, :] < kv_len[:, None])
        return _attend(q, slots, valid, k_cache, v_cache)


def paged_attention(q, tok_row, positions, page_table, seq_lens, k_cache, v_cache) -> Tensor:
    """trtllm-gen-style: a page table and a length per row; token t belongs to row tok_row[t]."""
    offsets = torch.arange(SPEC.block_size, device=q.device)
    row_slots = (page_table[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [R, L]
    j = torch.arange(MAX_CONTEXT, device=q.device)
    valid = (j[None, :] <= positions[:, None]) & (j[None, :] < seq_lens[tok_row][:, None])
    return _attend(q, row_slots[tok_row], valid, k_cache, v_cache)


@dataclass
class PagedInputs:  # what the paged kernel reads: static-buffer views in a graph, fresh eagerly
    tok_row: Tensor
    positions: Tensor
    page_table: Tensor
    seq_lens: Tensor


@dataclass
class CapturedGraph:
    graph: Any
    logits: Tensor
    keep: tuple[Tensor, ...]  # tensors the graph reads that nothing else holds


def _mode(batch: Batch) -> str:
    """SGLang's forward modes, decided identically on every twin."""
    lens = batch.query_lens
    if all(n == 1 for n in lens):
        return "decode"
    if batch.uniform and all(r.context_len > 0 for r in batch.requests):
        return "target_verify"
    return "extend"


class VerifyGraphRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, stale_fallback_on_capture=False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.stale_fallback_on_capture = SPEC, mode, stale_fallback_on_capture
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.ragged = RaggedWrapper(dev)
        self.prefill_metadata: PrefillMetadata | None = None  # the attention backend's state
        self.graphs: dict[tuple, CapturedGraph] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.buffers = {
                "input_ids": torch.zeros(MAX_TOKENS, dtype=torch.int64, device=dev),
                "positions": torch.zeros(MAX_TOKENS, dtype=torch.int64, device=dev),
                "out_cache_loc": torch.zeros(MAX_TOKENS, dtype=torch.int64, device=dev),
                "page_table": torch.zeros(
                    MAX_ROWS, SPEC.max_blocks_per_req, dtype=torch.int64, device=dev
                ),
                "seq_lens": torch.zeros(MAX_ROWS, dtype=torch.int64, device=dev),
            }
            for rows in SPEC.capture_sizes:  # decode graphs at start-up, as SGLang does
                self.capture(Batch(()), rows, 1)

    # -- the model --------------------------------------------------------------------------------

    def forward(self, ids, positions, write_slots, last, attend: Callable[[Tensor], Tensor]):
        w = self.w.t
        x = w["embed"][ids] + w["pos"][positions]
        h = _norm(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, write_slots, (h @ w["wk"]).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, write_slots, (h @ w["wv"]).view(-1, HEADS, HEAD_DIM))
        x = x + attend(q) @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        return _norm(x[last]) @ w["head"]

    def forward_decode(self, q: Tensor, paged: PagedInputs) -> Tensor:
        return paged_attention(q, *self._paged_args(paged), self.k_cache, self.v_cache)

    def forward_extend(self, q: Tensor, paged: PagedInputs | None) -> Tensor:
        # SGLang's short-circuit on persistent instance state: the last extend step's choice.
        if self.prefill_metadata is not None and self.prefill_metadata.fallback_to_ragged:
            return self.ragged.run(q, self.k_cache, self.v_cache)
        assert paged is not None, "a ragged batch reached the paged kernel"
        return paged_attention(q, *self._paged_args(paged), self.k_cache, self.v_cache)

    @staticmethod
    def _paged_args(p: PagedInputs) -> tuple[Tensor, ...]:
        return p.tok_row, p.positions, p.page_table, p.seq_lens

    # -- metadata (the attention backend's three entry points) ------------------------------------

    def init_forward_metadata(self, batch: Batch, mode: str) -> None:
        """Eager steps: an extend step plans the ragged wrapper, the others clear its metadata."""
        if mode == "extend":
            self.ragged.plan(batch)
            self.prefill_metadata = PrefillMetadata(fallback_to_ragged=True)
        else:
            self.prefill_metadata = None

    def init_forward_metadata_capture(self) -> None:
        if not self.stale_fallback_on_capture:
            self.prefill_metadata = None  # the fix: a verify capture never takes the fallback

    def prepare_replay(self, batch: Batch, rows: int, qlen: int) -> None:
        """Rewrite every row the (rows, qlen) graph reads; padding rows point at the null block."""
        ids, pos, loc = [0] * (rows * qlen), [0] * (rows * qlen), [NULL_SLOT] * (rows * qlen)
        table = [[SPEC.null_block] * SPEC.max_blocks_per_req for _ in range(rows)]
        lens = [0] * rows
        for i, r in enumerate(batch.requests):
            for k, tok in enumerate(r.tokens):
                ids[i * qlen + k] = tok
                pos[i * qlen + k] = r.context_len + k
                loc[i * qlen + k] = kv_slot(r.block_ids, r.context_len + k, SPEC.block_size)
            table[i][: len(r.block_ids)] = r.block_ids
            lens[i] = r.seq_len
        b = self.buffers
        b["input_ids"][: rows * qlen].copy_(torch.tensor(ids, dtype=torch.int64))
        b["positions"][: rows * qlen].copy_(torch.tensor(pos, dtype=torch.int64))
        b["out_cache_loc"][: rows * qlen].copy_(torch.tensor(loc, dtype=torch.int64))
        b["page_table"][:rows].copy_(torch.tensor(table, dtype=torch.int64))
        b["seq_lens"][:rows].copy_(torch.tensor(lens, dtype=torch.int64))

    # -- graphs -----------------------------------------------------------------------------------

    def capture(self, batch: Batch, rows: int, qlen: int) -> None:
        self.init_forward_metadata_capture()
        self.prepare_replay(batch, rows, qlen)
        dev, b, n = self.device, self.buffers, rows * qlen
        tok_row = torch.arange(n, device=dev) // qlen  # fixed per graph: rows are qlen apart
        last = torch.arange(rows, device=dev) * qlen + (qlen - 1)
        paged = PagedInputs(
            tok_row, b["positions"][:n], b["page_table"][:rows], b["seq_lens"][:rows]
        )
        run = self.forward_decode if qlen == 1 else self.forward_extend

        def model() -> Tensor:
            ids, pos, loc = b["input_ids"][:n], b["positions"][:n], b["out_cache_loc"][:n]
            return self.forward(ids, pos, loc, last, lambda q: run(q, paged))

        model()  # warm-up outside the graph: writes this batch's own slots (or the null block)
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph):
            logits = model()
        self.graphs[(rows, qlen)] = CapturedGraph(graph, logits, (tok_row, last))

    def graph_key(self, batch: Batch, mode: str) -> tuple[int, int] | None:
        if mode == "extend":
            return None
        rows = next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)
        qlen = batch.query_lens[0]
        if rows is None or rows * qlen > MAX_TOKENS:
            return None
        return rows, qlen

    # -- steps ------------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        mode = _mode(batch)
        key = self.graph_key(batch, mode) if self.mode == "graph" else None
        if key is None:
            reason = "eager twin" if self.mode == "eager" else f"{mode} step runs eagerly"
            return self.run_eager(batch, mode, reason)
        rows, qlen = key
        if key not in self.graphs:
            self.capture(batch, rows, qlen)  # lazily, on the first batch that needs it
        self.prepare_replay(batch, rows, qlen)
        captured = self.graphs[key]
        captured.graph.replay()
        logits = captured.logits[: batch.num_reqs].clone()
        name = "decode" if qlen == 1 else "verify"
        return StepResult(logits, logits.argmax(-1), "full", (name, rows, qlen))

    def run_eager(self, batch: Batch, mode: str, reason: str) -> StepResult:
        self.init_forward_metadata(batch, mode)
        reqs, dev = batch.requests, self.device
        ids = [t for r in reqs for t in r.tokens]
        pos = [r.context_len + k for r in reqs for k in range(r.query_len)]
        loc = [
            kv_slot(r.block_ids, p, SPEC.block_size)
            for r in reqs
            for p in range(r.context_len, r.seq_len)
        ]
        tok_row = [i for i, r in enumerate(reqs) for _ in range(r.query_len)]
        last = [sum(batch.query_lens[: i + 1]) - 1 for i in range(batch.num_reqs)]
        table = [
            list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for r in reqs
        ]

        def t(values: Sequence[Any]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=dev)

        positions = t(pos)
        paged = None
        if mode != "extend":
            paged = PagedInputs(t(tok_row), positions, t(table), t([r.seq_len for r in reqs]))
        run = self.forward_decode if mode == "decode" else self.forward_extend
        logits = self.forward(t(ids), positions, t(loc), t(last), lambda q: run(q, paged))
        return StepResult(logits, logits.argmax(-1), "eager", None, reason)

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for captured in self.graphs.values():
            captured.graph.reset()
        self.graphs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> VerifyGraphRunner:
    return VerifyGraphRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> VerifyGraphRunner:
    return VerifyGraphRunner(mode, seed=seed, backend=backend, stale_fallback_on_capture=True)
