"""In-graph sampling with per-sequence-slot Philox (seed, offset) state, after TensorRT-LLM.

What it models
--------------
TensorRT-LLM's opt-in in-graph sampler (``enable_fast_sampler``, NVIDIA/TensorRT-LLM PR #18437)
captures temperature / top-k / top-p sampling inside the decode CUDA graph. Because a
``torch.Generator`` cannot be replayed by a graph, every logits row is sampled from an explicit
Philox ``(seed, offset)`` pair staged into static buffers before each replay. Those pairs come from
the sampler's host-side ``_SeedManager``, which keeps one ``(seed, offset)`` per *sequence slot*
(a slot is held by a request for its whole life, also while the scheduler leaves it out of a
step): ``observe`` (re)seeds a slot whose owner changed, ``make_row_seeds`` reads each row's pair,
and ``advance`` moves each row's slot forward by ``OFFSET_STRIDE`` after staging, so a request's
next draw uses a fresh stretch of its own stream.

This runner is a one-layer decoder (learned positions, attention over a slot-major paged KV cache
read through per-token block tables, a SiLU MLP, an LM head) written against the backend facade.
Uniform one-token batches of up to 8 requests replay a graph captured per padded request count
(1, 2, 4, 8), with the sampler inside the graph; everything else (prefill chunks, speculative
rows, mixed batches) runs eagerly through the same forward and the same sampler, as does the eager
twin. Sampling is Gumbel-max with noise hashed from (seed, offset, token id); greedy requests
(``seed=None``) take the argmax. The contract's ``Request`` carries no slot, so a request's slot
is handed out the first time its ``req_id`` is seen, and a request that (re)starts
(``context_len`` 0: new, or back after preemption) restarts its stream at offset 0, as a change of
owner does in TensorRT-LLM.

The bug (``make_buggy_target``, flag ``padding_uses_spare_slot``)
--------------------------------------------------------------
Padding rows of a replay must still carry *some* slot, because ``make_row_seeds`` and ``advance``
work on a list of slots, one per row. The buggy runner routes every padding row to a "spare"
slot: the lowest slot that no request *of this batch* holds. That slot can belong to a live request
that the scheduler simply left out of this step. ``advance`` then moves that absent request's
offset forward by ``OFFSET_STRIDE`` for every padding row, so when it comes back it samples from
another stretch of its stream than it would have: its tokens depend on how many padded replays ran
while it was away and on who was in them. The eager twin never pads, so the graph twin's tokens
differ from the eager twin's only for a sampled request that sat out a padded decode step, and
only when its slot was the lowest one missing from that batch.

Source: the review of NVIDIA/TensorRT-LLM PR #18437 ("[TRTLLM-15621][feat] Support in-graph
sampling for temperature/top-k/top-p batches", https://github.com/NVIDIA/TensorRT-LLM/pull/18437),
thread on ``stage_in_graph_sampling`` in ``sampler.py``: "Padding rows advance another request's
Philox offset ... ``spare`` can still be the slot of an active request that is not scheduled this
step ... moves its offset forward by ``OFFSET_STRIDE`` for each padded row. The number of padded
rows depends on the batch". The per-slot seed manager itself came with PR #17172
(https://github.com/NVIDIA/TensorRT-LLM/pull/17172). Whether the merged PR changed the spare-slot
choice could not be read from the stored material; the mechanism is as the review describes.

The fix (``make_target``): padding rows are routed to a slot reserved for padding, one that no
request is ever given, so advancing it touches nobody's stream. (Skipping the padding rows in
``advance`` is equivalent.) No engine code was copied.
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
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),  # decode graphs: one token per request, so requests == tokens
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_LEN = SPEC.max_blocks_per_req * SPEC.block_size
OFFSET_STRIDE = 32  # Philox units reserved per row per sampling call, as TensorRT-LLM reserves
PADDING_SLOT = -1  # the fixed runner's reserved slot: never handed to a request
_M32 = 0xFFFFFFFF


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos_embed": (MAX_LEN, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # copied in place: the captured graphs read these tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _rms_norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _avalanche(x: Tensor) -> Tensor:
    """A 32-bit integer finalizer on int64 tensors (values kept below 2**32)."""
    x = x & _M32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def philox_like_sample(
    logits: Tensor, seeds: Tensor, offsets: Tensor, temps: Tensor, sampled: Tensor
):
    """Gumbel-max from a counter-based stream: noise is a pure function of (seed, offset, token)."""
    stream = _avalanche(_avalanche(seeds) ^ _avalanche(offsets + 0x51ED27))
    token_ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _avalanche(stream[:, None] ^ ((token_ids * 0x6C8E9CF5) & _M32)[None, :])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24  # strictly inside (0, 1)
    gumbel = -torch.log(-torch.log(uniform))
    noisy = logits / temps[:, None] + gumbel
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class SeedManager:
    """Host-side Philox state per sequence slot (TensorRT-LLM's ``_SeedManager``)."""

    def __init__(self) -> None:
        self.slot_of: dict[int, int] = {}  # req_id -> sequence slot, held for the request's life
        self.owner: dict[int, int] = {}  # slot -> req_id
        self.seed: dict[int, int] = {PADDING_SLOT: 0}
        self.offset: dict[int, int] = {PADDING_SLOT: 0}

    def observe(self, requests: Sequence[Request]) -> None:
        for r in requests:
            slot = self.slot_of.get(r.req_id)
            if slot is None:
                slot = len(self.slot_of)
                self.slot_of[r.req_id] = slot
            if self.owner.get(slot) != r.req_id or r.context_len == 0:
                # A new owner, or the request (re)starts: its stream starts at offset 0.
                self.owner[slot] = r.req_id
                self.seed[slot] = 0 if r.seed is None else r.seed & _M32
                self.offset[slot] = 0

    def spare_slot(self, requests: Sequence[Request]) -> int:
        """The lowest slot no request of this batch holds (it may be an absent request's)."""
        held = {self.slot_of[r.req_id] for r in requests}
        return next(s for s in range(len(self.slot_of) + 1) if s not in held)

    def row_seeds(self, slots_per_row: Sequence[int]) -> tuple[list[int], list[int]]:
        return [self.seed.get(s, 0) for s in slots_per_row], [
            self.offset.get(s, 0) for s in slots_per_row
        ]

    def advance(self, slots_per_row: Sequence[int]) -> None:
        for s in slots_per_row:
            self.offset[s] = self.offset.get(s, 0) + OFFSET_STRIDE


class InGraphSamplingRunner:
    def __init__(
        self, mode: str, *, seed: int, backend: str, padding_uses_spare_slot: bool = False
    ):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        self.padding_uses_spare_slot = padding_uses_spare_slot
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.seeds = SeedManager()
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows, i64 = max(SPEC.capture_sizes), torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slot_mapping": torch.zeros(rows, dtype=i64, device=dev),
                "block_tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "philox_seeds": torch.zeros(rows, dtype=i64, device=dev),
                "philox_offsets": torch.zeros(rows, dtype=i64, device=dev),
                "temperatures": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
            }
            self.capture()

    # -- model --------------------------------------------------------------------------------

    def forward(self, tokens: Tensor, pos: Tensor, slots: Tensor, tables: Tensor) -> Tensor:
        """One token per row; each row attends to its own request's cache up to its position."""
        w = self.w.t
        x = w["embed"][tokens] + w["pos_embed"][pos]
        h = _rms_norm(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, (h @ w["wk"]).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, (h @ w["wv"]).view(-1, HEADS, HEAD_DIM))
        p = torch.arange(MAX_LEN, device=tokens.device)
        cache_rows = tables[:, p // SPEC.block_size] * SPEC.block_size + p % SPEC.block_size
        visible = p[None, :] <= pos[:, None]  # [T, L]
        zero = torch.zeros((), device=x.device)
        # where, not a multiply: unvisited slots may hold NaN (the harness poisons free blocks)
        keys = torch.where(visible[:, :, None, None], self.k_cache[cache_rows], zero)
        vals = torch.where(visible[:, :, None, None], self.v_cache[cache_rows], zero)
        scores = torch.einsum("thd,tlhd->thl", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), -math.inf, device=x.device)
        )
        attn = torch.einsum("thl,tlhd->thd", scores.softmax(-1), vals).flatten(1)
        x = x + attn @ w["wo"]
        x = x + torch.nn.functional.silu(_rms_norm(x) @ w["up"]) @ w["down"]
        return _rms_norm(x) @ w["lm_head"]

    def graph_body(self, size: int) -> tuple[Tensor, Tensor]:
        b = {name: t[:size] for name, t in self.buffers.items()}
        logits = self.forward(b["tokens"], b["positions"], b["slot_mapping"], b["block_tables"])
        tokens = philox_like_sample(
            logits, b["philox_seeds"], b["philox_offsets"], b["temperatures"], b["sampled"]
        )
        return logits, tokens

    # -- graph mode ---------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.stage_padding(0, size, slot_seed=0, slot_offset=0)  # every row padding
            self.graph_body(size)  # warm-up outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self.graph_body(size)
            self.graphs[size] = graph

    def stage_padding(self, start: int, size: int, *, slot_seed: int, slot_offset: int) -> None:
        """Padding rows: token 0 at position 0, writing and reading only the null block."""
        b = self.buffers
        null_slot = SPEC.null_block * SPEC.block_size
        b["tokens"][start:size].fill_(0)
        b["positions"][start:size].fill_(0)
        b["slot_mapping"][start:size].fill_(null_slot)
        b["block_tables"][start:size].fill_(SPEC.null_block)
        b["philox_seeds"][start:size].fill_(slot_seed)
        b["philox_offsets"][start:size].fill_(slot_offset)
        b["temperatures"][start:size].fill_(1.0)
        b["sampled"][start:size].fill_(False)

    def padding_slot(self, batch: Batch) -> int:
        if self.padding_uses_spare_slot:
            return self.seeds.spare_slot(batch.requests)  # BUG: may be an absent request's slot
        return PADDING_SLOT

    def replay(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        size = next(s for s in SPEC.capture_sizes if s >= n)
        reqs = batch.requests
        self.seeds.observe(reqs)
        pad_slot = self.padding_slot(batch)
        slots_per_row = [self.seeds.slot_of[r.req_id] for r in reqs] + [pad_slot] * (size - n)
        row_seeds, row_offsets = self.seeds.row_seeds(slots_per_row)
        self.seeds.advance(slots_per_row)  # every staged row consumed its stretch
        b, dev = self.buffers, self.device
        cols = SPEC.max_blocks_per_req
        tables = [list(r.block_ids) + [SPEC.null_block] * (cols - len(r.block_ids)) for r in reqs]
        b["tokens"][:n].copy_(torch.tensor([r.tokens[0] for r in reqs], device=dev))
        b["positions"][:n].copy_(torch.tensor([r.context_len for r in reqs], device=dev))
        slots = [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs]
        b["slot_mapping"][:n].copy_(torch.tensor(slots, device=dev))
        b["block_tables"][:n].copy_(torch.tensor(tables, dtype=torch.int64, device=dev))
        b["philox_seeds"][:n].copy_(torch.tensor(row_seeds[:n], device=dev))
        b["philox_offsets"][:n].copy_(torch.tensor(row_offsets[:n], device=dev))
        b["temperatures"][:n].copy_(torch.tensor([r.temperature for r in reqs], device=dev))
        b["sampled"][:n].copy_(torch.tensor([r.seed is not None for r in reqs], device=dev))
        self.stage_padding(n, size, slot_seed=row_seeds[-1], slot_offset=row_offsets[-1])
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if any(r.query_len != 1 for r in batch.requests):
            return "query longer than one token (prefill or speculative rows)"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more requests than the largest graph"
        return None

    # -- eager path ---------------------------------------------------------------------------

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        reqs, dev = batch.requests, self.device
        self.seeds.observe(reqs)
        slots_per_row = [self.seeds.slot_of[r.req_id] for r in reqs]
        row_seeds, row_offsets = self.seeds.row_seeds(slots_per_row)
        self.seeds.advance(slots_per_row)
        cols = SPEC.max_blocks_per_req
        tok, pos, slots, tables, last = [], [], [], [], []
        for r in reqs:
            table = list(r.block_ids) + [SPEC.null_block] * (cols - len(r.block_ids))
            for i, t in enumerate(r.tokens):
                tok.append(t)
                pos.append(r.context_len + i)
                slots.append(kv_slot(r.block_ids, r.context_len + i, SPEC.block_size))
                tables.append(table)
            last.append(len(tok) - 1)
        logits = self.forward(
            torch.tensor(tok, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            torch.tensor(slots, dtype=torch.int64, device=dev),
            torch.tensor(tables, dtype=torch.int64, device=dev),
        )[torch.tensor(last, device=dev)]
        tokens = philox_like_sample(
            logits,
            torch.tensor(row_seeds, dtype=torch.int64, device=dev),
            torch.tensor(row_offsets, dtype=torch.int64, device=dev),
            torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev),
            torch.tensor([r.seed is not None for r in reqs], dtype=torch.bool, device=dev),
        )
        return StepResult(logits, tokens, "eager", None, reason)

    # -- contract -----------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            no_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
            return StepResult(empty, no_tokens, "eager", None, "empty batch")
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self.run_eager(batch, reason)
        return self.replay(batch)

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
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return InGraphSamplingRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return InGraphSamplingRunner(mode, seed=seed, backend=backend, padding_uses_spare_slot=True)
