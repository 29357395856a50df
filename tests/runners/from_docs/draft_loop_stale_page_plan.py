"""A fused multi-step decode loop in one CUDA graph, whose per-sub-step attention metadata can go stale.

The engine mechanism modelled: vLLM's Model Runner V2 autoregressive speculator
(`vllm/v1/worker/gpu/spec_decode/.../speculator.py`) runs its draft decode steps as a loop of
single-token forwards captured together in one FULL CUDA graph. Attention metadata is built on
the host once, before the loop; between the captured sub-steps the graph itself advances what
changes with the position: positions (+1), sequence lengths (+1) and the slot mapping (looked up
in the device block table). Whatever else an attention backend derived from the positions on the
host (its "position-dependent state": a paged kernel's page list and page count, a sliding
window's first block, a split-KV schedule) has to be refreshed in place inside the loop too, or
every sub-step after the first reuses the plan built for the first.

How the contract expresses it. The harness, not the runner, proposes the drafts, and a
`StepResult` has no place for runner-made drafts, so the loop here is driven by the batch's own
tokens: a batch whose rows all have the same query length L (plain decode L = 1, a speculative
step of k drafts L = 1 + k, or equal-length prompts) replays a graph of L single-token sub-steps,
sub-step j feeding row r its j-th query token at position `context_len + j`. Each sub-step stores
its token's key and value in the token's slot, then attends over the request's cache up to its
position, which is exactly the causal attention the eager path computes for all query tokens at
once, so the logits at each request's last token are the eager ones. Graphs are captured lazily,
the first time a (padded rows, L) pair is needed, into one shared pool; padding rows point at the
null block. Uneven query lengths, more rows than the largest graph, or L above the loop's limit
run eagerly through the ordinary causal forward, as the eager twin always does.

The attention is a FlashInfer-style paged kernel: it reads the block-table columns
`[0, num_pages)` of each row, a page count the metadata builder plans on the host from the
sequence length (`cdiv(seq_len, block_size)`), and masks positions past the token's own with the
device sequence length. Sampling happens after the replay, Gumbel-max with noise hashed from
(seed, position of the last query token, token id).

The bug (`stale_page_plan=True`): vllm-project/vllm PR #41162, "[Model Runner V2] Rebuild attn
metadata between draft decode steps" (https://github.com/vllm-project/vllm/pull/41162), found
that during draft decoding only the sequence lengths, positions and slot mappings were advanced
between draft steps, not the metadata properties derived from them (DeepSeek-V4's sparse SWA
builder keeps such state), which crashed DeepSeek-V4 with more than two MTP tokens; that PR
rebuilt the metadata between steps and replayed a per-step graph, and PR #46849 ("[MRV2][Spec]
Fuse AR speculator multi-step decodes back into one CUDA graph",
https://github.com/vllm-project/vllm/pull/46849) fused the loop again, updating the
step-dependent metadata in place between draft steps (vLLM-Ascend's
https://github.com/vllm-project/vllm-ascend/pull/17206 is the same staleness on its eager draft
path, seen as lower acceptance). Here the buggy runner keeps the page count planned for sub-step 0
for the whole loop, while the device-side sequence lengths, positions and slots advance. Inside
one block nothing shows: the planned page already holds the later sub-steps' positions. A
sub-step whose position has crossed into the next block writes its key and value there (the slot
mapping is right) but its attention never reads that page, so it misses its own key and those of
the sub-steps before it in that block. Only speculative (or equal-length prompt) batches whose
query tokens straddle a block boundary are wrong, and only on the graph path. The fix recomputes
the page count from the advanced sequence length inside the graph before each sub-step's
attention. No engine code was copied.
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
    max_num_reqs=4,
    max_num_tokens=20,
    capture_sizes=(1, 2, 4),  # padded rows of a loop graph
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_LOOP = 5  # sub-steps one loop graph may run: a decode token plus up to 4 drafts
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
BS = SPEC.block_size
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
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: captured graphs keep reading these tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


class FusedLoopRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, stale_page_plan: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.stale_page_plan = SPEC, mode, stale_page_plan
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        # key positions of one gathered block-table row, and the column each one comes from
        self.key_pos = torch.arange(SPEC.max_blocks_per_req * BS, device=dev)
        self.key_col = self.key_pos // BS
        self.graphs: dict[tuple[int, int], Any] = {}
        self.graph_logits: dict[tuple[int, int], Tensor] = {}
        self.pool: Any = None
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows, cols = max(SPEC.capture_sizes), SPEC.max_blocks_per_req
            self.pool = self.be.graph_pool_handle()
            self.buffers = {  # max shape, rewritten row by row before every replay
                "tokens": torch.zeros(rows, MAX_LOOP, dtype=torch.int64, device=dev),
                "context_lens": torch.zeros(rows, dtype=torch.int64, device=dev),
                "block_table": torch.zeros(rows, cols, dtype=torch.int64, device=dev),
                # the metadata builder's page count, planned on the host for sub-step 0
                "planned_pages": torch.ones(rows, dtype=torch.int64, device=dev),
            }

    # -- the model ----------------------------------------------------------------------------------

    def attend(self, q: Tensor, tables: Tensor, pos: Tensor, pages: Tensor) -> Tensor:
        """Paged attention: one query per row over block-table columns [0, pages)."""
        slots = (tables[:, self.key_col] * BS + self.key_pos % BS).reshape(-1)
        keys = self.k_cache[slots].view(q.shape[0], -1, HEADS, HEAD_DIM)
        vals = self.v_cache[slots].view(q.shape[0], -1, HEADS, HEAD_DIM)
        visible = (self.key_pos[None, :] <= pos[:, None]) & (self.key_col[None, :] < pages[:, None])
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), -math.inf, device=q.device)
        )
        # where, not a multiply: unread slots (the null block) may hold NaN
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=q.device))
        return torch.einsum("thc,tchd->thd", scores.softmax(-1), vals).flatten(1)

    def layer(self, tokens: Tensor, pos: Tensor, slots: Tensor, tables: Tensor, pages: Tensor):
        """Store this token's key/value in its slot, then attend and project to logits."""
        w = self.w.t
        x = w["embed"][tokens] + w["pos"][pos]
        h = _norm(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, (h @ w["wk"]).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, (h @ w["wv"]).view(-1, HEADS, HEAD_DIM))
        x = x + self.attend(q, tables, pos, pages) @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        return _norm(x) @ w["head"]

    def fused_loop(self, rows: int, steps: int) -> Tensor:
        """What one loop graph runs: `steps` single-token sub-steps over `rows` padded rows."""
        buf = self.buffers
        tables = buf["block_table"][:rows]
        pos = buf["context_lens"][:rows].clone()  # advanced on the device, sub-step by sub-step
        pages = buf["planned_pages"][:rows]
        logits = torch.empty(0)
        for j in range(steps):
            slots = tables.gather(1, (pos // BS)[:, None])[:, 0] * BS + pos % BS
            if not self.stale_page_plan:
                # the in-place refresh of position-dependent metadata (vLLM PR #46849)
                pages = pos // BS + 1
            logits = self.layer(buf["tokens"][:rows, j], pos, slots, tables, pages)
            pos = pos + 1
        return logits

    # -- steps --------------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        if self.mode == "eager":
            return self.run_eager(batch, "eager twin")
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self.run_eager(batch, reason)
        return self.replay(batch)

    def fallback_reason(self, batch: Batch) -> str | None:
        lens = set(batch.query_lens)
        if len(lens) != 1:
            return "query lengths differ: no loop graph of one length"
        if lens.pop() > MAX_LOOP:
            return f"query length above the loop limit {MAX_LOOP}"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more rows than the largest loop graph"
        return None

    def replay(self, batch: Batch) -> StepResult:
        steps = batch.query_lens[0]
        rows = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        key = (rows, steps)
        if key not in self.graphs:
            self.capture(rows, steps)
        self.prepare(batch.requests)
        self.graphs[key].replay()
        logits = self.graph_logits[key][: batch.num_reqs].clone()
        return StepResult(
            logits, self.sample(logits, batch.requests), "full", ("fused_loop", rows, steps)
        )

    def prepare(self, reqs: Sequence[Request]) -> None:
        """Write the batch into the buffers' prefix and padding rows after it, every row."""
        rows, cols = self.buffers["tokens"].shape[0], SPEC.max_blocks_per_req
        tokens = [[0] * MAX_LOOP for _ in range(rows)]
        ctx = [0] * rows
        table = [[SPEC.null_block] * cols for _ in range(rows)]
        planned = [1] * rows  # a padding row reads the null block's one page
        for i, r in enumerate(reqs):
            tokens[i][: len(r.tokens)] = r.tokens
            ctx[i] = r.context_len
            table[i][: len(r.block_ids)] = r.block_ids
            planned[i] = r.context_len // BS + 1  # pages holding sub-step 0's sequence
        dev, buf = self.device, self.buffers
        buf["tokens"].copy_(torch.tensor(tokens, dtype=torch.int64, device=dev))
        buf["context_lens"].copy_(torch.tensor(ctx, dtype=torch.int64, device=dev))
        buf["block_table"].copy_(torch.tensor(table, dtype=torch.int64, device=dev))
        buf["planned_pages"].copy_(torch.tensor(planned, dtype=torch.int64, device=dev))

    def capture(self, rows: int, steps: int) -> None:
        self.prepare(())  # every row is padding during warm-up and capture: writes the null block
        self.fused_loop(rows, steps)  # warm-up outside the graph
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            logits = self.fused_loop(rows, steps)
        self.graphs[(rows, steps)] = graph
        self.graph_logits[(rows, steps)] = logits  # one per graph: it reads its own output

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        """All query tokens at once: store every key/value, then causal paged attention."""
        reqs, dev = batch.requests, self.device
        tok, pos, slots, tables, last = [], [], [], [], []
        for r in reqs:
            row = list(r.block_ids) + [SPEC.null_block] * (
                SPEC.max_blocks_per_req - len(r.block_ids)
            )
            for i, t in enumerate(r.tokens):
                p = r.context_len + i
                tok.append(t)
                pos.append(p)
                slots.append(kv_slot(r.block_ids, p, BS))
                tables.append(row)
            last.append(len(tok) - 1)
        w = self.w.t
        pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        tables_t = torch.tensor(tables, dtype=torch.int64, device=dev)
        x = w["embed"][torch.tensor(tok, dtype=torch.int64, device=dev)] + w["pos"][pos_t]
        h = _norm(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots_t, (h @ w["wk"]).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots_t, (h @ w["wv"]).view(-1, HEADS, HEAD_DIM))
        x = x + self.attend(q, tables_t, pos_t, pos_t // BS + 1) @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        x = x[torch.tensor(last, dtype=torch.int64, device=dev)]
        logits = _norm(x) @ w["head"]
        return StepResult(logits, self.sample(logits, reqs), "eager", None, reason)

    def sample(self, logits: Tensor, reqs: Sequence[Request]) -> Tensor:
        """Gumbel-max with noise from (seed, last query position, token id); greedy: argmax."""
        dev = self.device
        seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], device=dev)
        positions = torch.tensor([r.seq_len - 1 for r in reqs], device=dev)
        temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
        sampled = torch.tensor([r.seed is not None for r in reqs], device=dev)
        key = _mix(_mix(seeds) ^ ((positions * 0x9E3779B1) & _M32))
        ids = torch.arange(logits.shape[-1], device=dev)
        bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
        uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
        return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))

    # -- contract -----------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

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
        self.graph_logits.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> FusedLoopRunner:
    return FusedLoopRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> FusedLoopRunner:
    return FusedLoopRunner(mode, seed=seed, backend=backend, stale_page_plan=True)
