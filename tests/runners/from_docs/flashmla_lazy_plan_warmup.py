"""A DeepSeek-style MLA decode runner with a FlashMLA-shaped split-KV kernel whose tile schedule
is planned lazily, with one real bug.

The mechanism (FlashMLA's decode API as vLLM's Model Runner V2 drives it under FULL CUDA graphs):
attention is MQA over a compressed latent cache (the absorbed MLA decode: every head's query
scores the latent, and the probabilities reduce the latent). The kernel is split-KV: each row's
context is cut into kernel blocks of `BLOCK_N` positions, and a fixed grid of `NUM_SM_PARTS`
"SM parts" shares all rows' blocks. The work partition (tile scheduler metadata) is planned
from the rows' sequence lengths: part p covers a contiguous run of the concatenated blocks,
from (begin_req, begin_block) to (end_req, end_block), and `num_splits` holds the cumulative
count of partial results of every row (as FlashMLA's `get_mla_metadata` does). As in FlashMLA,
a part visits a row that it neither begins nor ends up to the row's LIVE length (read from the
sequence-length buffer), while the row it ends is cut at the planned `end_block`. Each part
writes one partial (output and log-sum-exp) per row it visits into a workspace slot
`num_splits[row] + split`, and a combine step merges each row's slots by LSE.

The plan is lazy: a `FlashMLASchedMeta`-like object starts empty, and the attention op plans
into it on its first call (FlashMLA's `tile_scheduler_metadata is None` branch) and reuses the
plan on later calls. An eager step makes a fresh object, so it plans for its own rows. Graph
mode captures one decode graph per padded request count (1, 2, 4, 8), largest first, into one
pool, after one eager warm-up run on the same, all-padding inputs (padding rows: sequence length
0, the null block), and keeps each graph's sched object. A replay writes the batch into the
static buffers and replays; if the planning ran inside the capture, every replay plans again
from the live lengths. Everything that is not a batch of one-token rows fitting a graph runs
eagerly (every query token a kernel row, fresh plan), as does the eager twin. The model is one
layer: token and learned position embeddings, RMS norm, latent projection stored per token in
a slot-major paged cache, the split-KV MLA attention, an output projection, LM head; sampling is
Gumbel-max with noise hashed from (seed, position, token id), after the graph.

The bug (`plan_in_warmup=True`): vllm-project/vllm PR #42444, "[Model Runner V2][Bug Fix][DSV4]
Ensure lazy attention state initializations happen during cudagraph capture"
(https://github.com/vllm-project/vllm/pull/42444). `CudaGraphManager.capture()` ran a warm-up
forward before the capture, and both used the same FlashMLASchedMeta objects: the warm-up found
the schedule empty and planned it (with the dummy lengths), so the capture took the reuse branch
and recorded only the attention and combine kernels; the planning kernel never ran again, and
every replay used the warm-up's partition. DeepSeek V4 Flash produced gibberish or repetition
under full graphs. Here the warm-up plan gives each row one block: every row that ends a part
(with 1, 2 or 4 rows, every row; with 8 rows, every second one) is cut to its first `BLOCK_N`
positions once its context is longer, while the rows a part passes through still attend to
their whole context, so only some rows of some batch sizes go wrong, and only past `BLOCK_N`
tokens. The fix (`plan_in_warmup=False`) empties the sched objects after the warm-up, so the
planning happens inside the capture and is part of every replay.
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
    num_blocks=48,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, LATENT = 32, 2, 16
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
BLOCK_N = 8  # kernel block, in positions (FlashMLA's is 64 over 64-token pages)
NUM_SM_PARTS = 4
NULL_SLOT = SPEC.null_block * SPEC.block_size
_M32 = 0xFFFFFFFF


class SchedMeta:
    """Lazily filled tile-scheduler metadata: `plan` [parts, 5] and cumulative `num_splits`."""

    def __init__(self) -> None:
        self.plan: Tensor | None = None
        self.num_splits: Tensor | None = None

    def reset(self) -> None:
        self.plan = self.num_splits = None


def plan_tiles(seq_lens: Tensor) -> tuple[Tensor, Tensor]:
    """The work partition of all rows' kernel blocks over NUM_SM_PARTS parts, on the device.

    A row with no tokens (padding) still counts one block, as FlashMLA's planner does."""
    rows = seq_lens.shape[0]
    nblocks = (seq_lens.clamp(min=1) + BLOCK_N - 1) // BLOCK_N
    ends = torch.cumsum(nblocks, 0)
    starts = ends - nblocks
    total = ends[-1]
    chunk = (total + NUM_SM_PARTS - 1) // NUM_SM_PARTS
    part = torch.arange(NUM_SM_PARTS, device=seq_lens.device)
    first = part * chunk
    last = torch.minimum(first + chunk, total) - 1
    has_work = first < total
    begin_req = torch.searchsorted(ends, first, right=True).clamp(max=rows - 1)
    end_req = torch.searchsorted(ends, last.clamp(min=0), right=True).clamp(max=rows - 1)
    begin_block = first - starts[begin_req]
    end_block = last - starts[end_req] + 1
    first_part_of_row = starts // chunk
    begin_split = part - first_part_of_row[begin_req]
    splits = (ends - 1) // chunk - first_part_of_row + 1
    num_splits = torch.cat((torch.zeros(1, dtype=splits.dtype, device=splits.device), splits))
    # a part with no work begins past the last row, which the kernel skips
    begin_req = torch.where(has_work, begin_req, torch.full_like(begin_req, rows))
    plan = torch.stack((begin_req, begin_block, end_req, end_block, begin_split), 1)
    return plan, torch.cumsum(num_splits, 0)


