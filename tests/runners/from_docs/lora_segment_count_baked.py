"""Multi-LoRA decode graphs with SGLang's chunked-SGMV (csgmv) segment layout, with one real bug.

What it models (own code, written against the contract and the backend facade): SGLang's default
LoRA backend, `ChunkedSgmvLoRABackend`. Before every forward the host sorts the batch's rows by
adapter (a stable argsort: `permutation`), cuts each adapter's run of rows into segments of at
most `SEGMENT_SIZE` rows, and uploads three small tables: the permutation, `seg_indptr` (where each
segment starts and ends in sorted order) and `seg_weight` (the adapter of each segment). The LoRA
kernels launch one program per segment; a program gathers its rows through the permutation, runs
shrink (x @ A) and expand (@ B, times the adapter's scaling) with its segment's adapter, and adds
the delta to the base projection of those rows. Adapter 0 is the base model: an all-zero stack
entry, the rank-0 slot whose programs add nothing. Here LoRA sits on the fused qkv projection of
a one-layer decoder (token + learned position embedding, attention over a slot-major paged KV
cache through block tables, SiLU MLP, LM head), float32; sampling runs after the forward from a
hash of (seed, position, token id).

Graph mode captures one decode graph per capture size at start-up, largest first, into one shared
pool. As in SGLang's `CudaGraphRunner`, the capture batch is all dummy rows without an adapter, so
its segment table is ceil(size / SEGMENT_SIZE) base segments. A decode batch (one query token per
request) of at most the largest size pads its rows up to the next size and replays; the LoRA
tables are rebuilt on the host from the real rows and copied into the graph's static buffers.
Prefill, mixed and oversize batches run eagerly, with a segment loop as long as the batch has
segments.

The bug (`make_buggy_target`, `segment_count_baked=True`): sgl-project/sglang PR #28371, "[LoRA]
Fix chunked SGMV (csgmv) CUDA graph segment replay"
(https://github.com/sgl-project/sglang/pull/28371; cherry-picked to the RL branch as #28499 and
again as #29872). The csgmv kernels took the number of segments as a host scalar,
`batch_info.num_segments`, which a CUDA graph freezes at its capture value, and the replay path
wrote only the first `num_segments` entries of the segment tables. A replay therefore runs as many
segment programs as the dummy capture batch had: a batch with more segments (more distinct
adapters than the capture batch, or longer runs) silently loses the LoRA delta of its last
segments, i.e. its highest adapter ids; a batch with fewer runs the tail programs over whatever
segment tables an earlier, larger batch left there, adding a stale adapter's delta to rows that
are live now. Single-adapter batches and eager steps are right, so it shows only for some batch
compositions on some graph sizes. The fix launches a capture-invariant number of programs (the
static table size) and neutralises the tail every step (tail segments zero-length on the base
adapter); `make_target` does that.

Each segment program is modelled densely (it looks at every sorted position of the graph) but
loads through a mask, as the Triton kernel does: a position outside its segment indexes nothing, so
a stale permutation entry matters only where a stale segment covers it.

Scaled down: SGLang's segment size is 16 rows beside capture sizes up to 512; here it is 2 rows
beside capture sizes 1, 2, 4 and 8, so graph 8 freezes 4 segment programs and graph 4 freezes 2.
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
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "adapters", "weight_update"}),
    num_adapters=3,
)
HIDDEN, HEADS, HEAD_DIM, RANK = 32, 2, 16, 4
SEGMENT_SIZE = 2  # rows per csgmv segment (SGLang: 16)
MAX_LEN = SPEC.max_blocks_per_req * SPEC.block_size
MAX_ROWS = max(SPEC.capture_sizes)
MAX_SEGMENTS = MAX_ROWS  # a segment holds at least one row
ADAPTER_SCALING = (0.0, 1.0, 0.5, 2.0)  # lora_alpha / rank per stack slot; slot 0 = base
_M32 = 0xFFFFFFFF


class Weights:
    """Base weights and the LoRA stack, loaded in place so captured graphs see every reload."""

    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_LEN, HIDDEN),
            "wqkv": (HIDDEN, 3 * HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            "lora_a": (SPEC.num_adapters + 1, HIDDEN, RANK),
            "lora_b": (SPEC.num_adapters + 1, RANK, 3 * HIDDEN),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.scaling = torch.tensor(ADAPTER_SCALING, device=device)
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):
            w = self.t[name]
            fan_in = w.shape[-2]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(fan_in)).to(w.device))
        # The base model is the rank-0 stack slot: its programs add an exact zero.
        self.t["lora_a"][0].zero_()
        self.t["lora_b"][0].zero_()


@dataclass
class Segments:
    """The csgmv tables of one forward, built on the host."""

    permutation: list[int]  # sorted position -> row
    seg_indptr: list[int]  # len num_segments + 1, in sorted positions
    seg_weight: list[int]  # adapter (stack slot) of each segment

    @property
    def num_segments(self) -> int:
        return len(self.seg_weight)


def build_segments(row_adapters: Sequence[int]) -> Segments:
    order = sorted(range(len(row_adapters)), key=lambda i: row_adapters[i])  # stable
    indptr, weight = [0], []
    start = 0
    while start < len(order):
        adapter = row_adapters[order[start]]
        end = start
        while end < len(order) and row_adapters[order[end]] == adapter:
            end += 1
        for seg_start in range(start, end, SEGMENT_SIZE):  # cut the run into chunks
            weight.append(adapter)
            indptr.append(min(seg_start + SEGMENT_SIZE, end))
        start = end
    return Segments(order, indptr, weight)


def segmented_lora(
    x: Tensor,
    base: Tensor,
    w: Weights,
    permutation: Tensor,
    seg_indptr: Tensor,
    seg_weight: Tensor,
    num_programs: int,
) -> Tensor:
    """`base` plus each row's LoRA delta: one loop iteration per launched segment program.

    Program s reads its bounds and adapter from the device tables, so the tables may change
    between replays; how many programs run is a host int, fixed in a graph once captured.
    """
    sorted_pos = torch.arange(permutation.shape[0], device=x.device)
    zero = torch.zeros((), device=x.device)
    out = base.clone()
    for s in range(num_programs):
        in_segment = (sorted_pos >= seg_indptr[s]) & (sorted_pos < seg_indptr[s + 1])
        # a masked load, as the kernel's: positions outside the segment never index anything
        rows = torch.where(in_segment, permutation, torch.zeros_like(permutation))
        adapter = seg_weight[s : s + 1]
        a = w.t["lora_a"].index_select(0, adapter)[0]
        b = w.t["lora_b"].index_select(0, adapter)[0]
        delta = (x.index_select(0, rows) @ a) @ b * w.scaling.index_select(0, adapter)
        out.index_add_(0, rows, torch.where(in_segment[:, None], delta, zero))
    return out


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def sample(logits: Tensor, reqs: Sequence[Request]) -> Tensor:
    """Gumbel-max from a hash of (seed, position, token id): no state, no generator."""
    dev = logits.device
    seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], device=dev)
    positions = torch.tensor([r.seq_len - 1 for r in reqs], device=dev)
    sampled = torch.tensor([r.seed is not None for r in reqs], dtype=torch.bool, device=dev)
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    key = _mix(_mix(seeds) ^ ((positions * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=dev)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class CsgmvLoraRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, segment_count_baked: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        self.segment_count_baked = segment_count_baked
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.graph_logits: dict[int, Tensor] = {}
        # LoRABatchInfo.num_segments: a host attribute rewritten by every prepare
        self.num_segments = 0
        if mode == "graph":
            i64 = dict(dtype=torch.int64, device=dev)
            self.buffers = {
                "tokens": torch.zeros(MAX_ROWS, **i64),
                "positions": torch.zeros(MAX_ROWS, **i64),
                "slots": torch.zeros(MAX_ROWS, **i64),
                "tables": torch.zeros(MAX_ROWS, SPEC.max_blocks_per_req, **i64),
                "permutation": torch.zeros(MAX_ROWS, **i64),
                "seg_indptr": torch.zeros(MAX_SEGMENTS + 1, **i64),
                "seg_weight": torch.zeros(MAX_SEGMENTS, **i64),
            }
            self.capture()

    # -- the model ----------------------------------------------------------------------------

    def forward(self, tokens, positions, slots, tables, lora: tuple, num_programs: int) -> Tensor:
        """Hidden states -> logits for every row; rows are tokens, each with its own table."""
        w = self.w.t
        x = w["embed"][tokens] + w["pos"][positions]
        h = _norm(x)
        qkv = segmented_lora(h, h @ w["wqkv"], self.w, *lora, num_programs)
        q, k, v = (t.reshape(-1, HEADS, HEAD_DIM) for t in qkv.split(HIDDEN, dim=-1))
        # store this step's keys and values first: a token attends to itself through the cache
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        j = torch.arange(MAX_LEN, device=x.device)
        ctx_slots = tables[:, j // SPEC.block_size] * SPEC.block_size + j % SPEC.block_size
        visible = j[None, :] <= positions[:, None]  # [rows, MAX_LEN]
        keys, vals = self.k_cache[ctx_slots], self.v_cache[ctx_slots]  # [rows, L, H, D]
        zero = torch.zeros((), device=x.device)
        # where, not a multiply: slots outside the request's context may hold NaN
        keys = torch.where(visible[:, :, None, None], keys, zero)
        vals = torch.where(visible[:, :, None, None], vals, zero)
        scores = torch.einsum("rhd,rlhd->rhl", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), -math.inf, device=x.device)
        )
        attn = torch.einsum("rhl,rlhd->rhd", scores.softmax(-1), vals).reshape(-1, HIDDEN)
        x = x + attn @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        return _norm(x) @ w["head"]

    # -- graph mode ---------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            # SGLang captures with dummy rows that name no adapter: all base, one run of rows
            self.prepare(Batch(()), size)
            self.run_graph_forward(size)  # warm-up outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.graph_logits[size] = self.run_graph_forward(size)
            self.graphs[size] = graph

    def run_graph_forward(self, size: int) -> Tensor:
        buf = self.buffers
        lora = (buf["permutation"][:size], buf["seg_indptr"], buf["seg_weight"])
        # Before PR #28371 the launch took this batch's host count, which a capture freezes;
        # the fix launches as many programs as this graph can ever need.
        programs = self.num_segments if self.segment_count_baked else size
        return self.forward(
            buf["tokens"][:size],
            buf["positions"][:size],
            buf["slots"][:size],
            buf["tables"][:size],
            lora,
            programs,
        )

    def prepare(self, batch: Batch, size: int) -> None:
        """Write the batch into the static buffers' prefix and every padding row after it."""
        reqs, n, buf = batch.requests, batch.num_reqs, self.buffers
        null_table = [SPEC.null_block] * SPEC.max_blocks_per_req
        tokens = [r.tokens[0] for r in reqs] + [0] * (MAX_ROWS - n)
        positions = [r.context_len for r in reqs] + [0] * (MAX_ROWS - n)
        slots = [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs]
        slots += [SPEC.null_block * SPEC.block_size] * (MAX_ROWS - n)
        tables = [list(r.block_ids) + null_table[len(r.block_ids) :] for r in reqs]
        tables += [null_table] * (MAX_ROWS - n)
        for name, values in (
            ("tokens", tokens),
            ("positions", positions),
            ("slots", slots),
            ("tables", tables),
        ):
            buf[name].copy_(torch.tensor(values, dtype=torch.int64))
        # LoRA tables from the real rows only; the capture batch is `size` dummy base rows
        adapters = [r.adapter for r in reqs] if n else [0] * size
        seg = build_segments(adapters)
        self.num_segments = seg.num_segments
        rows, k = len(adapters), seg.num_segments
        if self.segment_count_baked:
            # before the fix: only the live prefix of each table is written
            buf["permutation"][:rows].copy_(torch.tensor(seg.permutation, dtype=torch.int64))
            buf["seg_indptr"][: k + 1].copy_(torch.tensor(seg.seg_indptr, dtype=torch.int64))
            buf["seg_weight"][:k].copy_(torch.tensor(seg.seg_weight, dtype=torch.int64))
            return
        # the fix: tail segments are empty ranges on the base adapter, and padding rows map to
        # themselves, so programs past the batch's segments add nothing
        permutation = seg.permutation + list(range(rows, MAX_ROWS))
        indptr = seg.seg_indptr + [rows] * (MAX_SEGMENTS - k)
        weight = seg.seg_weight + [0] * (MAX_SEGMENTS - k)
        buf["permutation"].copy_(torch.tensor(permutation, dtype=torch.int64))
        buf["seg_indptr"].copy_(torch.tensor(indptr, dtype=torch.int64))
        buf["seg_weight"].copy_(torch.tensor(weight, dtype=torch.int64))

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if any(len(r.tokens) != 1 for r in batch.requests):
            return "not a decode batch"
        if batch.num_reqs > MAX_ROWS:
            return "more rows than the largest graph"
        return None

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self.run_eager(batch, reason)
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits = self.graph_logits[size][: batch.num_reqs].clone()
        return StepResult(logits, sample(logits, batch.requests), "full", ("decode", size))

    # -- eager mode ---------------------------------------------------------------------------

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        reqs, dev = batch.requests, self.device
        tokens, positions, slots, tables, adapters, last = [], [], [], [], [], []
        null_table = [SPEC.null_block] * SPEC.max_blocks_per_req
        for r in reqs:
            table = list(r.block_ids) + null_table[len(r.block_ids) :]
            for i, tok in enumerate(r.tokens):
                pos = r.context_len + i
                tokens.append(tok)
                positions.append(pos)
                slots.append(kv_slot(r.block_ids, pos, SPEC.block_size))
                tables.append(table)
                adapters.append(r.adapter)  # every token of a request is on its adapter
            last.append(len(tokens) - 1)
        seg = build_segments(adapters)
        self.num_segments = seg.num_segments

        def as_tensor(values: list) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=dev)

        lora = (as_tensor(seg.permutation), as_tensor(seg.seg_indptr), as_tensor(seg.seg_weight))
        logits = self.forward(
            as_tensor(tokens),
            as_tensor(positions),
            as_tensor(slots),
            as_tensor(tables),
            lora,
            seg.num_segments,  # eagerly the host count is this batch's own
        )
        logits = logits.index_select(0, as_tensor(last))
        return StepResult(logits, sample(logits, reqs), "eager", None, reason)

    # -- contract -----------------------------------------------------------------------------

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> CsgmvLoraRunner:
    return CsgmvLoraRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CsgmvLoraRunner:
    return CsgmvLoraRunner(mode, seed=seed, backend=backend, segment_count_baked=True)
