"""EAGLE/MTP-style decode step: a target graph writes its last hidden states, a draft graph reads them.

The runner serves a one-layer paged-KV decoder (the *target*) plus a two-layer draft head in
the style of EAGLE / DeepSeek MTP. The draft runs one row per request, at its last query token: the
row merges the target's final hidden state there with the token the target just produced, `fc`
over `[rms(embed(token)), rms(hidden)]`, then one residual SiLU MLP and the target's shared LM
head; the row's argmax is the request's proposal. Its state is so written once a request, not
once a token, which the contract allows (the other slots keep the harness's mark).

Graph mode captures, per capture size (in tokens) and into one shared pool, two graphs:
- the target decode graph: forward, sampling, and (inside the graph) a copy of the hidden states
  and sampled tokens into the static buffers `hidden` / `next`;
- the draft graph, reading exactly those static buffers (and `dslots`).
A decode batch (every query length 1, few enough requests) replays both, target then draft. Any
other batch (prefill, mixed, speculative, too many rows) runs the target eagerly; when its tokens
fit a capture size the runner then writes the eager hidden states, shifted tokens and slots into
the same static buffers and still replays the draft graph (as SGLang's draft graphs run after an
eager target step); otherwise the draft runs eagerly too.

Where the proposal goes. The contract has no place for runner-made draft tokens: the harness is
the scheduler and supplies the drafts of a speculative step itself, and a `StepResult` holds the
target's logits and tokens only. So the step's result is plain target decoding, and the draft's
output is published the way an engine keeps it for its next round: in per-slot state next to the
KV cache, at the slot of each token (`draft_h`, the draft hidden state a chain-style MTP seeds
its next round with, and `draft_logp`, the draft distribution; at a request's last token its
argmax is the proposal). Both are slot-major tensors of `state()`, so `states_match` compares the
graph twin's proposals with the eager twin's, deterministically, at every step.

The bug (`make_buggy_target`): the draft graph is captured on the hidden-state tensor that the
target's capture allocated afresh (the target graph's own output `target_out[size].hidden`)
instead of the shared static buffer `hidden` that every path writes. After a target replay both
hold the same values, so every pure decode step is right; but after an eager target step (a
prefill, a mixed or speculative batch) the runner writes the eager hidden states into the shared
buffer and the draft graph reads the target graph's output as the last replay of that size left
it (or as the capture left it): the proposal and the draft's state for this step come from
another batch's hidden states. Modelled on SGLang PR #22832 ("fix incorrect behavior in cuda
graph draft extend": "The decode cuda graph may not have run (for example, if the batch size was
too large). This grabs the correct tensors based on whether the cuda graph was run.",
https://github.com/sgl-project/sglang/pull/22832) and on SGLang PR #21424 / issue #21058 (the
multi-layer EAGLE draft-extend graph runner kept a `self.hidden_states` reference after the
input-buffer refactor moved the graph's hidden states to `buffers.hidden_states`, breaking
chain-style MTP hidden-state propagation under CUDA graph replay,
https://github.com/sgl-project/sglang/pull/21424, https://github.com/sgl-project/sglang/issues/21058).
No code was copied from either engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, FF = 32, 2, 16, 64
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
MAX_ROWS = SPEC.capture_sizes[-1]
M32 = 0xFFFFFFFF


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


@dataclass
class TargetIn:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temps: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] index of each request's last token; None when T == R


@dataclass
class TargetOut:
    logits: Tensor  # [R, vocab]
    tokens: Tensor  # [R]
    hidden: Tensor  # [R, hidden] final (normed) hidden state at each request's last token


@dataclass
class DraftIn:
    hidden: Tensor  # [D, hidden] the target's hidden states, one draft row per request
    next_tokens: Tensor  # [D] the token each request's target step sampled
    slots: Tensor  # [D] the slot of each row's token (where the draft publishes)


def _make(shapes: dict[str, tuple[int, ...]], device: torch.device) -> dict[str, Tensor]:
    return {name: torch.empty(shape, device=device) for name, shape in shapes.items()}


def _load(weights: dict[str, Tensor], seed: int) -> None:
    """In place, in a fixed order: captured graphs keep reading the same tensors."""
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(weights):
        w = weights[name]
        w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


class Target:
    def __init__(self, device: torch.device) -> None:
        self.w = _make(
            {
                "embed": (SPEC.vocab_size, HIDDEN),
                "pos": (CONTEXT, HIDDEN),
                "q": (HIDDEN, HIDDEN),
                "k": (HIDDEN, HIDDEN),
                "v": (HIDDEN, HIDDEN),
                "o": (HIDDEN, HIDDEN),
                "up": (HIDDEN, FF),
                "down": (FF, HIDDEN),
                "head": (HIDDEN, SPEC.vocab_size),
            },
            device,
        )

    def forward(self, inp: TargetIn, k_cache: Tensor, v_cache: Tensor) -> TargetOut:
        w = self.w
        x = w["embed"][inp.tokens] + w["pos"][inp.positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, inp.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, inp.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + self.attend(q, k_cache, v_cache, inp) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        hidden = _rms(x if inp.last is None else x[inp.last])
        logits = hidden @ w["head"]
        positions = inp.positions if inp.last is None else inp.positions[inp.last]
        return TargetOut(logits, sample(logits, positions, inp), hidden)

    @staticmethod
    def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: TargetIn) -> Tensor:
        offsets = torch.arange(SPEC.block_size, device=q.device)
        ctx = (inp.tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT]
        keys, values = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inp.positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = scores / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
        return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def sample(logits: Tensor, positions: Tensor, inp: TargetIn) -> Tensor:
    """Gumbel-max on a hash of (seed, position, token id): independent of batch and bucket."""
    key = _hash32(_hash32(inp.seeds) ^ ((positions * 0x61C88647) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash32(key[:, None] ^ ((ids * 0x7FEB352D) & M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inp.temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


class DraftHead:
    """Two layers: a merge of token embedding and target hidden state, then a residual MLP."""

    def __init__(self, device: torch.device) -> None:
        self.w = _make(
            {"fc": (2 * HIDDEN, HIDDEN), "up": (HIDDEN, FF), "down": (FF, HIDDEN)}, device
        )

    def forward(self, inp: DraftIn, target: Target, draft_h: Tensor, draft_logp: Tensor) -> Tensor:
        w = self.w
        e = _rms(target.w["embed"][inp.next_tokens])
        x = torch.cat([e, _rms(inp.hidden)], dim=-1) @ w["fc"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        logp = torch.log_softmax(_rms(x) @ target.w["head"], dim=-1)
        draft_h.index_copy_(0, inp.slots, x)
        draft_logp.index_copy_(0, inp.slots, logp)
        return logp.argmax(-1)  # the proposal


class DraftRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, buggy: bool = False) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.buggy = buggy
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.target, self.draft = Target(dev), DraftHead(dev)
        self.update_weights(seed)
        kv_shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k, self.v = torch.zeros(kv_shape, device=dev), torch.zeros(kv_shape, device=dev)
        self.draft_h = torch.zeros(SPEC.num_slots, HIDDEN, device=dev)
        self.draft_logp = torch.zeros(SPEC.num_slots, SPEC.vocab_size, device=dev)
        self.bufs: dict[str, Tensor] = {}
        self.target_graphs: dict[int, Any] = {}
        self.draft_graphs: dict[int, Any] = {}
        self.target_out: dict[int, TargetOut] = {}
        self.draft_out: dict[int, Tensor] = {}
        self.draft_in: dict[int, DraftIn] = {}
        if mode == "graph":
            i64 = torch.int64
            self.bufs = {
                "tokens": torch.zeros(MAX_ROWS, dtype=i64, device=dev),
                "positions": torch.zeros(MAX_ROWS, dtype=i64, device=dev),
                "slots": torch.zeros(MAX_ROWS, dtype=i64, device=dev),
                "tables": torch.zeros(MAX_ROWS, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(MAX_ROWS, dtype=i64, device=dev),
                "temps": torch.ones(MAX_ROWS, device=dev),
                "sampled": torch.zeros(MAX_ROWS, dtype=torch.bool, device=dev),
                # the hand-off between the two graphs, written by every path before a draft replay
                "hidden": torch.zeros(MAX_ROWS, HIDDEN, device=dev),
                "next": torch.zeros(MAX_ROWS, dtype=i64, device=dev),
                "dslots": torch.zeros(MAX_ROWS, dtype=i64, device=dev),
            }
            self.capture()

    # -- graph mode ------------------------------------------------------------------------------

    def target_inputs(self, size: int) -> TargetIn:
        b = self.bufs
        return TargetIn(
            b["tokens"][:size],
            b["positions"][:size],
            b["slots"][:size],
            b["tables"][:size],
            b["seeds"][:size],
            b["temps"][:size],
            b["sampled"][:size],
        )

    def run_target_graphable(self, size: int) -> TargetOut:
        out = self.target.forward(self.target_inputs(size), self.k, self.v)
        self.bufs["hidden"][:size].copy_(out.hidden)  # hand-off to the draft graph
        self.bufs["next"][:size].copy_(out.tokens)
        return out

    def draft_inputs(self, size: int) -> DraftIn:
        hidden = self.bufs["hidden"][:size]
        if self.buggy:
            # BUG: the target capture's own output tensor, which only a target replay rewrites
            hidden = self.target_out[size].hidden
        return DraftIn(hidden, self.bufs["next"][:size], self.bufs["dslots"][:size])

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)  # all rows padding during warm-up and capture
            self.run_target_graphable(size)  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.target_out[size] = self.run_target_graphable(size)
            self.target_graphs[size] = graph

            self.draft_in[size] = din = self.draft_inputs(size)
            self.draft.forward(din, self.target, self.draft_h, self.draft_logp)  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.draft_out[size] = self.draft.forward(
                    din, self.target, self.draft_h, self.draft_logp
                )
            self.draft_graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        """Decode rows into the prefix of every buffer both graphs read; padding rows reset."""
        n = batch.num_reqs
        rows = {
            "tokens": [r.tokens[0] for r in batch.requests],
            "positions": [r.context_len for r in batch.requests],
            "slots": [_slot(r, r.context_len) for r in batch.requests],
            "tables": [_table(r) for r in batch.requests],
            "seeds": [_sampling(r)[0] for r in batch.requests],
            "temps": [_sampling(r)[1] for r in batch.requests],
            "sampled": [_sampling(r)[2] for r in batch.requests],
            "dslots": [_slot(r, r.seq_len - 1) for r in batch.requests],
        }
        for name, values in rows.items():
            buf = self.bufs[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(_PAD[name])
        # `hidden` and `next` are written by the target graph itself, every row

    def draft_rows(self, out: TargetOut, batch: Batch) -> DraftIn:
        """The draft's rows after an eager target step: one per request, at its last token."""
        slots = [_slot(r, r.seq_len - 1) for r in batch.requests]
        return DraftIn(out.hidden, out.tokens, torch.tensor(slots, device=self.be.device))

    def stage_draft(self, rows: DraftIn, size: int) -> None:
        """After an eager target step: the draft's rows into the buffers its graph reads."""
        n = rows.slots.shape[0]
        for name, values, pad in (
            ("hidden", rows.hidden, 0.0),
            ("next", rows.next_tokens, 0),
            ("dslots", rows.slots, NULL_SLOT),
        ):
            self.bufs[name][:n].copy_(values)
            self.bufs[name][n:size].fill_(pad)

    # -- both modes ------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        dev = self.be.device
        if n == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=dev)
            return StepResult(
                empty,
                torch.zeros(0, dtype=torch.int64, device=dev),
                "eager",
                None,
                reason="empty batch",
            )
        size = next((s for s in SPEC.capture_sizes if s >= n), None)
        graphs = self.mode == "graph" and size is not None
        if graphs and all(q == 1 for q in batch.query_lens):
            self.prepare(batch, size)
            self.target_graphs[size].replay()
            self.draft_graphs[size].replay()
            out = self.target_out[size]
            return StepResult(
                out.logits[:n].clone(), out.tokens[:n].clone(), "full", ("decode", size)
            )
        inp = _eager_inputs(batch, dev)
        out = self.target.forward(inp, self.k, self.v)
        rows = self.draft_rows(out, batch)
        dsize = next((s for s in SPEC.capture_sizes if s >= rows.slots.shape[0]), None)
        if self.mode == "graph" and dsize is not None:
            self.stage_draft(rows, dsize)
            self.draft_graphs[dsize].replay()
            reason = (
                f"{batch.phase} batch, query lengths {sorted(set(batch.query_lens))}: "
                f"target eager, draft graph {dsize}"
            )
        else:
            self.draft.forward(rows, self.target, self.draft_h, self.draft_logp)
            reason = "eager twin" if self.mode == "eager" else "too many rows for the graphs"
        return StepResult(out.logits, out.tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k, "v": self.v, "draft_h": self.draft_h, "draft_logp": self.draft_logp}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.bufs

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        _load(self.target.w, seed)
        _load(self.draft.w, seed + 7919)

    def close(self) -> None:
        for g in (*self.target_graphs.values(), *self.draft_graphs.values()):
            g.reset()
        self.target_graphs.clear()
        self.draft_graphs.clear()
        self.target_out.clear()
        self.draft_out.clear()
        self.draft_in.clear()


_PAD: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
    "dslots": NULL_SLOT,
}


def _slot(r: Request, position: int) -> int:
    return kv_slot(r.block_ids, position, SPEC.block_size)


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, r.temperature, True


def _eager_inputs(batch: Batch, dev: torch.device) -> TargetIn:
    tokens, positions, slots, tables, last = [], [], [], [], []
    for r in batch.requests:
        for i, tok in enumerate(r.tokens):
            tokens.append(tok)
            positions.append(r.context_len + i)
            slots.append(_slot(r, r.context_len + i))
            tables.append(_table(r))
        last.append(len(tokens) - 1)
    samp = [_sampling(r) for r in batch.requests]

    def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=dev)

    return TargetIn(
        t(tokens),
        t(positions),
        t(slots),
        t(tables).view(-1, SPEC.max_blocks_per_req),
        t([s[0] for s in samp]),
        t([s[1] for s in samp], torch.float32),
        t([s[2] for s in samp], torch.bool),
        t(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DraftRunner:
    return DraftRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DraftRunner:
    return DraftRunner(mode, seed=seed, backend=backend, buggy=True)