def split_kv_mla(q: Tensor, cache: Tensor, tables: Tensor, seq_lens: Tensor, sched: SchedMeta):
    """Absorbed-MLA decode over the latent cache: q [rows, heads, latent] -> same shape."""
    if sched.plan is None:  # the lazy branch: plan on the first call only
        sched.plan, sched.num_splits = plan_tiles(seq_lens)
    plan, num_splits = sched.plan, sched.num_splits
    assert num_splits is not None
    dev, rows = q.device, q.shape[0]
    pos = torch.arange(MAX_POS, device=dev)
    slots = tables[:, pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size
    in_seq = pos[None, :] < seq_lens[:, None]
    keys = torch.where(in_seq[..., None], cache[slots], torch.zeros((), device=dev))
    scores = torch.einsum("rhl,rml->rhm", q, keys) / math.sqrt(LATENT)
    # which part visits which (row, position): FlashMLA's begin/end semantics per part
    row = torch.arange(rows, device=dev)[None, :, None]
    blk = (pos // BLOCK_N)[None, None, :]
    br, bb, er, eb, bs = (plan[:, i, None, None] for i in range(5))
    after_begin = (row > br) | ((row == br) & (blk >= bb))
    before_end = (row < er) | ((row == er) & (blk < eb))
    cover = after_begin & before_end & (br < rows) & in_seq[None]  # [parts, rows, pos]
    masked = torch.where(cover[:, :, None, :], scores[None], torch.full((), -math.inf, device=dev))
    peak = masked.amax(-1)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros((), device=dev))
    weights = torch.exp(masked - peak[..., None])
    denom = weights.sum(-1)
    part_out = torch.einsum("prhm,rml->prhl", weights, keys) / denom.clamp(min=1e-30)[..., None]
    part_lse = torch.where(denom > 0, peak + denom.clamp(min=1e-30).log(), -math.inf)
    # partials go to workspace slot num_splits[row] + split; unvisited pairs to a trash slot
    width = rows + NUM_SM_PARTS + 1
    split = torch.where(row[..., 0] == br[..., 0], bs[..., 0], 0)
    ws_slot = (num_splits[:-1][None, :] + split).clamp(max=width - 2)
    ws_slot = torch.where(cover.any(-1), ws_slot, width - 1).flatten()
    ws_out = torch.zeros(width, HEADS, LATENT, device=dev)
    ws_lse = torch.full((width, HEADS), -math.inf, device=dev)
    ws_out.index_put_((ws_slot,), part_out.reshape(-1, HEADS, LATENT))
    ws_lse.index_put_((ws_slot,), part_lse.reshape(-1, HEADS))
    # combine: merge each row's slots [num_splits[r], num_splits[r + 1]) by LSE
    k = torch.arange(NUM_SM_PARTS + 1, device=dev)
    gather = (num_splits[:-1, None] + k).clamp(max=width - 1)
    valid = k[None, :] < (num_splits[1:] - num_splits[:-1])[:, None]
    lse = torch.where(valid[..., None], ws_lse[gather], -math.inf)  # [rows, k, heads]
    top = lse.amax(1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros((), device=dev))
    scale = torch.where(valid[..., None], torch.exp(lse - top), 0.0)
    merged = (scale[..., None] * ws_out[gather]).sum(1)
    return merged / scale.sum(1).clamp(min=1e-30)[..., None]


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (((x >> 16) ^ x) * 0x45D9F3B) & _M32


def sample(logits: Tensor, reqs: Sequence[Request]) -> Tensor:
    """Gumbel-max from a hash of (seed, position of the last query token, token id)."""
    dev = logits.device
    seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], device=dev)
    pos = torch.tensor([r.seq_len - 1 for r in reqs], device=dev)
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    sampled = torch.tensor([r.seed is not None for r in reqs], device=dev)
    ids = torch.arange(logits.shape[-1], device=dev)
    bits = _mix(_mix(seeds ^ (pos * 0x9E3779B1 & _M32))[:, None] ^ (ids * 0x85EBCA6B & _M32))
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class FlashMLALazyPlanRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, plan_in_warmup: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.plan_in_warmup = SPEC, mode, plan_in_warmup
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_POS, HIDDEN),
            "w_kv": (HIDDEN, LATENT),
            "w_q": (HIDDEN, HEADS * LATENT),
            "w_o": (HEADS * LATENT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {name: torch.empty(shape, device=dev) for name, shape in shapes.items()}
        self.update_weights(seed)
        self.latent = torch.zeros(SPEC.num_slots, LATENT, device=dev)
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, tuple[Any, Tensor, SchedMeta]] = {}
        if mode == "graph":
            rows, pages = SPEC.capture_sizes[-1], SPEC.max_blocks_per_req
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=torch.int64, device=dev),
                "positions": torch.zeros(rows, dtype=torch.int64, device=dev),
                "slots": torch.zeros(rows, dtype=torch.int64, device=dev),
                "tables": torch.zeros(rows, pages, dtype=torch.int64, device=dev),
                "seq_lens": torch.zeros(rows, dtype=torch.int64, device=dev),
            }
            self.capture()

    def forward(self, tokens, positions, slots, tables, seq_lens, sched: SchedMeta) -> Tensor:
        w = self.w
        x = w["embed"][tokens] + w["pos"][positions]
        h = _norm(x)
        self.latent.index_copy_(0, slots, h @ w["w_kv"])  # store before attending
        q = (h @ w["w_q"]).view(-1, HEADS, LATENT)
        attn = split_kv_mla(q, self.latent, tables, seq_lens, sched)
        x = x + attn.flatten(1) @ w["w_o"]
        return _norm(x) @ w["head"]

    def static_inputs(self, size: int) -> list[Tensor]:
        names = ("tokens", "positions", "slots", "tables", "seq_lens")
        return [self.buffers[name][:size] for name in names]

    def prepare(self, reqs: Sequence[Request], size: int) -> None:
        """Write the batch into the prefix, padding sentinels into every other row."""
        buf, n, dev = self.buffers, len(reqs), self.device
        for name in buf:
            buf[name].zero_()  # padding: token 0, position 0, the null slot / block, length 0
        buf["slots"].fill_(NULL_SLOT)
        buf["tables"].fill_(SPEC.null_block)
        if n:
            table = [
                list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
                for r in reqs
            ]
            buf["tokens"][:n].copy_(torch.tensor([r.tokens[0] for r in reqs], device=dev))
            buf["positions"][:n].copy_(torch.tensor([r.context_len for r in reqs], device=dev))
            slots = [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs]
            buf["slots"][:n].copy_(torch.tensor(slots, device=dev))
            buf["tables"][:n].copy_(torch.tensor(table, device=dev))
            buf["seq_lens"][:n].copy_(torch.tensor([r.seq_len for r in reqs], device=dev))
        del size  # every row of the max-shape buffers is rewritten

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare((), size)
            sched = SchedMeta()  # kept with its graph, shared by warm-up and capture
            self.forward(*self.static_inputs(size), sched)  # warm-up outside the graph
            self.be.synchronize()
            if not self.plan_in_warmup:
                sched.reset()  # the fix: let the capture record the planning
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                logits = self.forward(*self.static_inputs(size), sched)
            self.graphs[size] = (graph, logits, sched)

    def step(self, batch: Batch) -> StepResult:
        reqs = batch.requests
        size = next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)
        if self.mode == "eager":
            return self.run_eager(reqs, "eager twin")
        if size is None:
            return self.run_eager(reqs, "more requests than the largest graph")
        if any(r.query_len != 1 for r in reqs):
            return self.run_eager(reqs, "a row with more than one query token")
        self.prepare(reqs, size)
        graph, out, _ = self.graphs[size]
        graph.replay()
        logits = out[: batch.num_reqs].clone()
        return StepResult(logits, sample(logits, reqs), "full", ("decode", size))

    def run_eager(self, reqs: Sequence[Request], reason: str) -> StepResult:
        """Every query token is a kernel row of its own, attending up to its own position."""
        dev, tok, pos, slots, tables, lens, last = self.device, [], [], [], [], [], []
        for r in reqs:
            table = list(r.block_ids) + [SPEC.null_block] * (
                SPEC.max_blocks_per_req - len(r.block_ids)
            )
            for i, t in enumerate(r.tokens):
                p = r.context_len + i
                tok.append(t)
                pos.append(p)
                slots.append(kv_slot(r.block_ids, p, SPEC.block_size))
                tables.append(table)
                lens.append(p + 1)
            last.append(len(tok) - 1)
        logits = self.forward(
            *(
                torch.tensor(v, dtype=torch.int64, device=dev)
                for v in (tok, pos, slots, tables, lens)
            ),
            SchedMeta(),  # a fresh object: this step plans for its own rows
        )[torch.tensor(last, device=dev)]
        return StepResult(logits, sample(logits, reqs), "eager", None, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"latent": self.latent}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):  # in place: the graphs read these tensors
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(t.device))

    def close(self) -> None:
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return FlashMLALazyPlanRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return FlashMLALazyPlanRunner(mode, seed=seed, backend=backend, plan_in_warmup=True)
