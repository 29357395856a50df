"""A decode runner modelled on FlashInfer's split-KV scheduler under CUDA graphs, with one real bug.

The model: one decoder layer (GQA, 4 query heads over 2 KV heads) over a slot-major paged KV
cache. Decode batches whose requests all have one query token, up to the largest capture size,
replay a CUDA graph captured per padded batch size, as vLLM drives FlashInfer's tensor-core decode
(`BatchPrefillWithPagedKVCacheWrapper` scheduler, `use_cuda_graph=True`): before each replay the
host writes the page table (`kv_indptr`, `kv_indices`, `kv_last_page_len`) into fixed buffers,
padding rows getting zero pages, and `plan()` splits every row's KV into chunks of whole pages.
Each (row, KV chunk) pair is one work tile; the graph runs a fixed grid of tiles, one partial
softmax each, then merges the partials of every row (log-sum-exp). A captured kernel cannot change
its grid, so under graphs the grid is padded to `max(MAX_TILES_IF_SPLIT, rows)` (the SM count's
worth of CTAs per KV head, FlashInfer's `max_batch_size_if_split`) and tiles past the plan's count
are switched off by `block_valid_mask`. The plan picks the chunk size by binary search: the
smallest chunk (in pages) for which the tiles fit the grid; then it splits, giving every row at
least one tile (`max(kv_len, 1)`), an empty padding row too, and checks `new_batch_size <=
padded_batch_size`. Prefill, mixed batches and batches past the largest graph run eagerly, as does
the eager twin (dense attention over the request's slots).

The bug (`search_skips_empty_rows=True`): flashinfer-ai/flashinfer issue #726 ("Inconsistency
between binary search for kv chunk size and the actual splitting strategy",
https://github.com/flashinfer-ai/flashinfer/issues/726), reported from vLLM with CUDA graphs and
the FlashInfer backend, fixed by PR #728 ("Align KV chunk size binary search with actual KV chunk
splitting", https://github.com/flashinfer-ai/flashinfer/pull/728). The search counted a row with
no KV pages (a padding row of a padded graph batch) as zero tiles, while the split gives it one,
so when the valid rows' tiles fill the grid to within fewer slots than there are padding rows, the
plan holds more tiles than the captured grid and fails its check ("new batch size should not
exceed padded batch size"): the engine errors on that step. Only padded replays fail, and only for
contexts that make the search land close to the grid: a batch that fills its graph, or one whose
rows are short or long enough to leave room, replays fine. The fix counts every row as at least
one page in the search too (`max(kv_len, 1)`), as the split does.
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
    num_blocks=80,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, QO_HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8
GQA = QO_HEADS // KV_HEADS
PAGE = SPEC.block_size
MAX_PAGES = SPEC.max_blocks_per_req
MAX_POS = MAX_PAGES * PAGE  # a request's longest sequence, the widest tile a chunk can need
MAX_ROWS = SPEC.capture_sizes[-1]
# A small device: 4 SMs x 3 CTAs, shared by the KV heads, as FlashInfer's max_batch_size_if_split.
MAX_TILES_IF_SPLIT = 4 * 3 // KV_HEADS
MAX_GRID = max(MAX_TILES_IF_SPLIT, MAX_ROWS)
MIN_KV_CHUNK_PAGES = 1  # FlashInfer: max(128 // page_size, 1) pages
NULL_SLOT = SPEC.null_block * PAGE
_M32 = 0xFFFFFFFF


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SplitPlan:
    kv_chunk_pages: int
    request_indices: tuple[int, ...]  # one entry per work tile
    kv_tile_indices: tuple[int, ...]
    padded_tiles: int  # the grid the kernel launches


def plan_split_kv(pages: Sequence[int], grid: int, search_skips_empty_rows: bool) -> SplitPlan:
    """FlashInfer's PrefillSplitQOKVIndptr for one-token rows: chunk-size search, then split."""
    low, high = MIN_KV_CHUNK_PAGES, max(1, *pages)
    while low < high:
        mid = (low + high) // 2
        if search_skips_empty_rows:  # before PR #728: an empty row counts no tile here
            tiles = sum(ceil_div(p, mid) for p in pages)
        else:
            tiles = sum(ceil_div(max(p, 1), mid) for p in pages)
        if tiles > MAX_TILES_IF_SPLIT:
            low = mid + 1
        else:
            high = mid
    requests, kv_tiles = [], []
    for row, p in enumerate(pages):
        for tile in range(ceil_div(max(p, 1), low)):  # the split: every row gets a tile
            requests.append(row)
            kv_tiles.append(tile)
    if len(requests) > grid:
        raise RuntimeError(
            f"new batch size should not exceed padded batch size: {len(requests)} tiles for a "
            f"grid of {grid} (kv pages per row {list(pages)}, chunk {low} pages)"
        )
    return SplitPlan(low, tuple(requests), tuple(kv_tiles), grid)


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def sample(logits: Tensor, reqs: Sequence[Request]) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): no generator, no company."""
    dev = logits.device
    seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], dtype=torch.int64, device=dev)
    pos = torch.tensor([r.seq_len - 1 for r in reqs], dtype=torch.int64, device=dev)
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    sampled = torch.tensor([r.seed is not None for r in reqs], dtype=torch.bool, device=dev)
    key = _mix(_mix(seeds) ^ ((pos * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=dev)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class SplitKvDecodeRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, search_skips_empty_rows: bool):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        self.search_skips_empty_rows = search_skips_empty_rows
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos_embed": (MAX_POS, HIDDEN),
            "wq": (HIDDEN, QO_HEADS * HEAD_DIM),
            "wk": (HIDDEN, KV_HEADS * HEAD_DIM),
            "wv": (HIDDEN, KV_HEADS * HEAD_DIM),
            "wo": (QO_HEADS * HEAD_DIM, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {name: torch.empty(shape, device=dev) for name, shape in shapes.items()}
        self.update_weights(seed)
        self.k_cache = torch.zeros(SPEC.num_slots, KV_HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, KV_HEADS, HEAD_DIM, device=dev)
        self.graphs: dict[int, Any] = {}
        self.graph_logits: dict[int, Tensor] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            i32 = torch.int32
            self.buffers = {  # max shape; each graph reads its own prefix
                "tokens": torch.zeros(MAX_ROWS, dtype=torch.int64, device=dev),
                "positions": torch.zeros(MAX_ROWS, dtype=torch.int64, device=dev),
                "slots": torch.zeros(MAX_ROWS, dtype=torch.int64, device=dev),
                "kv_indptr": torch.zeros(MAX_ROWS + 1, dtype=i32, device=dev),
                "kv_indices": torch.zeros(MAX_ROWS * MAX_PAGES, dtype=i32, device=dev),
                "kv_last_page_len": torch.zeros(MAX_ROWS, dtype=i32, device=dev),
                # the plan's part of FlashInfer's int workspace
                "request_indices": torch.zeros(MAX_GRID, dtype=i32, device=dev),
                "kv_tile_indices": torch.zeros(MAX_GRID, dtype=i32, device=dev),
                "block_valid_mask": torch.zeros(MAX_GRID, dtype=torch.bool, device=dev),
                "kv_chunk_size": torch.zeros(1, dtype=i32, device=dev),
            }
            self.capture()

    # -- the model --------------------------------------------------------------------------------

    def project(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        w = self.w
        x = w["embed"][tokens] + w["pos_embed"][positions]
        h = _norm(x)
        q = (h @ w["wq"]).view(-1, QO_HEADS, HEAD_DIM)
        k = (h @ w["wk"]).view(-1, KV_HEADS, HEAD_DIM)
        v = (h @ w["wv"]).view(-1, KV_HEADS, HEAD_DIM)
        return x, q, k, v

    def finish(self, x: Tensor, attn: Tensor) -> Tensor:
        w = self.w
        x = x + attn.flatten(1) @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        return _norm(x) @ w["lm_head"]

    def split_kv_attention(self, q: Tensor, rows: int, grid: int) -> Tensor:
        """One partial softmax per planned tile, then a log-sum-exp merge per row."""
        buf = self.buffers
        dev = q.device
        indptr = buf["kv_indptr"][: rows + 1].long()
        pages = indptr[1:] - indptr[:-1]
        last = buf["kv_last_page_len"][:rows].long()
        kv_len = torch.where(pages > 0, (pages - 1) * PAGE + last, torch.zeros_like(pages))
        req = buf["request_indices"][:grid].long()
        tile = buf["kv_tile_indices"][:grid].long()
        on = buf["block_valid_mask"][:grid]
        chunk = buf["kv_chunk_size"].long() * PAGE  # tokens
        start = tile * chunk
        pos = start[:, None] + torch.arange(MAX_POS, device=dev)[None, :]  # [grid, MAX_POS]
        end = torch.minimum(start + chunk, kv_len[req])
        live = (pos < end[:, None]) & on[:, None]
        # every index is made safe before it is used: off-tile entries may hold anything
        page_entry = torch.where(live, indptr[req][:, None] + pos // PAGE, 0)
        page = buf["kv_indices"][page_entry].long()
        slot = torch.where(live, page * PAGE + pos % PAGE, NULL_SLOT)
        zero = torch.zeros((), device=dev)
        keys = torch.where(live[..., None, None], self.k_cache[slot], zero)
        vals = torch.where(live[..., None, None], self.v_cache[slot], zero)
        keys = keys.repeat_interleave(GQA, dim=2)  # [grid, MAX_POS, QO_HEADS, D]
        vals = vals.repeat_interleave(GQA, dim=2)
        scores = torch.einsum("ghd,gphd->ghp", q[req], keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(live[:, None, :], scores, torch.full((), -math.inf, device=dev))
        tile_max = scores.amax(-1)  # [grid, H]; -inf for an empty tile
        has = torch.isfinite(tile_max)
        tile_max = torch.where(has, tile_max, zero)
        expd = torch.where(live[:, None, :], torch.exp(scores - tile_max[..., None]), zero)
        tile_sum = expd.sum(-1)
        tile_out = torch.einsum("ghp,gphd->ghd", expd, vals)  # unnormalised
        member = (req[None, :] == torch.arange(rows, device=dev)[:, None]) & on[None, :]
        member = member[..., None] & has[None]  # [rows, grid, H]
        row_max = torch.where(member, tile_max[None], torch.full((), -math.inf, device=dev))
        row_max = row_max.amax(1)
        row_max = torch.where(torch.isfinite(row_max), row_max, zero)
        scale = torch.where(member, torch.exp(tile_max[None] - row_max[:, None]), zero)
        denom = (scale * tile_sum[None]).sum(1)  # [rows, H]
        out = torch.einsum("rgh,ghd->rhd", scale, tile_out)
        return torch.where(denom[..., None] > 0, out / denom.clamp_min(1e-30)[..., None], zero)

    def graph_forward(self, rows: int) -> Tensor:
        buf = self.buffers
        x, q, k, v = self.project(buf["tokens"][:rows], buf["positions"][:rows])
        slots = buf["slots"][:rows]
        self.k_cache.index_copy_(0, slots, k)  # padding rows write the null block only
        self.v_cache.index_copy_(0, slots, v)
        attn = self.split_kv_attention(q, rows, max(MAX_TILES_IF_SPLIT, rows))
        return self.finish(x, attn)

    # -- graph mode -------------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for rows in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), rows)  # every row is padding during warm-up and capture
            self.graph_forward(rows)
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.graph_logits[rows] = self.graph_forward(rows)
            self.graphs[rows] = graph

    def prepare(self, batch: Batch, rows: int) -> None:
        """Write the batch and its page table into the buffers, padding rows empty, then plan."""
        reqs = batch.requests
        n = len(reqs)
        pad = [0] * (MAX_ROWS - n)
        page_counts = [ceil_div(r.seq_len, PAGE) for r in reqs]
        indptr = [0]
        indices: list[int] = []
        for r, p in zip(reqs, page_counts, strict=True):
            indices.extend(r.block_ids[:p])
            indptr.append(len(indices))
        indptr += [indptr[-1]] * (MAX_ROWS - n)  # padding rows: no pages, indptr never falls
        indices += [SPEC.null_block] * (MAX_ROWS * MAX_PAGES - len(indices))
        last = [(r.seq_len - 1) % PAGE + 1 for r in reqs] + [1] * (MAX_ROWS - n)
        # the grid captured for `rows` rows: padding rows are in the plan as empty rows
        plan = plan_split_kv(
            page_counts + [0] * (rows - n),
            max(MAX_TILES_IF_SPLIT, rows),
            self.search_skips_empty_rows,
        )
        tiles = len(plan.request_indices)
        grid_pad = [0] * (MAX_GRID - tiles)
        dev, buf = self.device, self.buffers

        def put(name: str, values: list[int]) -> None:
            buf[name].copy_(torch.tensor(values, dtype=buf[name].dtype, device=dev))

        put("tokens", [r.tokens[0] for r in reqs] + pad)
        put("positions", [r.context_len for r in reqs] + pad)
        put(
            "slots",
            [kv_slot(r.block_ids, r.context_len, PAGE) for r in reqs] + [NULL_SLOT] * len(pad),
        )
        put("kv_indptr", indptr)
        put("kv_indices", indices)
        put("kv_last_page_len", last)
        put("request_indices", list(plan.request_indices) + grid_pad)
        put("kv_tile_indices", list(plan.kv_tile_indices) + grid_pad)
        put("block_valid_mask", [1] * tiles + grid_pad)
        put("kv_chunk_size", [plan.kv_chunk_pages])

    def graph_size(self, batch: Batch) -> int | None:
        if batch.num_reqs == 0 or any(len(r.tokens) != 1 for r in batch.requests):
            return None
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        rows = self.graph_size(batch) if self.mode == "graph" else None
        if rows is None:
            reason = (
                "eager twin"
                if self.mode == "eager"
                else "not a one-token decode batch a graph fits"
            )
            logits = self.eager_forward(batch)
            return StepResult(logits, sample(logits, batch.requests), "eager", None, reason)
        self.prepare(batch, rows)
        self.graphs[rows].replay()
        logits = self.graph_logits[rows][: batch.num_reqs].clone()
        return StepResult(logits, sample(logits, batch.requests), "full", ("decode", rows))

    # -- eager path: dense attention over the request's slots -------------------------------------

    def eager_forward(self, batch: Batch) -> Tensor:
        dev = self.device
        reqs = batch.requests
        tok = [t for r in reqs for t in r.tokens]
        pos = [r.context_len + i for r in reqs for i in range(len(r.tokens))]
        write = [
            kv_slot(r.block_ids, p, PAGE) for r in reqs for p in range(r.context_len, r.seq_len)
        ]
        table, visible, last = [], [], []
        for r in reqs:
            slots = [kv_slot(r.block_ids, p, PAGE) for p in range(r.seq_len)]
            slots += [NULL_SLOT] * (MAX_POS - len(slots))
            for i in range(len(r.tokens)):
                table.append(slots)
                visible.append([p <= r.context_len + i for p in range(MAX_POS)])
            last.append(len(table) - 1)
        x, q, k, v = self.project(
            torch.tensor(tok, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
        )
        write_t = torch.tensor(write, dtype=torch.int64, device=dev)
        self.k_cache.index_copy_(0, write_t, k)  # store before any token of the step reads
        self.v_cache.index_copy_(0, write_t, v)
        table_t = torch.tensor(table, dtype=torch.int64, device=dev)
        seen = torch.tensor(visible, dtype=torch.bool, device=dev)
        zero = torch.zeros((), device=dev)
        keys = torch.where(seen[..., None, None], self.k_cache[table_t], zero)
        vals = torch.where(seen[..., None, None], self.v_cache[table_t], zero)
        keys = keys.repeat_interleave(GQA, dim=2)
        vals = vals.repeat_interleave(GQA, dim=2)
        scores = torch.einsum("thd,tphd->thp", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(seen[:, None, :], scores, torch.full((), -math.inf, device=dev))
        attn = torch.einsum("thp,tphd->thd", scores.softmax(-1), vals)
        last_t = torch.tensor(last, dtype=torch.int64, device=dev)
        return self.finish(x[last_t], attn[last_t])

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):  # in place: the captured graphs read these tensors
            w = self.w[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_logits.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return SplitKvDecodeRunner(mode, seed=seed, backend=backend, search_skips_empty_rows=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return SplitKvDecodeRunner(mode, seed=seed, backend=backend, search_skips_empty_rows=True)
