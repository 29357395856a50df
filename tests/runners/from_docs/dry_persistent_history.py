"""A decode-graph runner whose captured step applies a DRY penalty over a persistent batch's
device-resident token history.

Design. The runner follows vLLM V1's persistent batch (`InputBatch`): requests scheduled in a
step hold rows of the batch; a request the step leaves out is removed from it, and the batch is
condensed (the last live rows move into the holes) before new requests are appended. Each row
owns a row of a device token history, `history[max_num_reqs + 1, max_seq_len]` (the last row is
the padding rows' scratch row): a row added to the batch gets its request's tokens uploaded from
the host's per-request record, a row moved by condensing is copied on the device, and every step
scatters its own query tokens into it at their positions (inside the captured graph on decode
steps), so a row holds what the batches sent for its request, context and query tokens. After the
forward, the step applies DRY ("Don't Repeat Yourself", after llama.cpp's and Aphrodite/sonar's)
to each row's last-token logits: a token that would extend a repetition of the history's suffix
is penalized by `multiplier * base ** (match_len - allowed_length)`, the match found by comparing
the history with its own suffix (capped at `DRY_MAX_NGRAM` tokens); then it samples (greedy, or
Gumbel-max with noise hashed from seed, position and token). The returned logits are the
processed ones. As in vLLM, the batch's sampling metadata is rebuilt by `_refresh_metadata` when
the batch's composition changes: the rows' DRY values move with the rows. The DRY scan reads a
history view `(history, width)`: eagerly the history sliced to `width` columns, in the graph the
whole history with each row's length clamped to `width` (a device scalar), so both read
`min(seq_len, width)` tokens of a row, as sonar's CPU kernel clamps each row's length to its
history tensor's width. Uniform decode steps up to the largest capture size replay one graph per
size (captured at start-up, largest first, one pool); prefill, mixed and larger steps run eagerly.

The bug (`make_buggy_target`). The history view's width is kept with the sampling metadata, taken
as the rows' longest history when the metadata is built, and so refreshed only when the batch's
composition changes. In steady decoding every new token lands past the frozen width: the scan
clamps each row to it and keeps matching against the prefix it saw when the batch last changed,
so the penalties are those of an old context (or none). The correct runner takes the width again
at every step. Source: dphnAI/sonar (the Aphrodite engine), PR "fix: DRY sampler never applies
during decoding (stale token history views)", https://github.com/dphnAI/sonar/pull/1720 :
`InputBatch._make_sampling_metadata()` cuts `token_ids_cpu_tensor[:num_reqs, :max_history_len]`
when it builds the metadata, which is rebuilt only on batch-composition changes, and
`dry_scan_penalties` clamps each row's length to that view's width (the PR was closed unmerged;
the code it describes is still in the repository's newest snapshot). The graph and eager twins
see the same batches and rebuild at the same steps, so they agree; the bug shows where a request
meets other company, whose batch changes at other steps.

What the contract could not express: per-request DRY parameters (a request carries only its seed
and temperature), so every request gets the engine's DRY defaults below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

BLOCK_SIZE = 4
MAX_BLOCKS = 10
MAX_SEQ = BLOCK_SIZE * MAX_BLOCKS
VOCAB = 32
HIDDEN = 32
HEADS = 2
HEAD_DIM = HIDDEN // HEADS
MAX_REQS = 8
SPEC = TargetSpec(
    num_blocks=48,
    block_size=BLOCK_SIZE,
    max_blocks_per_req=MAX_BLOCKS,
    vocab_size=VOCAB,
    max_num_reqs=MAX_REQS,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
    null_block=0,
)
SCRATCH_ROW = MAX_REQS  # the padding rows' history row

# The engine's DRY defaults (every request gets them: see the docstring).
DRY_MULTIPLIER = 0.8
DRY_BASE = 1.75
DRY_ALLOWED_LENGTH = 1
DRY_MAX_NGRAM = 4


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    return {
        "embed": rand(VOCAB, HIDDEN, scale=1.0),
        "pos": rand(MAX_SEQ, HIDDEN, scale=0.5),
        "qkv": rand(HIDDEN, 3 * HIDDEN, scale=HIDDEN**-0.5),
        "out": rand(HIDDEN, HIDDEN, scale=HIDDEN**-0.5),
        "up": rand(HIDDEN, 2 * HIDDEN, scale=HIDDEN**-0.5),
        "down": rand(2 * HIDDEN, HIDDEN, scale=(2 * HIDDEN) ** -0.5),
        "head": rand(HIDDEN, VOCAB, scale=2.0 * HIDDEN**-0.5),
    }


def _hash01(x: torch.Tensor) -> torch.Tensor:
    """Integer hash of int64 values to floats in (0, 1)."""
    x = x & 0x7FFFFFFF
    for _ in range(3):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        x = x ^ (x >> 13)
    return (x.to(torch.float32) + 0.5) / 2147483648.0


def dry_penalties(hist: torch.Tensor, lens: torch.Tensor, row_mult: torch.Tensor) -> torch.Tensor:
    """DRY penalties [rows, vocab] from each row's history `hist[:, :lens]` (lens <= columns).

    A position idx < len - 1 holding the last token ends a match; its length is 1 plus how many
    tokens before it equal those before the last one (up to DRY_MAX_NGRAM). The token after it,
    `hist[idx + 1]`, would extend the repetition: it is penalized by its longest match."""
    cols = hist.shape[1]
    col = torch.arange(cols, device=hist.device).unsqueeze(0)
    lens = lens.unsqueeze(1)
    last = hist.gather(1, (lens - 1).clamp(min=0))
    ends = (col <= lens - 2) & (hist == last)
    match = ends.long()
    run = ends
    for u in range(1, DRY_MAX_NGRAM + 1):
        before = F.pad(hist, (u, 0), value=-1)[:, :cols]
        tail = hist.gather(1, (lens - 1 - u).clamp(min=0))
        run = run & (before == tail) & (lens - 1 - u >= 0)
        match = match + run.long()
    following = F.pad(hist, (0, 1), value=-1)[:, 1:]
    vocab = torch.arange(VOCAB, device=hist.device)
    hits = (following.unsqueeze(-1) == vocab) & ends.unsqueeze(-1)
    best = torch.where(hits, match.unsqueeze(-1), 0).amax(dim=1)
    scale = torch.pow(DRY_BASE, (best - DRY_ALLOWED_LENGTH).to(torch.float32))
    penalty = torch.where(best >= DRY_ALLOWED_LENGTH, scale, 0.0)
    return penalty * row_mult.unsqueeze(1)


@dataclass
class StepInputs:
    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]
    tables: torch.Tensor  # [T, MAX_BLOCKS] each token's request's block table
    tok_rows: torch.Tensor  # [T] history row of each token
    last_idx: torch.Tensor  # [R] each request's last query token
    rows: torch.Tensor  # [R] history row of each request
    seq_lens: torch.Tensor  # [R]
    seeds: torch.Tensor  # [R] (-1: greedy)
    temps: torch.Tensor  # [R]


class DryHistoryRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, stale_view: bool) -> None:
        self.spec = SPEC
        self.mode = mode
        self.stale_view = stale_view
        self.be = get_backend(backend)
        self.dev = self.be.device
        with torch.inference_mode():
            self.w = {k: v.to(self.dev) for k, v in _params(seed).items()}
            slots = SPEC.num_blocks * BLOCK_SIZE
            self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.dev)
            self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.dev)
            # Persistent batch: device history rows and the rows' sampling metadata.
            self.history = torch.zeros(MAX_REQS + 1, MAX_SEQ, dtype=torch.long, device=self.dev)
            self.row_mult = torch.zeros(MAX_REQS + 1, device=self.dev)
            self.width = torch.zeros(1, dtype=torch.long, device=self.dev)
            self.width_host = 0
            self.rows: list[int | None] = [None] * MAX_REQS
            self.row_of: dict[int, int] = {}
            self.tokens_of: dict[int, list[int]] = {}  # host record of each request's tokens
            self.graphs: dict[int, Any] = {}
            self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            self.static: dict[str, torch.Tensor] = {}
            if mode == "graph":
                self._capture()

    # ----- the model -----------------------------------------------------------------------

    def _forward(self, x: StepInputs, hist_view: torch.Tensor, width: torch.Tensor | None):
        """Forward, DRY and sampling. `hist_view` is the history (sliced to the view's width
        eagerly, whole in a graph, where `width` clamps each row instead)."""
        w = self.w
        self.history.index_put_((x.tok_rows, x.positions), x.tokens)
        h = w["embed"][x.tokens] + w["pos"][x.positions]
        q, k, v = (h @ w["qkv"]).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        self.k_cache.index_copy_(0, x.slots, k)
        self.v_cache.index_copy_(0, x.slots, v)
        j = torch.arange(MAX_SEQ, device=self.dev)
        ctx_slots = x.tables[:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
        visible = (j.unsqueeze(0) <= x.positions.unsqueeze(1)).unsqueeze(-1)
        keys = self.k_cache[ctx_slots]
        vals = torch.where(visible.unsqueeze(-1), self.v_cache[ctx_slots], 0.0)
        scores = (q.unsqueeze(1) * keys).sum(-1) / math.sqrt(HEAD_DIM)
        probs = torch.softmax(torch.where(visible, scores, -math.inf), dim=1)
        att = (probs.unsqueeze(-1) * vals).sum(1).reshape(-1, HIDDEN)
        h = h + att @ w["out"]
        h = h + F.silu(h @ w["up"]) @ w["down"]
        logits = h[x.last_idx] @ w["head"]
        # DRY over the persistent history view.
        lens = x.seq_lens if width is None else torch.minimum(x.seq_lens, width)
        lens = lens.clamp(max=hist_view.shape[1])
        logits = logits - dry_penalties(hist_view[x.rows], lens, self.row_mult[x.rows])
        # Sampling: greedy, or Gumbel-max with noise hashed from seed, position and token.
        pos = (x.seq_lens - 1).clamp(min=0)
        vocab = torch.arange(VOCAB, device=self.dev)
        key = (x.seeds.clamp(min=0) * 7919 + pos * 104729).unsqueeze(1) + vocab * 1299709
        gumbel = -torch.log(-torch.log(_hash01(key)))
        sampled = torch.argmax(logits / x.temps.unsqueeze(1) + gumbel, dim=1)
        tokens = torch.where(x.seeds < 0, torch.argmax(logits, dim=1), sampled)
        return logits, tokens

    # ----- the persistent batch ------------------------------------------------------------

    def _update_states(self, batch: Batch) -> bool:
        """Remove the rows of requests this step leaves out (or restarts), condense, add the
        new ones; returns whether the batch's composition changed."""
        by_id = {r.req_id: r for r in batch.requests}
        changed = False
        for row, rid in enumerate(self.rows):
            if rid is not None and (rid not in by_id or by_id[rid].context_len == 0):
                self.rows[row] = None
                del self.row_of[rid]
                changed = True
        for r in batch.requests:
            if r.context_len == 0:
                self.tokens_of[r.req_id] = []
            record = self.tokens_of.get(r.req_id)
            if record is None or len(record) < r.context_len:
                raise ValueError(f"request {r.req_id} continues a history this runner never saw")
            del record[r.context_len :]
            record.extend(r.tokens)
        # Condense: the last live rows move into the holes.
        live = sum(rid is not None for rid in self.rows)
        for hole in range(live):
            if self.rows[hole] is None:
                last = max(i for i, rid in enumerate(self.rows) if rid is not None)
                rid = self.rows[last]
                assert rid is not None
                self.rows[hole], self.rows[last] = rid, None
                self.row_of[rid] = hole
                self.history[hole].copy_(self.history[last])
                changed = True
        for r in batch.requests:
            if r.req_id not in self.row_of:
                row = self.rows.index(None)
                self.rows[row] = r.req_id
                self.row_of[r.req_id] = row
                if r.context_len:
                    prefix = self.tokens_of[r.req_id][: r.context_len]
                    self.history[row, : r.context_len].copy_(
                        torch.tensor(prefix, dtype=torch.long, device=self.dev)
                    )
                changed = True
        return changed

    def _refresh_metadata(self, changed: bool) -> None:
        """The rows' sampling metadata: their DRY values (moved with the rows on a change) and
        the history view's width, the longest history of the rows."""
        if changed:
            mult = torch.zeros(MAX_REQS + 1)
            for row, rid in enumerate(self.rows):
                if rid is not None:
                    mult[row] = DRY_MULTIPLIER
            self.row_mult.copy_(mult)
        if changed or not self.stale_view:
            width = max(len(self.tokens_of[rid]) for rid in self.rows if rid is not None)
            self.width.fill_(width)
            self.width_host = width

    # ----- inputs --------------------------------------------------------------------------

    def _host_inputs(self, batch: Batch, size: int, rows_size: int) -> dict[str, torch.Tensor]:
        """Host tensors of the step's inputs, padded to `size` tokens and `rows_size` rows."""
        toks, poss, slots, tables, tok_rows, last_idx = [], [], [], [], [], []
        rows, seq_lens, seeds, temps = [], [], [], []
        for r in batch.requests:
            table = list(r.block_ids) + [SPEC.null_block] * (MAX_BLOCKS - len(r.block_ids))
            row = self.row_of[r.req_id]
            for i, t in enumerate(r.tokens):
                p = r.context_len + i
                toks.append(t)
                poss.append(p)
                slots.append(r.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
                tables.append(table)
                tok_rows.append(row)
            last_idx.append(len(toks) - 1)
            rows.append(row)
            seq_lens.append(r.seq_len)
            seeds.append(-1 if r.seed is None else r.seed)
            temps.append(r.temperature)
        pad_t, pad_r = size - len(toks), rows_size - len(rows)
        null_slot = SPEC.null_block * BLOCK_SIZE
        return {
            "tokens": torch.tensor(toks + [0] * pad_t),
            "positions": torch.tensor(poss + [0] * pad_t),
            "slots": torch.tensor(slots + [null_slot] * pad_t),
            "tables": torch.tensor(tables + [[SPEC.null_block] * MAX_BLOCKS] * pad_t),
            "tok_rows": torch.tensor(tok_rows + [SCRATCH_ROW] * pad_t),
            "last_idx": torch.tensor(last_idx + [0] * pad_r),
            "rows": torch.tensor(rows + [SCRATCH_ROW] * pad_r),
            "seq_lens": torch.tensor(seq_lens + [0] * pad_r),
            "seeds": torch.tensor(seeds + [-1] * pad_r),
            "temps": torch.tensor(temps + [1.0] * pad_r, dtype=torch.float32),
        }

    # ----- graphs --------------------------------------------------------------------------

    def _capture(self) -> None:
        size = max(SPEC.capture_sizes)
        for name, t in self._host_inputs(Batch(()), size, size).items():
            self.static[name] = t.to(self.dev)
        pool = self.be.graph_pool_handle()
        for s in sorted(SPEC.capture_sizes, reverse=True):
            inputs = self._static_inputs(s)
            self._forward(inputs, self.history, self.width)  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[s] = self._forward(inputs, self.history, self.width)
            self.graphs[s] = graph

    def _static_inputs(self, s: int) -> StepInputs:
        return StepInputs(**{name: t[:s] for name, t in self.static.items()})

    def _graph_size(self, batch: Batch) -> int | None:
        if self.mode != "graph" or not batch.requests or set(batch.query_lens) != {1}:
            return None
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    # ----- the contract --------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            self._check(batch.requests)
            changed = self._update_states(batch)
            self._refresh_metadata(changed)
            n = batch.num_reqs
            size = self._graph_size(batch)
            if size is not None:
                host = self._host_inputs(batch, max(SPEC.capture_sizes), max(SPEC.capture_sizes))
                for name, t in host.items():
                    self.static[name].copy_(t)
                self.graphs[size].replay()
                logits, tokens = self.outputs[size]
                return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
            host = self._host_inputs(batch, batch.num_tokens, n)
            inputs = StepInputs(**{k: t.to(self.dev) for k, t in host.items()})
            view = self.history[:, : self.width_host]
            logits, tokens = self._forward(inputs, view, None)
            reason = "eager mode" if self.mode == "eager" else "not a decode step within a graph"
            return StepResult(logits, tokens, "eager", None, reason)

    def _check(self, requests: Sequence[Request]) -> None:
        for r in requests:
            if not r.tokens or r.seq_len > MAX_SEQ or len(r.block_ids) > MAX_BLOCKS:
                raise ValueError(f"request {r.req_id} does not fit this runner")

    def state(self) -> Mapping[str, torch.Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return dict(self.static) if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            for name, value in _params(seed).items():
                self.w[name].copy_(value)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DryHistoryRunner:
    return DryHistoryRunner(mode, seed=seed, backend=backend, stale_view=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> DryHistoryRunner:
    return DryHistoryRunner(mode, seed=seed, backend=backend, stale_view=True)
