"""A decode runner whose sampler (repetition / frequency / presence penalties, temperature, min-p,
counter-based Gumbel-max) runs inside the captured decode graph, over per-row persistent state.

Design (after vLLM's Model Runner V2 penalties with bin counts kept in GPU memory,
https://github.com/vllm-project/vllm/pull/29703, and SGLang's batched penalizers):

- A persistent batch of `ROWS` request rows. Each row owns a row of `out_counts` ([ROWS + 1,
  vocab] int32: how often each token was generated), of `prompt_mask` ([ROWS + 1, vocab] bool:
  which tokens the prompt holds) and of the parameter rows (`params` [ROWS + 1, 5] float:
  repetition, frequency, presence, min-p, temperature; `seeds`, `sampled`). Row `ROWS` is a
  scratch row that only padding uses.
- Requests join, leave and move: at each step the requests not scheduled leave their rows, the
  rows left are condensed downwards (vLLM's `InputBatch.condense`: the highest row moves into the
  lowest hole, its counts, mask and parameters copied on the device), and newcomers take the free
  rows, their counts rebuilt from the host-side history (prompt tokens, generated tokens) kept per
  request, exactly as a request that sat out a step is re-added.
- Prompt tokens are counted at prefill (eagerly). A decode step's input token is the token the
  request generated last; the step adds it to the request's `out_counts` row on the device
  (`index_put_(..., accumulate=True)` through `idx_mapping`, batch position -> row), inside the
  captured graph on the graph path, before the penalties read the counts. Padding positions map to
  the scratch row, so their dummy tokens are counted there and nowhere else.
- The step returns the penalized logits (before temperature and min-p) and the sampled tokens.

The harness's `Request` carries no penalty parameters, so each request's are a fixed function of
its `req_id` (a stand-in for the `SamplingParams` an engine would receive).

The bug (`make_buggy_target`): the captured graph's padding positions keep `idx_mapping` at 0 (the
buffer's zero fill) instead of the scratch row, so every padded replay scatters the padding rows'
dummy token into row 0's generated-token counts: the request in row 0 is penalized for tokens it
never produced, on the graph path only (the eager path never pads). Modelled on the class of bug
fixed in text-generation-inference "fix: avoid frequency and repetition penalty on padding
tokens" (https://github.com/huggingface/text-generation-inference/pull/1765), and on the graph
path reading index 0 of an all-zero buffer for padding/empty history discussed in
https://github.com/sgl-project/sglang-omni/pull/279 (no code copied from either).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
ROWS = SPEC.max_num_reqs  # persistent rows; row ROWS is the padding scratch row
SCRATCH = ROWS
V = SPEC.vocab_size
_MASK32 = 0xFFFFFFFF


def penalty_params(req_id: int) -> tuple[float, float, float, float]:
    """(repetition, frequency, presence, min_p) of a request: the SamplingParams stand-in."""
    return (
        1.2 + 0.2 * (req_id % 3),
        0.4 + 0.3 * (req_id % 2),
        0.3 * ((req_id + 1) % 3),
        0.05 * (req_id % 3),
    )


@dataclass
class ReqState:
    """Host-side per-request state (vLLM's CachedRequestState): survives leaving the batch."""

    seed: int | None
    temperature: float
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    seq_len: int = 0
    row: int | None = None


# -- model ----------------------------------------------------------------------------------------


class TinyDecoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (V, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, V),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
        }
        self.device = device
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_(
                (torch.randn(t.shape, generator=gen) * 1.5 / math.sqrt(t.shape[0])).to(self.device)
            )

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        slots: Tensor,
        tables: Tensor,
        last: Tensor | None,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        w = self.w
        x = w["embed"][tokens] + w["pos"][positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=x.device)
        ctx = (tables[:, :, None] * SPEC.block_size + offs).flatten(1)
        keys, vals = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(
            HEAD_DIM
        )
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", probs, vals).flatten(1) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if last is not None:
            x = x[last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


# -- runner ---------------------------------------------------------------------------------------


class PenaltyRunner:
    PAD_ROW = SCRATCH  # where padding positions' idx_mapping points

    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        dev = self.device = self.backend.device
        self.model = TinyDecoder(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        # persistent per-row sampler state
        self.out_counts = torch.zeros(ROWS + 1, V, dtype=torch.int32, device=dev)
        self.prompt_mask = torch.zeros(ROWS + 1, V, dtype=torch.bool, device=dev)
        self.params = torch.zeros(ROWS + 1, 5, device=dev)
        self.params[:, 0] = 1.0
        self.params[:, 4] = 1.0
        self.seeds = torch.zeros(ROWS + 1, dtype=torch.int64, device=dev)
        self.sampled = torch.zeros(ROWS + 1, dtype=torch.bool, device=dev)
        self.ones = torch.ones(SPEC.max_num_tokens, dtype=torch.int32, device=dev)
        self.reqs: dict[int, ReqState] = {}
        self.row_owner: list[int | None] = [None] * ROWS
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            n, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.zeros(n, dtype=i64, device=dev),
                "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "idx": torch.zeros(n, dtype=i64, device=dev),
            }
            self.capture()

    # -- persistent batch -------------------------------------------------------------------------

    def admit(self, batch: Batch) -> list[int]:
        """Bring the persistent batch to this step's requests; return each request's row."""
        current = {r.req_id for r in batch.requests}
        for r in batch.requests:
            st = self.reqs.get(r.req_id)
            if r.context_len == 0 or st is None:
                if r.context_len != 0:
                    raise ValueError(f"request {r.req_id} continues at {r.context_len}, unknown")
                if st is not None and st.row is not None:
                    self.row_owner[st.row] = None  # a new life: its old row is stale
                self.reqs[r.req_id] = ReqState(r.seed, r.temperature)
            elif st.seq_len != r.context_len:
                raise ValueError(f"request {r.req_id}: context {r.context_len} != {st.seq_len}")
        # leave: rows of requests not scheduled this step
        for row, owner in enumerate(self.row_owner):
            if owner is not None and (owner not in current or self.reqs[owner].row != row):
                if owner in self.reqs and self.reqs[owner].row == row:
                    self.reqs[owner].row = None
                self.row_owner[row] = None
        # condense: move the highest occupied rows into the lowest holes
        while True:
            holes = [i for i, o in enumerate(self.row_owner) if o is None]
            used = [i for i, o in enumerate(self.row_owner) if o is not None]
            if not holes or not used or holes[0] > used[-1]:
                break
            self.move_row(used[-1], holes[0])
        # join: newcomers (and returning requests) take free rows, state rebuilt from history
        for r in batch.requests:
            st = self.reqs[r.req_id]
            if st.row is None:
                row = self.row_owner.index(None)
                self.load_row(row, r.req_id, st)
        return [self.reqs[r.req_id].row for r in batch.requests]  # type: ignore[misc]

    def move_row(self, src: int, dst: int) -> None:
        for t in (self.out_counts, self.prompt_mask, self.params, self.seeds, self.sampled):
            t[dst].copy_(t[src])
        owner = self.row_owner[src]
        self.row_owner[dst], self.row_owner[src] = owner, None
        self.reqs[owner].row = dst  # type: ignore[index]

    def load_row(self, row: int, req_id: int, st: ReqState) -> None:
        self.out_counts[row].zero_()
        self.prompt_mask[row].zero_()
        if st.prompt:
            self.prompt_mask[row, torch.tensor(st.prompt, device=self.device)] = True
        if st.output:
            out = torch.tensor(st.output, device=self.device)
            self.out_counts[row].index_put_((out,), self.ones[: len(st.output)], accumulate=True)
        rep, freq, pres, min_p = penalty_params(req_id)
        sampled = st.seed is not None
        temp = st.temperature if sampled else 1.0
        self.params[row].copy_(torch.tensor([rep, freq, pres, min_p, temp], device=self.device))
        self.seeds[row].fill_((st.seed or 0) & _MASK32)
        self.sampled[row].fill_(sampled)
        self.row_owner[row] = req_id
        st.row = row

    def record_history(self, batch: Batch) -> None:
        for r in batch.requests:
            st = self.reqs[r.req_id]
            (st.output if _is_output(r) else st.prompt).extend(r.tokens)
            st.seq_len = r.seq_len

    # -- the sampler (runs inside the graph on the graph path) ------------------------------------

    def sample(self, logits: Tensor, idx: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        counts = self.out_counts[idx]  # [R, V]
        seen = self.prompt_mask[idx] | (counts > 0)
        p = self.params[idx]
        rep, freq, pres, min_p, temp = (p[:, i : i + 1] for i in range(5))
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - freq * counts.to(logits.dtype) - pres * (counts > 0).to(logits.dtype)
        scaled = logits / temp
        probs = scaled.softmax(-1)
        keep = probs >= min_p * probs.amax(-1, keepdim=True)
        scaled = scaled.masked_fill(~keep, float("-inf"))
        key = _mix(_mix(self.seeds[idx]) ^ ((positions * 0x9E3779B1) & _MASK32))
        ids = torch.arange(V, device=logits.device)
        bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
        uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = scaled - torch.log(-torch.log(uniform))
        tokens = torch.where(self.sampled[idx], noisy.argmax(-1), logits.argmax(-1))
        return logits, tokens

    def decode_step(
        self, tokens: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, idx: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One decode token per position: count it as generated, run the model, sample."""
        self.out_counts.index_put_((idx, tokens), self.ones[: tokens.shape[0]], accumulate=True)
        logits = self.model.forward(
            tokens, positions, slots, tables, None, self.k_cache, self.v_cache
        )
        return self.sample(logits, idx, positions)

    # -- graph mode -------------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare([], [], size)
            args = self.static_args(size)
            self.decode_step(*args)  # warm-up
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.decode_step(*args)
            self.graphs[size] = graph

    def static_args(self, size: int) -> tuple[Tensor, ...]:
        b = self.buffers
        return (
            b["tokens"][:size],
            b["positions"][:size],
            b["slots"][:size],
            b["tables"][:size],
            b["idx"][:size],
        )

    def prepare(self, requests: Sequence[Request], rows: Sequence[int], size: int) -> None:
        n = len(requests)
        values = {
            "tokens": [r.tokens[0] for r in requests],
            "positions": [r.context_len for r in requests],
            "slots": [_slot(r, r.context_len) for r in requests],
            "tables": [_table(r) for r in requests],
            "idx": list(rows),
        }
        pads = {
            "tokens": 0,
            "positions": 0,
            "slots": NULL_SLOT,
            "tables": SPEC.null_block,
            "idx": self.PAD_ROW,
        }
        for name, vals in values.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(vals, dtype=buf.dtype))
            buf[n:size].fill_(pads[name])

    def replay(self, batch: Batch, rows: list[int]) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch.requests, rows, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager ------------------------------------------------------------------------------------

    def run_eager(self, batch: Batch, rows: list[int], reason: str) -> StepResult:
        dev = self.device
        if batch.phase == "decode" and batch.query_lens[0] == 1:
            reqs = batch.requests
            args = [
                torch.tensor(v, dtype=torch.int64, device=dev)
                for v in (
                    [r.tokens[0] for r in reqs],
                    [r.context_len for r in reqs],
                    [_slot(r, r.context_len) for r in reqs],
                    [_table(r) for r in reqs],
                    rows,
                )
            ]
            logits, tokens = self.decode_step(*args)
            return StepResult(logits, tokens, "eager", None, reason=reason)
        toks, pos, slots, tables, last, out_rows, out_toks = [], [], [], [], [], [], []
        for r, row in zip(batch.requests, rows, strict=True):
            if _is_output(r):
                out_rows.append(row)
                out_toks.append(r.tokens[0])
            else:  # prompt tokens counted at prefill
                self.prompt_mask[row, torch.tensor(list(r.tokens), device=dev)] = True
            for i, t in enumerate(r.tokens):
                toks.append(t)
                pos.append(r.context_len + i)
                slots.append(_slot(r, r.context_len + i))
                tables.append(_table(r))
            last.append(len(toks) - 1)
        if out_rows:
            self.out_counts.index_put_(
                (torch.tensor(out_rows, device=dev), torch.tensor(out_toks, device=dev)),
                self.ones[: len(out_rows)],
                accumulate=True,
            )

        def t(v: list[Any]) -> Tensor:
            return torch.tensor(v, dtype=torch.int64, device=dev)

        positions = t(pos)
        last_t = t(last)
        logits = self.model.forward(
            t(toks),
            positions,
            t(slots),
            t(tables).view(-1, SPEC.max_blocks_per_req),
            last_t,
            self.k_cache,
            self.v_cache,
        )
        logits, tokens = self.sample(logits, t(rows), positions[last_t])
        return StepResult(logits, tokens, "eager", None, reason=reason)

    # -- contract ---------------------------------------------------------------------------------

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
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            return StepResult(
                torch.zeros(0, V, device=self.device),
                torch.zeros(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason="empty batch",
            )
        rows = self.admit(batch)
        reason = self.fallback_reason(batch)
        result = self.replay(batch, rows) if reason is None else self.run_eager(batch, rows, reason)
        self.record_history(batch)
        return result

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def _is_output(r: Request) -> bool:
    """A one-token step on a cached sequence feeds the token the request generated last."""
    return r.context_len > 0 and r.query_len == 1


def _slot(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


class BuggyPenaltyRunner(PenaltyRunner):
    PAD_ROW = 0  # padding positions map to row 0: their dummy token lands in row 0's counts


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PenaltyRunner:
    return PenaltyRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PenaltyRunner:
    return BuggyPenaltyRunner(mode, seed=seed, backend=backend)
