"""A hybrid (gated linear recurrence + attention) decode runner whose recurrent decode kernel sorts
its state indices through a host-side cache, with one real bug.

The mechanism modelled: AITER's HIP gated-delta-net (GDN) decode kernel as SGLang's `aiter` linear
attention backend calls it on ROCm for Qwen3.5-style hybrid models. For batches of at least a
threshold of rows (`HIP_GDN_SORT_IDX_BS`, 192 by default there) the C++ wrapper visits the rows in
the order of their state-pool indices, so neighbouring programs touch neighbouring state (better L2
reuse): it argsorts the indices, gathers them in that order, and passes the permutation to the
kernel, which handles row `perm[j]` with state slot `sorted[j]`. Since every GDN layer of one step
gets the same indices tensor, the sort is memoised on the host, keyed by the indices tensor's data
pointer and the batch size, so only the first layer of a step sorts; the engine clears the memo
when it builds metadata for an eager forward.

The runner: one decoder over a slot-major paged KV cache, layers recurrent -> attention ->
recurrent, an LM head, Gumbel-max sampling hashed from (seed, position, token). Each recurrent
layer keeps a small matrix state per head (S' = a * S + b * v k^T, output S' q). So that the
contract can see and relocate that state, it is checkpointed slot-major: the state after the token
at position p lives in that token's KV slot, and a row's "state index" is the pair (slot of p - 1
to read, slot of p to write) instead of SGLang's one in-place pool index. Single-token decode
batches of up to 8 requests replay full graphs captured at start-up for 1, 2, 4 and 8 rows, largest
first, in one pool, each after an eager warm-up on the same static buffers (padding rows read and
write the null block only); every other batch runs eagerly, one token position at a time through
the same decode forward. The memo is per runner (AITER's is per process; here the twins share one).

The bug (`sort_state_indices=True`): the sorted path with its memo. Capturing a size whose graph
sorts (4 and 8 rows here) goes metadata init (memo cleared), warm-up, capture: the warm-up misses
the memo, sorts on the eager stream and stores the result; the capture then hits it on the same
static buffer (same pointer, same row count), so no argsort is recorded. The graph replays with
the permutation and state indices of the warm-up batch, not of the batch it runs: every row is
paired with another row's state (here the padding rows' null-block slots), and the state of the
real rows is written to the wrong place. The memo holds one entry, like the C++ static, and the
next metadata init (the capture of the next size, any eager step) clears it: the tensors a graph
still reads are freed (a use after free on sim; on a GPU, read as whatever reuses that memory).
Batches below the threshold, and the eager path (cleared at each forward), are correct.
Source: ROCm/aiter PR #4656 ("Rm sort for decode gdr", https://github.com/ROCm/aiter/pull/4656):
the host-side sort "is unsafe with CUDA Graph padding and replay when the cached permutation no
longer matches the active indices"; the SGLang side forced `HIP_GDN_SORT_IDX_BS=0` meanwhile
("The HIP extension's host-side sorted-index cache cannot be replayed safely by CUDA Graph").

The fix (`sort_state_indices=False`), as in PR #4656: no host-side argsort, no memo, no
permutation: the kernel always runs with the original state indices, which are graph inputs
rewritten before every replay.
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
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16  # attention
REC_HEADS, REC_DIM = 2, 8  # recurrent layers: a [REC_DIM, REC_DIM] state per head
SORT_MIN_ROWS = 4  # rows from which the decode kernel sorts its state indices (AITER: 192)
MAX_CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size  # where padding rows read and write
_M32 = 0xFFFFFFFF


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        rec = REC_HEADS * REC_DIM
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        for layer in (0, 1):
            for name in ("q", "k", "v"):
                shapes[f"r{layer}_{name}"] = (HIDDEN, rec)
            shapes[f"r{layer}_gate"] = (HIDDEN, REC_HEADS)
            shapes[f"r{layer}_beta"] = (HIDDEN, REC_HEADS)
            shapes[f"r{layer}_o"] = (rec, HIDDEN)
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: the captured graphs read these very tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
    angle = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


class HybridGdnRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, sort_state_indices: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.sort_state_indices = SPEC, mode, sort_state_indices
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        n = SPEC.num_slots
        self.k_cache = torch.zeros(n, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(n, HEADS, HEAD_DIM, device=dev)
        self.rec_state = [torch.zeros(n, REC_HEADS, REC_DIM, REC_DIM, device=dev) for _ in (0, 1)]
        # the kernel wrapper's one-entry memo: (indices pointer, rows, order, read, write)
        self.sort_memo: tuple[int, int, Tensor, Tensor, Tensor] | None = None
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.graph_logits: dict[int, Tensor] = {}
        if mode == "graph":
            rows, i64 = max(SPEC.capture_sizes), torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "write_slots": torch.zeros(rows, dtype=i64, device=dev),
                "read_slots": torch.zeros(rows, dtype=i64, device=dev),
                "has_prev": torch.zeros(rows, dtype=torch.bool, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
            }
            self.capture()

    # -- the model ---------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """Metadata init of an eager forward (and of a capture): the engine clears the sort memo."""
        self.sort_memo = None

    def sorted_state_indices(self, read: Tensor, write: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Row order by state index, memoised by the indices' address and row count."""
        key = (read.data_ptr(), read.shape[0])
        if self.sort_memo is not None and self.sort_memo[:2] == key:
            return self.sort_memo[2:]
        order = torch.argsort(read)
        entry = (order, read.index_select(0, order), write.index_select(0, order))
        self.sort_memo = (*key, *entry)  # one entry: whatever it held before is released
        return entry

    def recurrent(self, layer: int, h: Tensor, read: Tensor, write: Tensor, has_prev: Tensor):
        w, state = self.w.t, self.rec_state[layer]
        x = _norm(h)
        q = (x @ w[f"r{layer}_q"]).view(-1, REC_HEADS, REC_DIM)
        k = torch.nn.functional.normalize(
            (x @ w[f"r{layer}_k"]).view(-1, REC_HEADS, REC_DIM), dim=-1
        )
        v = (x @ w[f"r{layer}_v"]).view(-1, REC_HEADS, REC_DIM)
        gate = torch.sigmoid(x @ w[f"r{layer}_gate"])[..., None, None]
        beta = torch.sigmoid(x @ w[f"r{layer}_beta"])[..., None, None]
        order = None
        if self.sort_state_indices and read.shape[0] >= SORT_MIN_ROWS:
            order, read, write = self.sorted_state_indices(read, write)
            q, k, v, gate, beta, has_prev = (
                t.index_select(0, order) for t in (q, k, v, gate, beta, has_prev)
            )
        prev = state.index_select(0, read)
        # a row with no earlier token starts from zero; `where`, since its slot may hold NaN
        prev = torch.where(has_prev[:, None, None, None], prev, torch.zeros((), device=h.device))
        new = gate * prev + beta * v[..., :, None] * k[..., None, :]
        out = (new @ q[..., :, None]).squeeze(-1)
        state.index_copy_(0, write, new)
        if order is not None:  # back to the rows' own order
            out = torch.zeros_like(out).index_copy_(0, order, out)
        return out.flatten(1) @ w[f"r{layer}_o"]

    def attention(self, h: Tensor, pos: Tensor, write: Tensor, tables: Tensor) -> Tensor:
        w = self.w.t
        x = _norm(h)
        q = _rope((x @ w["wq"]).view(-1, HEADS, HEAD_DIM), pos, self.w.inv_freq)
        k = _rope((x @ w["wk"]).view(-1, HEADS, HEAD_DIM), pos, self.w.inv_freq)
        v = (x @ w["wv"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, write, k)  # store this token before anything reads it
        self.v_cache.index_copy_(0, write, v)
        offsets = torch.arange(SPEC.block_size, device=h.device)
        slots = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [rows, MAX_CONTEXT]
        visible = torch.arange(MAX_CONTEXT, device=h.device)[None, :] <= pos[:, None]
        scores = torch.einsum("nhd,nlhd->nhl", q, self.k_cache[slots]) / math.sqrt(HEAD_DIM)
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), -math.inf, device=h.device)
        )
        vals = torch.where(
            visible[:, :, None, None], self.v_cache[slots], torch.zeros((), device=h.device)
        )
        return torch.einsum("nhl,nlhd->nhd", scores.softmax(-1), vals).flatten(1) @ w["wo"]

    def forward(self, tokens, pos, write, read, has_prev, tables) -> Tensor:
        """One token per row through every layer: the decode step, and each eager position."""
        h = self.w.t["embed"][tokens]
        h = h + self.recurrent(0, h, read, write, has_prev)
        h = h + self.attention(h, pos, write, tables)
        h = h + self.recurrent(1, h, read, write, has_prev)
        return _norm(h) @ self.w.t["head"]

    # -- graph mode --------------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.begin_forward()
            self.prepare(Batch(()), size)  # every row padding during warm-up and capture
            self.run_static(size)  # warm-up, outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.graph_logits[size] = self.run_static(size)
            self.graphs[size] = graph

    def run_static(self, size: int) -> Tensor:
        b = self.buffers
        return self.forward(
            b["tokens"][:size],
            b["positions"][:size],
            b["write_slots"][:size],
            b["read_slots"][:size],
            b["has_prev"][:size],
            b["tables"][:size],
        )

    def prepare(self, batch: Batch, size: int) -> None:
        """Write the batch into the buffers' prefix and every other row as padding."""
        rows = _decode_rows(batch.requests, offset=0)
        pad = max(SPEC.capture_sizes) - len(rows)
        rows += [
            (0, 0, NULL_SLOT, NULL_SLOT, False, [SPEC.null_block] * SPEC.max_blocks_per_req)
        ] * pad
        cols = list(zip(*rows, strict=True))
        for name, values in zip(
            ("tokens", "positions", "write_slots", "read_slots"), cols, strict=False
        ):
            self.buffers[name].copy_(torch.tensor(values, dtype=torch.int64, device=self.device))
        self.buffers["has_prev"].copy_(torch.tensor(cols[4], dtype=torch.bool, device=self.device))
        self.buffers["tables"].copy_(torch.tensor(cols[5], dtype=torch.int64, device=self.device))

    def step(self, batch: Batch) -> StepResult:
        reqs = batch.requests
        if not reqs:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        reason = self.fallback_reason(batch)
        if reason is not None:
            logits = self.run_eager(reqs)
            return StepResult(logits, self.sample(logits, reqs), "eager", None, reason)
        size = next(s for s in SPEC.capture_sizes if s >= len(reqs))
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits = self.graph_logits[size][: len(reqs)].clone()
        return StepResult(logits, self.sample(logits, reqs), "full", ("decode", size))

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if any(len(r.tokens) != 1 for r in batch.requests):
            return "more than one query token in a row"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more requests than the largest graph"
        return None

    def run_eager(self, reqs: Sequence[Request]) -> Tensor:
        """Position by position: each pass is a decode forward over the rows that reach it."""
        out: list[Tensor | None] = [None] * len(reqs)
        for t in range(max(len(r.tokens) for r in reqs)):
            live = [i for i, r in enumerate(reqs) if len(r.tokens) > t]
            rows = _decode_rows([reqs[i] for i in live], offset=t)
            cols = list(zip(*rows, strict=True))
            dev = self.device
            self.begin_forward()
            logits = self.forward(
                *(torch.tensor(c, dtype=torch.int64, device=dev) for c in cols[:4]),
                torch.tensor(cols[4], dtype=torch.bool, device=dev),
                torch.tensor(cols[5], dtype=torch.int64, device=dev),
            )
            for j, i in enumerate(live):
                if t == len(reqs[i].tokens) - 1:
                    out[i] = logits[j]
        return torch.stack([o for o in out if o is not None])

    def sample(self, logits: Tensor, reqs: Sequence[Request]) -> Tensor:
        """Gumbel-max with noise hashed from (seed, position of the last token, token id)."""
        dev = logits.device
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

    # -- contract ----------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {
            "k": self.k_cache,
            "v": self.v_cache,
            "rec0": self.rec_state[0],
            "rec1": self.rec_state[1],
        }

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs, self.graph_logits, self.sort_memo = {}, {}, None


def _decode_rows(reqs: Sequence[Request], offset: int) -> list[tuple]:
    """(token, position, write slot, read slot, has a previous token, block table) per request,
    for its token at `offset` in this step."""
    rows = []
    for r in reqs:
        pos = r.context_len + offset
        read = kv_slot(r.block_ids, pos - 1, SPEC.block_size) if pos > 0 else NULL_SLOT
        table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
        rows.append(
            (
                r.tokens[offset],
                pos,
                kv_slot(r.block_ids, pos, SPEC.block_size),
                read,
                pos > 0,
                table,
            )
        )
    return rows


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridGdnRunner:
    return HybridGdnRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> HybridGdnRunner:
    return HybridGdnRunner(mode, seed=seed, backend=backend, sort_state_indices=True)
