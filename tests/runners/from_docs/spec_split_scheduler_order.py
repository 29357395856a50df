"""A runner shaped like vLLM's v1 GPU model runner, with vLLM's verify-split ordering bug on a flag.

The runner (written against the backend facade only):

- a **persistent batch**: each request keeps a row while it is scheduled; rows of requests that
  are not scheduled are emptied, new and resumed requests fill the lowest empty rows, and the
  batch is then condensed (the last rows move into the holes). So the row order is generally not
  the order in which the batch (the scheduler) lists the requests; every host input is laid out
  in row order and the results are gathered back into the batch's order at the end. Per-row
  values (seed, temperature, computed-token count, block-table row) live in the rows and move
  with them; a block-table row is extended by the new blocks of a continuing request and
  rewritten for a new or resumed one (checked against the batch, as the contract asks).
- **CUDA-graph dispatch by padded size**: a step whose rows all have one query token and fit the
  largest capture size replays the FULL graph of the smallest capture size that holds it, its
  padding rows pointing at the null block; every other step runs eagerly.
- **asynchronous scheduling**: inputs are staged in pinned host buffers and uploaded with
  non-blocking copies; `step()` returns with its work still queued, the next step's host
  preparation waits only for the last upload to have read the staging buffers.
- **speculative verification**: a request in its decode phase with more than one query token
  carries drafts and is verified, as vLLM's rejection sampler does: every one of its query
  positions is a sample position, a request without drafts (a prompt or prompt chunk, a plain
  decode) contributes its last position only, and the flat verification logits are split into
  per-request slices by those counts. A request's result is the last position of its slice (the
  harness does acceptance itself). vLLM tells drafts from a prompt chunk by the scheduler's draft
  lists; the contract does not say, so a request counts as decoding once it has run a step of
  one query token in its current life (a one-token prompt or a plain decode step).

The bug (`split_in_scheduler_order=True`, `make_buggy_target`): vLLM PR #14645
(https://github.com/vllm-project/vllm/pull/14645, "[V1][Bugfix][Spec Decode] Fix incorrect
outputs in V1 speculative decoding due to batch indexing", opened 2025-03-11, merged). vLLM's v1
runner lays its inputs out in persistent-batch order (`input_batch.req_ids`), but the speculative
path built the per-request draft lists, and so the lengths that split the target probabilities, by
iterating `scheduler_output.num_scheduled_tokens` (the scheduler's order). Whenever the two
orders differ and the requests' draft counts differ, each request's slice is cut at the wrong
place and it reads another request's (or another position's) probabilities: tokens "leaked"
between completions, no error. Here the per-request sample counts are taken in the batch's order
while the sample positions are in row order, so a row's result is read from a neighbour's
position. Graph and eager twins share the persistent batch and so the bug; it only shows where
the same request runs in other company (the harness's company twins) or the orders line up.
No vLLM code is copied here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
BS, MB, NULL = SPEC.block_size, SPEC.max_blocks_per_req, SPEC.null_block
CONTEXT = MB * BS
NULL_SLOT = NULL * BS
ROWS = max(SPEC.max_num_reqs, SPEC.capture_sizes[-1])
TOKENS = SPEC.max_num_tokens
M32 = 0xFFFFFFFF

# name: (shape, dtype); token-indexed fields have TOKENS entries, row-indexed ones ROWS.
FIELDS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "tokens": ((TOKENS,), torch.int64),
    "positions": ((TOKENS,), torch.int64),
    "slots": ((TOKENS,), torch.int64),
    "token_rows": ((TOKENS,), torch.int64),  # the row each token belongs to
    "sample_positions": ((TOKENS,), torch.int64),  # flat token index of each sample position
    "tables": ((ROWS, MB), torch.int64),
    "split": ((ROWS,), torch.int64),  # per row: index of its result among the sample positions
    "order": ((ROWS,), torch.int64),  # per batch entry: its row
    "seeds": ((ROWS,), torch.int64),
    "temperatures": ((ROWS,), torch.float32),
    "sampled": ((ROWS,), torch.bool),
    "sample_pos": ((ROWS,), torch.int64),  # the position a row's sample is keyed by
}


def _hash(x: Tensor) -> Tensor:
    """32-bit integer mixer on int64 tensors (every product stays below 2**62)."""
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


class Model:
    """Embedding + learned positions, one attention layer over a slot-major paged cache, an MLP,
    an LM head, and a counter-based Gumbel-max sampler. No host reads: capturable."""

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN), "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN), "wk": (HIDDEN, HIDDEN), "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN), "up": (HIDDEN, 2 * HIDDEN), "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }  # fmt: skip
        self.device = device
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=device)
        self.v_cache = torch.zeros(shape, device=device)
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            shape = self.w[name].shape
            fresh = torch.randn(shape, generator=gen) / math.sqrt(shape[0])
            self.w[name].copy_(fresh.to(self.device))  # in place: graphs keep reading it

    def forward(self, f: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Logits and sampled tokens per row, in row order."""
        w, dev = self.w, self.device
        x = w["embed"][f["tokens"]] + w["pos"][f["positions"]]  # [T, H]
        h = _rms(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        self.k_cache.index_copy_(0, f["slots"], k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, f["slots"], v.view(-1, HEADS, HEAD_DIM))
        tables = f["tables"][f["token_rows"]]  # [T, MB]
        ctx = (tables[:, :, None] * BS + torch.arange(BS, device=dev)).flatten(1)  # [T, CONTEXT]
        keys, values = self.k_cache[ctx], self.v_cache[ctx]
        visible = torch.arange(CONTEXT, device=dev)[None, :] <= f["positions"][:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=dev))
        x = x + torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1) @ w["wo"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        verify = _rms(x[f["sample_positions"]]) @ w["head"]  # [S, V] every sample position
        logits = verify[f["split"]]  # [R, V] each row's slice, its last position
        return logits, self.sample(logits, f)

    def sample(self, logits: Tensor, f: Mapping[str, Tensor]) -> Tensor:
        key = _hash(_hash(f["seeds"]) ^ ((f["sample_pos"] * 0x9E3779B1) & M32))
        ids = torch.arange(logits.shape[-1], device=self.device)
        bits = _hash(key[:, None] ^ ((ids * 0x27D4EB2F) & M32)[None, :])
        uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24  # in (0, 1)
        noisy = logits / f["temperatures"][:, None] - torch.log(-torch.log(uniform))
        return torch.where(f["sampled"], noisy.argmax(-1), logits.argmax(-1))


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class PersistentBatch:
    """Rows of live requests, host side (vLLM's InputBatch, reduced to what this model needs)."""

    def __init__(self) -> None:
        self.req_ids: list[int | None] = [None] * ROWS
        self.index: dict[int, int] = {}
        self.computed = [0] * ROWS
        self.table = [[NULL] * MB for _ in range(ROWS)]
        self.num_blocks = [0] * ROWS
        self.seed, self.temp, self.sampled = [0] * ROWS, [1.0] * ROWS, [False] * ROWS
        # per request id: (context_len, seq_len, block_ids, decoding) as of its last step
        self.cached: dict[int, tuple[int, int, tuple[int, ...], bool]] = {}
        self.decoding: dict[int, bool] = {}  # this step: past its prompt before the step

    def remove(self, row: int) -> None:
        rid = self.req_ids[row]
        assert rid is not None
        del self.index[rid]
        self.req_ids[row] = None

    def add(self, row: int, r: Request) -> None:
        self.req_ids[row], self.index[r.req_id] = r.req_id, row
        self.computed[row] = r.context_len
        self.table[row] = list(r.block_ids) + [NULL] * (MB - len(r.block_ids))
        self.num_blocks[row] = len(r.block_ids)
        sampled = r.seed is not None
        self.seed[row] = (r.seed & M32) if r.seed is not None else 0
        self.temp[row] = r.temperature if sampled else 1.0
        self.sampled[row] = sampled

    def move(self, src: int, dst: int) -> None:
        rid = self.req_ids[src]
        assert rid is not None and self.req_ids[dst] is None
        self.computed[dst], self.num_blocks[dst] = self.computed[src], self.num_blocks[src]
        self.seed[dst], self.temp[dst] = self.seed[src], self.temp[src]
        self.sampled[dst], self.table[dst] = self.sampled[src], list(self.table[src])
        self.req_ids[dst] = rid
        self.req_ids[src], self.index[rid] = None, dst

    def update(self, batch: Batch) -> None:
        """vLLM's `_update_states`: drop unscheduled rows, advance continuing ones, add the rest
        to the lowest empty rows, condense."""
        live = {r.req_id for r in batch.requests}
        for i, rid in enumerate(self.req_ids):
            if rid is not None and rid not in live:
                self.remove(i)  # not scheduled this step: its row goes, its cached entry stays
        to_add: list[Request] = []
        for r in batch.requests:
            row: int | None = self.index.get(r.req_id)
            c = self.cached.get(r.req_id)
            continuing = (
                c is not None and c[0] < r.context_len <= c[1] and r.block_ids[: len(c[2])] == c[2]
            )
            if row is not None and not continuing:
                self.remove(row)  # a new life under a known id (preempted and back, next example)
                row = None
            if row is None:
                to_add.append(r)
            else:
                assert c is not None
                self.computed[row] = r.context_len
                old = len(c[2])
                self.table[row][old : len(r.block_ids)] = r.block_ids[old:]  # append new blocks
                self.num_blocks[row] = len(r.block_ids)
            decoding = continuing and c is not None and c[3]
            self.decoding[r.req_id] = decoding
            self.cached[r.req_id] = (r.context_len, r.seq_len, r.block_ids,
                                     decoding or len(r.tokens) == 1)  # fmt: skip
        for r in to_add:
            self.add(self.req_ids.index(None), r)  # the lowest empty row
        n = batch.num_reqs
        for hole in range(n):  # condense: the last rows move into the holes below n
            if self.req_ids[hole] is None:
                last = max(i for i, rid in enumerate(self.req_ids) if rid is not None)
                self.move(last, hole)


class VllmStyleRunner:
    """The target: `mode="graph"` captures decode graphs at start-up; `"eager"` never does."""

    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        split_in_scheduler_order: bool = False,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.bug = SPEC, mode, split_in_scheduler_order
        self.be: Any = get_backend(backend)
        device = self.be.device
        self.model = Model(seed, device)
        self.batch = PersistentBatch()
        self.host = {n: self.be.empty_pinned(s, dtype=d) for n, (s, d) in FIELDS.items()}
        self.dev = {n: torch.zeros(s, dtype=d, device=device) for n, (s, d) in FIELDS.items()}
        self.uploaded = self.be.Event()
        self.upload_pending = False
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self.capture()

    # -- staging ----------------------------------------------------------------------------

    def upload(self, values: Mapping[str, list[Any]]) -> dict[str, Tensor]:
        """Stage host values in pinned memory and queue their upload; the device slices."""
        if self.upload_pending:
            self.uploaded.synchronize()  # the last upload has read the staging buffers
        out = {}
        for name, vals in values.items():
            k = len(vals)
            if k:
                self.host[name][:k] = torch.tensor(vals, dtype=self.host[name].dtype)
                self.dev[name][:k].copy_(self.host[name][:k], non_blocking=True)
            out[name] = self.dev[name][:k]
        self.uploaded.record()
        self.upload_pending = True
        return out

    def prepare(self, batch: Batch, size: int | None) -> dict[str, Tensor]:
        """Host inputs in row order; `size`: pad the rows (one token each) to a graph's size."""
        pb, n = self.batch, batch.num_reqs
        by_id = {r.req_id: r for r in batch.requests}
        v: dict[str, list[Any]] = {name: [] for name in FIELDS}
        counts = []
        for row in range(n):
            rid = pb.req_ids[row]
            assert rid is not None
            r, start, ctx = by_id[rid], len(v["tokens"]), pb.computed[row]
            for j, token in enumerate(r.tokens):
                pos = ctx + j
                v["tokens"].append(token)
                v["positions"].append(pos)
                v["slots"].append(pb.table[row][pos // BS] * BS + pos % BS)
                v["token_rows"].append(row)
            q = len(r.tokens)
            verify = pb.decoding[rid] and q > 1  # it carries drafts: every position samples
            v["sample_positions"].extend(range(start, start + q) if verify else [start + q - 1])
            counts.append(q if verify else 1)
            v["tables"].append(pb.table[row])
            v["seeds"].append(pb.seed[row])
            v["temperatures"].append(pb.temp[row])
            v["sampled"].append(pb.sampled[row])
            v["sample_pos"].append(ctx + q - 1)
        if self.bug:  # PR #14645's bug: the slice lengths in the scheduler's order
            counts = [counts[pb.index[r.req_id]] for r in batch.requests]
        total = 0
        for c in counts:
            total += c
            v["split"].append(total - 1)
        v["order"] = [pb.index[r.req_id] for r in batch.requests]
        for i in range(n, size or n):  # padding rows: the null block, their own table row
            for name, pad in (("tokens", 0), ("positions", 0), ("slots", NULL_SLOT),
                              ("token_rows", i), ("sample_positions", i), ("tables", [NULL] * MB),
                              ("split", i), ("order", 0), ("seeds", 0), ("temperatures", 1.0),
                              ("sampled", False), ("sample_pos", 0)):  # fmt: skip
                v[name].append(pad)
        return self.upload(v)

    # -- graphs -----------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            inputs = self.prepare(Batch(()), size)  # all padding
            self.model.forward(inputs)  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self.model.forward(inputs)
            self.graphs[size] = graph

    def graph_size(self, batch: Batch) -> int | None:
        if self.mode != "graph" or not batch.requests or set(batch.query_lens) != {1}:
            return None
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    # -- the contract ----------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        if n == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.be.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64, device=self.be.device),
                              "eager", None, reason="empty batch")  # fmt: skip
        self.batch.update(batch)
        size = self.graph_size(batch)
        inputs = self.prepare(batch, size)
        order = inputs["order"][:n]
        if size is not None:
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            return StepResult(logits[order], tokens[order], "full", ("decode", size))
        logits, tokens = self.model.forward(inputs)
        reason = "eager twin" if self.mode == "eager" else "not a one-token batch a graph holds"
        return StepResult(logits[order], tokens[order], "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.model.k_cache, "v": self.model.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.dev if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> VllmStyleRunner:
    return VllmStyleRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> VllmStyleRunner:
    return VllmStyleRunner(mode, seed=seed, backend=backend, split_in_scheduler_order=True)
