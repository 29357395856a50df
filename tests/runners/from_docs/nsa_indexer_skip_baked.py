"""A DeepSeek-V3.2-style sparse-attention (NSA/DSA) runner whose indexer has a short-context shortcut.

The engine mechanism (SGLang's NSA backend for DeepSeek-V3.2, `nsa_indexer.py`): before the main
attention, a lightning indexer scores every cached position of a token's request,
`score[p] = sum_h w_h * relu(q_h . k_idx[p])` (its own small queries, per-head weights and a
separate indexer key cache), and the attention then reads only the `INDEX_TOPK` best-scoring
positions (a top-k index tensor per query token, invalid entries masked). When no sequence of the
batch is longer than `INDEX_TOPK`, the top-k is every causal position whatever the scores, so the
engine skips the scoring: it only stores the indexer keys and hands out the trivial indices
`0, 1, ..., INDEX_TOPK - 1` (masked by causality). That shortcut is chosen on the host, from the
batch's longest sequence (`seq_lens_cpu.max() <= index_topk`).

Graph mode here: one-token decode batches and speculative-verify batches (every request continues
its sequence with the same 1 + k query tokens) replay full graphs keyed by (padded rows, query
length), captured at start-up into one pool from dummy batches that are all padding, whose
sequence lengths are only their own query tokens (SGLang captures with a small fill value for
`seq_lens`). A request carries no flag that says it is speculative, so a uniform step of prompt
chunks that continue their sequences replays a verify graph too, as it would in any runner that
routes on query lengths. Prefill and mixed batches ("extend" batches), and anything no graph fits,
run eagerly. Sampling runs after the forward from a hash of (seed, position, token id).

The bug (`shortcut_in_graphs=True`): sgl-project/sglang PR #12788 let the MLA path take the
shortcut for every extend-like forward mode, target-verify included; target verify runs in CUDA
graphs, and at capture the dummy sequences are short, so the shortcut was baked into the verify
graphs: every replay selected positions `0 .. INDEX_TOPK - 1` instead of the scored top-k, however
long the requests' contexts were (DeepSeek-V3.2 with MTP on B200: gsm8k 0.008). Fixed by PR #12816
(https://github.com/sgl-project/sglang/pull/12816, "Only skip Indexer logits computation when
is_extend_without_speculative"), which allows the shortcut only for extend batches without
speculation, i.e. ones that never run in a graph. vLLM met the same mechanism in DeepSeek-V4's
indexer once it moved into captured graphs, and fixed it by never taking the shortcut while the
stream is capturing (https://github.com/vllm-project/vllm/pull/52492, "Keep indexer scoring in
breakable graphs"). The wrong output needs a verify graph replayed for a request whose sequence is
longer than `INDEX_TOPK`; decode graphs never took the shortcut. No engine code was copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),  # padded request counts; each graph also has a query length
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
INDEX_HEADS, INDEX_DIM = 4, 16
INDEX_TOPK = 8  # positions the sparse attention reads per query token
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size  # the indexer's candidates per request
MAX_QUERY = 5  # one next token plus up to four drafts
BS = SPEC.block_size
NULL_SLOT = SPEC.null_block * BS
_M32 = 0xFFFFFFFF


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_POS, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            "idx_wq": (HIDDEN, INDEX_HEADS * INDEX_DIM),
            "idx_wk": (HIDDEN, INDEX_DIM),
            "idx_w": (HIDDEN, INDEX_HEADS),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: the captured graphs read these tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _sample(logits: Tensor, reqs: Sequence[Request]) -> Tensor:
    """Gumbel-max with noise from (seed, position of the last query token, token id)."""
    dev = logits.device
    seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], device=dev)
    pos = torch.tensor([r.seq_len - 1 for r in reqs], device=dev)
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    sampled = torch.tensor([r.seed is not None for r in reqs], device=dev)
    key = _mix(_mix(seeds) ^ ((pos * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=dev)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _kind(batch: Batch) -> str:
    """SGLang's forward mode, as far as the indexer cares."""
    continuing = all(r.context_len > 0 for r in batch.requests)
    if continuing and batch.uniform:
        return "decode" if batch.query_lens[0] == 1 else "target_verify"
    return "extend"  # a prompt (chunk) in the batch: prefill or mixed, never graphed


class SparseAttentionRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, shortcut_in_graphs: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.shortcut_in_graphs = SPEC, mode, shortcut_in_graphs
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.index_k_cache = torch.zeros(SPEC.num_slots, INDEX_DIM, device=dev)
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[tuple[int, int], Any] = {}
        self.graph_io: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (last rows, logits)
        if mode == "graph":
            t = SPEC.max_num_tokens
            self.buffers = {
                "tokens": torch.zeros(t, dtype=torch.int64, device=dev),
                "positions": torch.zeros(t, dtype=torch.int64, device=dev),
                "slots": torch.zeros(t, dtype=torch.int64, device=dev),
                "tables": torch.zeros(t, SPEC.max_blocks_per_req, dtype=torch.int64, device=dev),
            }
            self.capture_all()

    # -- the indexer's shortcut ------------------------------------------------------------------

    def skips_scoring(self, kind: str, seq_lens: Sequence[int]) -> bool:
        """Host-side choice of the k-only path: every causal position fits in the top-k."""
        allowed = ("extend", "target_verify") if self.shortcut_in_graphs else ("extend",)
        return kind in allowed and max(seq_lens) <= INDEX_TOPK

    # -- model ------------------------------------------------------------------------------------

    def forward(self, tokens, positions, slots, tables, last, skip_scoring: bool) -> Tensor:
        w = self.w.t
        x = w["embed"][tokens] + w["pos"][positions]
        h = _norm(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        k = (h @ w["wk"]).view(-1, HEADS, HEAD_DIM)
        v = (h @ w["wv"]).view(-1, HEADS, HEAD_DIM)
        # store before reading: a query token attends to itself through the cache
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        self.index_k_cache.index_copy_(0, slots, h @ w["idx_wk"])
        cand = torch.arange(MAX_POS, device=tokens.device)  # logical positions of the request
        cand_slots = tables[:, cand // BS] * BS + cand % BS  # [T, MAX_POS]
        causal = cand[None, :] <= positions[:, None]
        if skip_scoring:  # k-only path: the trivial indices, no scores
            chosen = cand[:INDEX_TOPK].expand(tokens.shape[0], -1)
        else:
            iq = (h @ w["idx_wq"]).view(-1, INDEX_HEADS, INDEX_DIM)
            ik = self.index_k_cache[cand_slots]  # non-causal columns may hold NaN: masked below
            per_head = torch.relu(torch.einsum("thd,tpd->thp", iq, ik))
            score = (per_head * (h @ w["idx_w"])[:, :, None]).sum(1)
            score = torch.where(causal, score, torch.full((), -math.inf, device=score.device))
            chosen = score.topk(INDEX_TOPK, dim=-1).indices
        chosen_ok = causal.gather(1, chosen)  # top-k of fewer candidates picks masked ones too
        sel = cand_slots.gather(1, chosen)
        keys, vals = self.k_cache[sel], self.v_cache[sel]  # [T, K, H, D]
        att = torch.einsum("thd,tkhd->thk", q, keys) / math.sqrt(HEAD_DIM)
        att = torch.where(chosen_ok[:, None, :], att, torch.full((), -math.inf, device=q.device))
        vals = torch.where(chosen_ok[:, :, None, None], vals, torch.zeros((), device=q.device))
        x = x + torch.einsum("thk,tkhd->thd", att.softmax(-1), vals).flatten(1) @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        return _norm(x[last]) @ w["head"]

    # -- graphs -----------------------------------------------------------------------------------

    def graph_keys(self) -> list[tuple[int, int]]:
        return [
            (rows, q)
            for rows in SPEC.capture_sizes
            for q in range(1, MAX_QUERY + 1)
            if rows * q <= SPEC.max_num_tokens
        ]

    def prepare(self, reqs: Sequence[Request], rows: int, q: int) -> None:
        """Write the batch into the buffers' prefix; every padding token goes to the null block."""
        tok, pos, slot, table = [], [], [], []
        for r in reqs:
            row = list(r.block_ids) + [SPEC.null_block] * (
                SPEC.max_blocks_per_req - len(r.block_ids)
            )
            for i, t in enumerate(r.tokens):
                tok.append(t)
                pos.append(r.context_len + i)
                slot.append(kv_slot(r.block_ids, r.context_len + i, BS))
                table.append(row)
        pad = SPEC.max_num_tokens - len(tok)
        buf = self.buffers
        buf["tokens"].copy_(torch.tensor(tok + [0] * pad, device=self.device))
        buf["positions"].copy_(torch.tensor(pos + [0] * pad, device=self.device))
        buf["slots"].copy_(torch.tensor(slot + [NULL_SLOT] * pad, device=self.device))
        null_row = [SPEC.null_block] * SPEC.max_blocks_per_req
        buf["tables"].copy_(torch.tensor(table + [null_row] * pad, device=self.device))

    def capture_all(self) -> None:
        pool = self.be.graph_pool_handle()
        for rows, q in sorted(self.graph_keys(), key=lambda k: k[0] * k[1], reverse=True):
            n = rows * q
            buf = {name: b[:n] for name, b in self.buffers.items()}
            last = torch.arange(q - 1, n, q, device=self.device)  # each row's last query token
            # the capture batch is all padding: its dummy sequences hold only their q tokens
            skip = self.skips_scoring("decode" if q == 1 else "target_verify", [q] * rows)
            args = (buf["tokens"], buf["positions"], buf["slots"], buf["tables"], last, skip)
            self.prepare([], rows, q)
            self.forward(*args)  # warm-up outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                logits = self.forward(*args)
            self.graphs[(rows, q)], self.graph_io[(rows, q)] = graph, (last, logits)

    def graph_for(self, batch: Batch) -> tuple[int, int] | None:
        if self.mode != "graph" or _kind(batch) == "extend":
            return None
        q = batch.query_lens[0]
        rows = next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)
        return (rows, q) if rows is not None and (rows, q) in self.graphs else None

    # -- steps ------------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        key = self.graph_for(batch)
        if key is None:
            return self.run_eager(batch)
        self.prepare(batch.requests, *key)
        self.graphs[key].replay()
        logits = self.graph_io[key][1][: batch.num_reqs].clone()
        kind = "decode" if key[1] == 1 else "target_verify"
        return StepResult(logits, _sample(logits, batch.requests), "full", (kind, *key))

    def run_eager(self, batch: Batch) -> StepResult:
        reqs, dev = batch.requests, self.device
        kind = _kind(batch)
        tok = [t for r in reqs for t in r.tokens]
        pos = [r.context_len + i for r in reqs for i in range(r.query_len)]
        slots = [kv_slot(r.block_ids, p, BS) for r in reqs for p in range(r.context_len, r.seq_len)]
        tables = [
            list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for r in reqs
            for _ in r.tokens
        ]
        last, n = [], 0
        for r in reqs:
            n += r.query_len
            last.append(n - 1)
        logits = self.forward(
            torch.tensor(tok, device=dev),
            torch.tensor(pos, device=dev),
            torch.tensor(slots, device=dev),
            torch.tensor(tables, device=dev),
            torch.tensor(last, device=dev),
            self.skips_scoring(kind, [r.seq_len for r in reqs]),
        )
        reason = "eager twin" if self.mode == "eager" else f"no graph for this {kind} batch"
        return StepResult(logits, _sample(logits, reqs), "eager", None, reason)

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache, "index_k": self.index_k_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_io.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return SparseAttentionRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return SparseAttentionRunner(mode, seed=seed, backend=backend, shortcut_in_graphs=True)
