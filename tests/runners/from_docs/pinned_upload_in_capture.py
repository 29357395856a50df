"""A decode-graph runner whose captured graph contains its own host-to-device input upload.

Written against plain `torch.cuda` (no harness import but the contract types); on sim it runs
inside the harness's drop-in.

What it does. A one-layer decoder over a slot-major paged KV cache. A decode graph is captured
lazily, the first time a batch needs its size (any batch whose requests all have one query token
and that fits the largest capture size replays one; anything else runs eagerly). Inside the
capture the graph first uploads its inputs itself:
`static_rows[:size].copy_(pinned_rows[:size], non_blocking=True)` (and the same for the
temperatures) from pinned host staging tensors, so every replay re-reads those host buffers'
addresses. Each step the host writes the batch (valid rows, then padding rows pointing at the
null block) into that same pinned staging in place and replays; before it writes, it waits on an
event recorded after the last replay, because a replay still in flight reads the staging when it
runs, not when it is issued. Results are cloned on the main stream.

Correct runner: one pinned staging pair of the largest capture size, allocated at construction and
only ever written in place.

Bug (`make_buggy_target`): the staging is grown on demand: it starts with the smallest capture
size's rows and, when a batch needs more rows than it holds, the runner replaces it with a fresh,
larger `torch.zeros(..., pin_memory=True)` and fills that one. Graphs captured before the growth
still copy from the old buffer (freed; on a GPU its block goes back to the caching host allocator),
so their replays read stale or reused host memory instead of the step's inputs.

Modelled on bugs where a host tensor a captured H2D copy reads is re-created or dropped after
capture: candle's capture pool PR ("host vectors were dropped immediately after capture ...
leaving subsequent graph launches to reference invalid host/device memory"),
https://github.com/huggingface/candle/pull/3352; Paddle's captured H2D copy from restored host
memory, https://github.com/PaddlePaddle/Paddle/pull/37774; PyTorch's note that pinned memory a
graph reads cannot be recycled while the graph lives,
https://github.com/pytorch/pytorch/pull/161583; and reallocation of a staging ring whenever the
bucket's shape changes (https://github.com/RBLN-SW/vllm-rbln/pull/951, review thread).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
MASK32 = 0xFFFFFFFF
# int64 input columns: token, position, slot, seed, sampled, then the block table
TOK, POS, SLOT, SEED, SAMPLED, TABLE = 0, 1, 2, 3, 4, 5
WIDTH = TABLE + SPEC.max_blocks_per_req


# -- the model (no host reads: capturable) -------------------------------------------------------


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & MASK32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


class Decoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        slots = SPEC.num_blocks * SPEC.block_size
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=device)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=device)
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def forward(self, rows: Tensor, temps: Tensor, last: Tensor | None) -> tuple[Tensor, Tensor]:
        """rows: [T, WIDTH] int64, temps: [T] float; results at `last` (None: every row)."""
        w = self.w
        tok, pos, slot = rows[:, TOK], rows[:, POS], rows[:, SLOT]
        x = w["embed"][tok] + w["pos"][pos]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        self.k_cache.index_copy_(0, slot, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slot, v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        ctx = (rows[:, TABLE:, None] * bs + torch.arange(bs, device=self.device)).flatten(1)
        keys, vals = self.k_cache[ctx], self.v_cache[ctx]  # [T, CONTEXT, H, D]
        visible = torch.arange(CONTEXT, device=self.device)[None, :] <= pos[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(
            HEAD_DIM
        )
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=self.device))
        x = x + torch.einsum("thc,tchd->thd", probs, vals).flatten(1) @ w["wo"]
        x = x + torch.nn.functional.silu(x @ w["up"]) @ w["down"]
        if last is not None:
            x, rows, temps = x[last], rows[last], temps[last]
        logits = x @ w["head"]
        return logits, self.sample(logits, rows, temps)

    @staticmethod
    def sample(logits: Tensor, rows: Tensor, temps: Tensor) -> Tensor:
        """Gumbel-max with noise hashed from (seed, position, token id); greedy rows take argmax."""
        key = _hash(_hash(rows[:, SEED]) ^ ((rows[:, POS] * 0x27D4EB2F) & MASK32))
        ids = torch.arange(logits.shape[-1], device=logits.device)
        bits = _hash(key[:, None] ^ ((ids * 0x165667B1) & MASK32)[None, :])
        u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
        noisy = logits / temps[:, None] - torch.log(-torch.log(u))
        return torch.where(rows[:, SAMPLED] != 0, noisy.argmax(-1), logits.argmax(-1))


# -- host-side rows --------------------------------------------------------------------------------


def _request_rows(r: Request) -> tuple[list[list[int]], list[float]]:
    table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
    sampled = r.seed is not None
    seed = (r.seed & MASK32) if sampled else 0
    temp = float(r.temperature) if sampled else 1.0
    rows = []
    for i, t in enumerate(r.tokens):
        p = r.context_len + i
        rows.append([t, p, kv_slot(r.block_ids, p, SPEC.block_size), seed, int(sampled), *table])
    return rows, [temp] * len(rows)


PAD_ROW = [0, 0, SPEC.null_block * SPEC.block_size, 0, 0] + [
    SPEC.null_block
] * SPEC.max_blocks_per_req


# -- the runner ------------------------------------------------------------------------------------


class CapturedUploadRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, grow_staging: bool = False
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.device = torch.device("cuda")
        self.model = Decoder(seed, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            c = SPEC.capture_sizes[-1]
            self.buffers = {
                "rows": torch.zeros(c, WIDTH, dtype=torch.int64, device=self.device),
                "temps": torch.ones(c, device=self.device),
            }
            rows = SPEC.capture_sizes[0] if grow_staging else c
            self.pinned_rows = torch.zeros(rows, WIDTH, dtype=torch.int64, pin_memory=True)
            self.pinned_temps = torch.ones(rows, dtype=torch.float32, pin_memory=True)
            self.replayed = torch.cuda.Event()
            self.in_flight = False

    # graph mode ----------------------------------------------------------------------------------

    def _stage(self, rows: list[list[int]], temps: list[float], size: int) -> None:
        """Write rows plus padding rows up to `size` into the pinned staging, in place, once no
        replay that reads it is still to run."""
        if self.in_flight:
            self.replayed.synchronize()
            self.in_flight = False
        if size > self.pinned_rows.shape[0]:  # only when the staging was made smaller
            self.pinned_rows = torch.zeros(size, WIDTH, dtype=torch.int64, pin_memory=True)
            self.pinned_temps = torch.ones(size, dtype=torch.float32, pin_memory=True)
        pad = size - len(rows)
        self.pinned_rows[:size].copy_(torch.tensor(rows + [PAD_ROW] * pad, dtype=torch.int64))
        self.pinned_temps[:size].copy_(torch.tensor(temps + [1.0] * pad, dtype=torch.float32))

    def _graph_body(self, size: int) -> tuple[Tensor, Tensor]:
        rows, temps = self.buffers["rows"][:size], self.buffers["temps"][:size]
        rows.copy_(self.pinned_rows[:size], non_blocking=True)
        temps.copy_(self.pinned_temps[:size], non_blocking=True)
        return self.model.forward(rows, temps, None)

    def _capture(self, size: int) -> None:
        """Capture the graph of `size` rows (all padding during warm-up and capture)."""
        self._stage([], [], size)
        self._graph_body(size)  # warm-up outside the graph
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.outputs[size] = self._graph_body(size)
        self.graphs[size] = g

    def replay(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        size = next(s for s in SPEC.capture_sizes if s >= n)
        if size not in self.graphs:
            self._capture(size)
        rows, temps = [], []
        for r in batch.requests:
            rr, tt = _request_rows(r)
            rows += rr
            temps += tt
        self._stage(rows, temps, size)
        self.graphs[size].replay()
        self.replayed.record()  # the replay's upload has read the staging once this completes
        self.in_flight = True
        logits, ids = self.outputs[size]
        return StepResult(logits[:n].clone(), ids[:n].clone(), "full", ("decode", size))

    # both modes ----------------------------------------------------------------------------------

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "a request with more than one query token"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        rows, temps, last = [], [], []
        for r in batch.requests:
            rr, tt = _request_rows(r)
            rows += rr
            temps += tt
            last.append(len(rows) - 1)
        if not rows:
            empty = torch.empty(0, SPEC.vocab_size, device=self.device)
            ids = torch.empty(0, dtype=torch.int64, device=self.device)
            return StepResult(empty, ids, "eager", None, reason=reason)
        d_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        d_temps = torch.tensor(temps, dtype=torch.float32, device=self.device)
        d_last = torch.tensor(last, dtype=torch.int64, device=self.device)
        logits, ids = self.model.forward(d_rows, d_temps, d_last)
        return StepResult(logits, ids, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.model.k_cache, "v": self.model.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers  # the pinned staging is rewritten whole every step, not listed

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        if self.mode == "graph":
            torch.cuda.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CapturedUploadRunner:
    return CapturedUploadRunner(mode, seed=seed)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CapturedUploadRunner:
    return CapturedUploadRunner(mode, seed=seed, grow_staging=True)
