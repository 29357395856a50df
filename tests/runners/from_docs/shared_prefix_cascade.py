"""A graph-mode decode runner with a shared system-prompt prefix and cascade attention.

Design (vLLM v1's FlashAttention backend under ``cudagraph_mode=FULL_AND_PIECEWISE``):

- **Prefix caching of a shared prefix.** Every request is served behind one system prompt
  (``SYS_TOKENS``, two blocks). Its keys and values sit in pinned prefix blocks of the KV cache,
  after the blocks the scheduler hands out, and every request's block table starts with them: a
  request's own position ``p`` is position ``SYS_LEN + p`` of the model. The prefix blocks are
  filled when the runner is made and refilled by a weight update (the prefix cache is reset and
  recomputed, as an RL trainer's weight sync does).
- **Cascade attention** (vLLM PR #11635, after FlashInfer's cascade inference): when a batch has
  enough requests sharing the prefix, the host decides ``common_prefix_len`` and attention runs in
  two levels: every query against the common prefix's keys once, non-causally, for the whole group
  (``block_table[:1, :num_common_blocks]``), then each request against its own suffix, causally
  (``block_table[:, num_common_blocks:]``); the two partial results are merged by their
  log-sum-exp. Otherwise each request attends its whole table in one pass.
- **Split-KV attention with a plan made ahead of time** (FlashAttention-3's AOT scheduler metadata,
  vLLM PR #20301): the metadata builder plans, per row, how many splits its keys are cut into (a
  device tensor the kernel reads), bounded by ``num_splits``; the kernel writes each split's partial
  output and log-sum-exp into a workspace of ``num_splits`` slots and combines them. ``num_splits``
  0 means "the kernel's own heuristic" (from the row count and the longest row, on the host). With
  full CUDA graphs the builder forces the bound to ``GRAPH_SPLITS`` for every batch a graph could
  take, so that the workspace captured in a graph is large enough for any plan.
- **Dispatch**: uniform one-token decode batches without cascade replay a FULL graph (the whole
  step, captured per padded row count); cascade batches, prefills, mixed and speculative batches
  replay PIECEWISE graphs (embedding and projections before attention, output projection, MLP, LM
  head and sampling after it, captured per padded token count) with attention run eagerly between
  them, since cascade attention takes host values (``common_prefix_len``) a graph would freeze
  (vLLM PR #23046); batches past the largest graph run eagerly. The eager twin runs every step
  eagerly with ``num_splits`` 0 everywhere.

The bug (``make_buggy_target``): vLLM PR #28702, "[BugFix] Fix FA3 IMA with FULL_AND_PIECEWISE and
cascade attention (default)", https://github.com/vllm-project/vllm/pull/28702. With full CUDA
graphs on, the metadata builder plans the split-KV schedule with the bound forced for graphs
(``max_num_splits``), also for a cascade batch's suffix, but ``cascade_attention`` was never given
that bound and launched its suffix kernel with ``num_splits`` 0: the kernel sized its partial-output
workspace by its own heuristic while following a plan made for up to ``GRAPH_SPLITS`` splits, and
wrote partials past the workspace (an illegal memory access on an H100). The fix passes
``max_num_splits`` into ``cascade_attention``. Here the buggy runner drops it the same way: a
cascade batch on the piecewise path whose suffix plan has more splits than the heuristic's
workspace scatters a partial out of bounds (a device-side assert on cuda, a ``RuntimeError`` on
the CPU under sim). The eager twin plans and launches with the heuristic alike, so it never meets
the mismatch: only the graph-mode configuration does.

What the contract could not express: requests never share blocks (``batch_problems``: a block
belongs to one request), so the shared prefix cannot be blocks the harness allocates and tracks;
it lives in runner-owned blocks outside ``state()``, the same for every request (one system
prompt), and the harness neither marks, poisons nor compares them. Prefix sharing decided by the
scheduler between arbitrary requests (vLLM's ``num_common_prefix_blocks``) is out of reach.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode import AddressView, Batch, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

BLOCK = 4
SPEC = TargetSpec(
    num_blocks=40,
    block_size=BLOCK,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=6,
    max_num_tokens=12,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
SYS_TOKENS = (3, 17, 41, 8, 29, 52, 11, 60)  # the deployment's system prompt
SYS_BLOCKS = len(SYS_TOKENS) // BLOCK
SYS_LEN = SYS_BLOCKS * BLOCK
HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 64
MAX_POS = SYS_LEN + SPEC.max_blocks_per_req * BLOCK
TABLE_W = SYS_BLOCKS + SPEC.max_blocks_per_req
T_MAX = max(SPEC.max_num_tokens, SPEC.capture_sizes[-1])
FULL_SIZES = tuple(s for s in SPEC.capture_sizes if s <= SPEC.max_num_reqs)
PIECE_SIZES = SPEC.capture_sizes

NUM_SMS = 8  # the device the split heuristic sizes its grid for
SPLIT_TILE = 2 * BLOCK  # keys one split covers at least
GRAPH_SPLITS = 4  # vLLM's _DEFAULT_MAX_NUM_SPLITS_FOR_CUDA_GRAPH
CASCADE_MIN_REQS = 4  # fewer requests: one pass over the whole table is cheaper

# Rows of the packed integer metadata: token fields by token, row fields by row.
TOK, POS, SLOT, REQ, LAST, KVLEN, CHUNK, SEED, SAMPLED = range(9)
NUM_FIELDS = 9


def heuristic_splits(num_rows: int, max_kv_len: int) -> int:
    """The kernel's own choice for ``num_splits=0``: split only while the grid underfills."""
    ctas = num_rows * HEADS
    if ctas >= 0.8 * NUM_SMS:
        return 1
    return max(1, min(NUM_SMS // ctas, -(-max_kv_len // SPLIT_TILE)))


def plan_chunks(kv_lens: Sequence[int], num_splits: int) -> list[int]:
    """The scheduler metadata: keys per split for each row, at most ``num_splits`` splits a row
    (0: the heuristic's count for these rows)."""
    bound = num_splits or heuristic_splits(len(kv_lens), max(kv_lens))
    chunks = []
    for kv in kv_lens:
        splits = min(bound, max(1, -(-kv // SPLIT_TILE)))
        chunks.append(max(1, -(-kv // splits)))
    return chunks


def merge_states(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge partial attention results [T, H, S, D] by their log-sum-exp [T, H, S]."""
    total = torch.logsumexp(lse, dim=-1)
    shift = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    weight = torch.exp(lse - shift[..., None])
    return (weight[..., None] * out).sum(dim=-2), total


def dense_attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Every query against every key (the common prefix): out [T, H, D], lse [T, H]."""
    scores = torch.einsum("thd,lhd->thl", q, k) / math.sqrt(HEAD_DIM)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("thl,lhd->thd", probs, v), lse


def split_kv_attention(
    q: Tensor,
    k_flat: Tensor,
    v_flat: Tensor,
    tables: Tensor,
    kv_lens: Tensor,
    qpos: Tensor,
    req: Tensor,
    chunk: Tensor,
    num_splits: int,
    max_kv_len: int,
) -> tuple[Tensor, Tensor]:
    """Paged causal attention cut into splits: each split's partial result goes to workspace slot
    ``key // chunk[row]`` (the plan), then the slots are merged. ``num_splits`` sizes the
    workspace (0: the heuristic, from the rows and ``max_kv_len``)."""
    slots_ws = num_splits or heuristic_splits(tables.shape[0], max_kv_len)
    t, width = q.shape[0], tables.shape[1] * BLOCK
    offsets = torch.arange(BLOCK, device=q.device)
    slots = (tables[:, :, None] * BLOCK + offsets).reshape(tables.shape[0], width)[req]
    keys, values = k_flat[slots], v_flat[slots]  # [T, L, H, D]
    j = torch.arange(width, device=q.device)
    valid = (j[None] < kv_lens[req][:, None]) & (j[None] <= qpos[:, None])  # [T, L]
    scores = torch.einsum("thd,tlhd->thl", q, keys) / math.sqrt(HEAD_DIM)
    scores = torch.where(valid[:, None], scores, float("-inf"))
    split = torch.where(valid, j[None] // chunk[req][:, None], 0)  # [T, L]
    index = split[:, None, :].expand(t, HEADS, width)
    # Each split's running max lands in the workspace slot the plan names (a slot past the
    # workspace is an out-of-bounds write: a device-side assert on cuda, a RuntimeError on CPU).
    peak = torch.full((t, HEADS, slots_ws), float("-inf"), device=q.device)
    peak = peak.scatter_reduce(2, index, scores, "amax", include_self=True)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    probs = torch.exp(scores - peak.gather(2, index))  # masked keys: exp(-inf) = 0
    # Sums by a one-hot product rather than scatter_add, whose atomics would make the result
    # depend on the order of the adds on cuda.
    onehot = (split[..., None] == torch.arange(slots_ws, device=q.device)).to(q.dtype)
    values = torch.where(valid[:, :, None, None], values, torch.zeros_like(values))
    denom = torch.einsum("thl,tls->ths", probs, onehot)
    acc = torch.einsum("thl,tls,tlhd->thsd", probs, onehot, values)
    lse = torch.where(denom > 0, peak + torch.log(denom), float("-inf"))
    out = acc / denom.clamp_min(1e-30)[..., None]
    return merge_states(out, lse)


def sample(logits: Tensor, seeds: Tensor, positions: Tensor, temps: Tensor, sampled: Tensor):
    """Gumbel-max with noise hashed from (seed, position, token id): no generator, no state."""
    ids = torch.arange(logits.shape[1], device=logits.device)
    mask = 0x7FFFFFFF
    h = (seeds ^ (seeds >> 31)) & mask
    h = (h[:, None] * 0x2545F491 + positions[:, None] * 0x9E3779B1 + ids[None] * 0x85EBCA77) & mask
    for mult in (0x27D4EB2F, 0x165667B1):
        h = ((h ^ (h >> 15)) * mult) & mask
    u = (h.to(torch.float32) + 0.5) / float(mask + 1)
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(sampled.bool(), noisy.argmax(dim=-1), logits.argmax(dim=-1))


class SharedPrefixCascadeRunner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str, buggy: bool):
        self.spec = SPEC
        self.mode = mode
        self.buggy = buggy
        self.be = get_backend(backend)
        dev = self.be.device
        # vLLM's builder: with full graphs, plans are bounded by the graphs' split count.
        self.max_num_splits = GRAPH_SPLITS if mode == "graph" else 0
        with torch.inference_mode():
            self.params = {k: p.to(dev) for k, p in self._weights(seed).items()}
            blocks = SPEC.num_blocks + SYS_BLOCKS  # the prefix blocks come last
            self.k_cache = torch.zeros(blocks * BLOCK, HEADS, HEAD_DIM, device=dev)
            self.v_cache = torch.zeros(blocks * BLOCK, HEADS, HEAD_DIM, device=dev)
            self._state = {
                "k": self.k_cache[: SPEC.num_slots],
                "v": self.v_cache[: SPEC.num_slots],
            }
            self.meta = torch.zeros(NUM_FIELDS, T_MAX, dtype=torch.int64, device=dev)
            self.tables = torch.zeros(T_MAX, TABLE_W, dtype=torch.int64, device=dev)
            self.temps = torch.ones(T_MAX, device=dev)
            self.attn_out = torch.zeros(T_MAX, HIDDEN, device=dev)
            self._fill_prefix()
            self.full: dict[int, tuple[object, Tensor, Tensor]] = {}
            self.pieces: dict[int, tuple[object, object, tuple[Tensor, ...], Tensor, Tensor]] = {}
            if mode == "graph":
                self._capture()

    # ---- weights and the shared prefix ----

    @staticmethod
    def _weights(seed: int) -> dict[str, Tensor]:
        g = torch.Generator().manual_seed(seed)

        def rand(*shape: int, scale: float) -> Tensor:
            return torch.randn(*shape, generator=g) * scale

        return {
            "emb": rand(SPEC.vocab_size, HIDDEN, scale=1.0),
            "pos": rand(MAX_POS, HIDDEN, scale=0.5),
            "wqkv": rand(HIDDEN, 3 * HIDDEN, scale=HIDDEN**-0.5),
            "wo": rand(HIDDEN, HIDDEN, scale=HIDDEN**-0.5),
            "w1": rand(HIDDEN, FFN, scale=HIDDEN**-0.5),
            "w2": rand(FFN, HIDDEN, scale=FFN**-0.5),
            "lm": rand(HIDDEN, SPEC.vocab_size, scale=HIDDEN**-0.5 * 2),
        }

    def _fill_prefix(self) -> None:
        """Recompute the system prompt's keys and values into its pinned blocks, in place."""
        dev = self.be.device
        tokens = torch.tensor(SYS_TOKENS, device=dev)
        _, _, k, v = self._pre(tokens, torch.arange(SYS_LEN, device=dev))
        start = SPEC.num_slots
        self.k_cache[start : start + SYS_LEN].copy_(k)
        self.v_cache[start : start + SYS_LEN].copy_(v)

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            for name, value in self._weights(seed).items():
                self.params[name].copy_(value.to(self.be.device))
            self._fill_prefix()  # the prefix cache is stale once the weights change

    # ---- the model, in pieces ----

    def _pre(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        p = self.params
        x = p["emb"][tokens] + p["pos"][positions]
        q, k, v = (x @ p["wqkv"]).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        return x, q, k, v

    def _post(self, x: Tensor, attn: Tensor, rows: int) -> tuple[Tensor, Tensor]:
        p, m = self.params, self.meta
        h = x + attn @ p["wo"]
        h = h + torch.nn.functional.silu(h @ p["w1"]) @ p["w2"]
        last = m[LAST, :rows]
        logits = h[last] @ p["lm"]
        tokens = sample(logits, m[SEED, :rows], m[POS][last], self.temps[:rows], m[SAMPLED, :rows])
        return logits, tokens

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        n_tok: int,
        n_req: int,
        cascade: bool,
        num_splits: int,
        max_kv: int,
    ) -> Tensor:
        """Store this step's keys and values, then attend (cascade or one pass): [n_tok, HIDDEN]."""
        m = self.meta
        slots = m[SLOT, :n_tok]
        self.k_cache.index_copy_(0, slots, k[:n_tok])
        self.v_cache.index_copy_(0, slots, v[:n_tok])
        q, req, pos = q[:n_tok], m[REQ, :n_tok], m[POS, :n_tok]
        kv_lens, chunk, tables = m[KVLEN, :n_req], m[CHUNK, :n_req], self.tables[:n_req]
        if not cascade:
            out, _ = split_kv_attention(
                q, self.k_cache, self.v_cache, tables, kv_lens, pos, req, chunk, num_splits, max_kv
            )
            return out.reshape(n_tok, HIDDEN)
        return self._cascade_attention(q, req, pos, kv_lens, chunk, tables, num_splits, max_kv)

    def _cascade_attention(self, q, req, pos, kv_lens, chunk, tables, max_num_splits, max_kv):
        n_tok = q.shape[0]
        prefix = tables[:1, :SYS_BLOCKS, None] * BLOCK + torch.arange(BLOCK, device=q.device)
        prefix = prefix.reshape(-1)
        out_p, lse_p = dense_attention(q, self.k_cache[prefix], self.v_cache[prefix])
        # The suffix kernel gets the split bound its plan was made with (vLLM PR #28702); the
        # buggy runner launches it with 0, the kernel's own heuristic, as before the fix.
        num_splits = 0 if self.buggy else max_num_splits
        out_s, lse_s = split_kv_attention(
            q,
            self.k_cache,
            self.v_cache,
            tables[:, SYS_BLOCKS:],
            kv_lens - SYS_LEN,
            pos - SYS_LEN,
            req,
            chunk,
            num_splits,
            max_kv - SYS_LEN,
        )
        out, _ = merge_states(torch.stack((out_p, out_s), 2), torch.stack((lse_p, lse_s), 2))
        return out.reshape(n_tok, HIDDEN)

    # ---- metadata ----

    def _build(self, batch: Batch, bound: int) -> tuple[bool, int]:
        """Write the batch into the static buffers (padding everywhere else); returns whether the
        step uses cascade attention and its longest row's keys (the host's max_seqlen_k)."""
        reqs = batch.requests
        n_req = len(reqs)
        cascade = n_req >= CASCADE_MIN_REQS  # every request shares the system prompt
        meta = torch.zeros(NUM_FIELDS, T_MAX, dtype=torch.int64)
        meta[SLOT] = SPEC.null_block * BLOCK
        meta[REQ] = torch.arange(T_MAX)  # a padding token belongs to the padding row of its index
        meta[LAST] = torch.arange(T_MAX)
        meta[CHUNK] = 1
        tables = torch.full((T_MAX, TABLE_W), SPEC.null_block, dtype=torch.int64)
        temps = torch.ones(T_MAX)
        kv_lens = [SYS_LEN + r.seq_len for r in reqs]
        plan_lens = [kv - SYS_LEN for kv in kv_lens] if cascade else kv_lens
        t = 0
        for row, r in enumerate(reqs):
            for i, token in enumerate(r.tokens):
                p = r.context_len + i
                slot = r.block_ids[p // BLOCK] * BLOCK + p % BLOCK
                meta[TOK, t], meta[POS, t], meta[SLOT, t], meta[REQ, t] = (
                    token,
                    SYS_LEN + p,
                    slot,
                    row,
                )
                t += 1
            meta[LAST, row] = t - 1
            meta[KVLEN, row] = kv_lens[row]
            meta[SEED, row] = r.seed or 0
            meta[SAMPLED, row] = r.seed is not None
            temps[row] = r.temperature
            sys_blocks = range(SPEC.num_blocks, SPEC.num_blocks + SYS_BLOCKS)
            tables[row, : SYS_BLOCKS + len(r.block_ids)] = torch.tensor((*sys_blocks, *r.block_ids))
        if reqs:
            meta[CHUNK, :n_req] = torch.tensor(plan_chunks(plan_lens, bound))
        self.meta.copy_(meta)
        self.tables.copy_(tables)
        self.temps.copy_(temps)
        self.attn_out.zero_()
        return cascade, max(kv_lens, default=0)

    # ---- graphs ----

    def _run_full(self, size: int) -> tuple[Tensor, Tensor]:
        m = self.meta
        x, q, k, v = self._pre(m[TOK, :size], m[POS, :size])
        attn = self._attend(q, k, v, size, size, False, GRAPH_SPLITS, MAX_POS)
        return self._post(x, attn, size)

    def _capture(self) -> None:
        """Capture every graph up front on an all-padding batch, largest first."""
        self._build(Batch(()), GRAPH_SPLITS)  # every row is padding
        for size in sorted(FULL_SIZES, reverse=True):
            self._run_full(size)  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph):
                logits, tokens = self._run_full(size)
            self.full[size] = (graph, logits, tokens)
        for size in sorted(PIECE_SIZES, reverse=True):
            m = self.meta
            self._post(self._pre(m[TOK, :size], m[POS, :size])[0], self.attn_out[:size], size)
            self.be.synchronize()
            first, second = self.be.Graph(), self.be.Graph()
            with self.be.graph(first):
                pre = self._pre(m[TOK, :size], m[POS, :size])
            with self.be.graph(second):
                logits, tokens = self._post(pre[0], self.attn_out[:size], size)
            self.pieces[size] = (first, second, pre, logits, tokens)

    # ---- the step ----

    def step(self, batch: Batch) -> StepResult:
        n_req, n_tok = batch.num_reqs, batch.num_tokens
        with torch.inference_mode():
            if self.mode == "eager" or n_tok > PIECE_SIZES[-1]:
                cascade, max_kv = self._build(batch, 0)
                m = self.meta
                x, q, k, v = self._pre(m[TOK, :n_tok], m[POS, :n_tok])
                attn = self._attend(q, k, v, n_tok, n_req, cascade, 0, max_kv)
                logits, tokens = self._post(x, attn, n_req)
                reason = None if self.mode == "eager" else "tokens past the largest graph"
                return StepResult(logits, tokens, "eager", None, reason)
            cascade, max_kv = self._build(batch, self.max_num_splits)
            if not cascade and set(batch.query_lens) == {1}:
                size = next(s for s in FULL_SIZES if s >= n_req)
                graph, logits, tokens = self.full[size]
                graph.replay()
                return StepResult(
                    logits[:n_req].clone(), tokens[:n_req].clone(), "full", ("full", size)
                )
            size = next(s for s in PIECE_SIZES if s >= n_tok)
            first, second, (_, q, k, v), logits, tokens = self.pieces[size]
            first.replay()
            attn = self._attend(q, k, v, n_tok, n_req, cascade, self.max_num_splits, max_kv)
            self.attn_out[:n_tok].copy_(attn)
            second.replay()
            reason = "cascade attention" if cascade else "not a one-token decode batch"
            return StepResult(
                logits[:n_req].clone(),
                tokens[:n_req].clone(),
                "piecewise",
                ("piecewise", size),
                reason,
            )

    # ---- the rest of the contract ----

    def state(self) -> Mapping[str, Tensor]:
        return self._state

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode == "eager":
            return {}
        return {"meta": self.meta, "tables": self.tables, "temps": self.temps, "out": self.attn_out}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def close(self) -> None:
        for graph, *_ in self.full.values():
            graph.reset()
        for first, second, *_ in self.pieces.values():
            first.reset()
            second.reset()
        self.full.clear()
        self.pieces.clear()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SharedPrefixCascadeRunner:
    return SharedPrefixCascadeRunner(mode, seed=seed, backend=backend, buggy=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SharedPrefixCascadeRunner:
    return SharedPrefixCascadeRunner(mode, seed=seed, backend=backend, buggy=True)
