"""A slot-grid decode graph whose in-graph penalties read token histories uploaded per slot.

The engine mechanism modelled: Tenstorrent's vLLM backend runs decode as a captured device trace
over a fixed grid of batch *slots* (rows of its persistent input batch). A request keeps its slot
for as long as it keeps running; when one finishes, its slot becomes a hole that later requests
fill, so the occupied slots are seldom the dense prefix ``0 .. n-1``. The sampler runs on the
device inside the trace and applies presence / frequency penalties from a histogram of each
request's tokens, which the device builds from a ``[slots, max_len]`` token-history tensor the host
uploads before the replay. The device reads row ``s`` of that tensor for the request in slot ``s``.

Here: a one-layer decoder (token + learned position embeddings, single-head-group attention over a
slot-major paged KV cache gathered through per-token block tables, a SiLU MLP, an LM head) written
against the backend facade. One decode graph per capture size (1, 2, 4, 8 rows) is captured at
start-up, largest first, into one pool; it runs rows ``0 .. size-1`` of the slot grid, so a hole
below the highest occupied slot is a padding row (null block, empty history). Every other batch
(prefill, mixed, speculative, or a slot span above the largest graph) runs eagerly in batch order,
as the eager twin always does. The penalised logits are the step's logits; the token is the argmax
(greedy rows) or a Gumbel-max with noise hashed from (seed, position, token id), in the graph.
Slots: a request keeps its slot while it appears in consecutive steps as a continuing request
(``context_len > 0``); the slots of requests a step leaves out are freed first, then newcomers take
the lowest free slots, in batch order. The token history is kept per request on the host and
rebuilt from the batches (reset at ``context_len == 0``, truncated to ``context_len`` after a
speculative step), so it depends on the request alone.

The bug (``pack_history=True``): tenstorrent/vllm PR #479, "Fix greedy encoding, preempted row
release and penalty row scatter in TT input batch" (https://github.com/tenstorrent/vllm/pull/479),
defect 3, "Penalty history was packed, not scattered": the helpers that build the prompt- and
output-token tensors return rows packed densely in request order, and those rows were uploaded as
they were, while the device indexes penalty state by slot. As long as the occupied slots are
``0 .. n-1`` in request order nothing shows; once requests finish out of order (a hole in the slot
grid) or the batch lists its requests in another order than their slots, a request is penalised
with another request's history (or with none). The fix scatters row ``i`` of the packed tensor to
the slot of request ``i``; ``make_target`` does that, ``make_buggy_target`` uploads packed rows. The
eager path builds its histories in batch order and never has slots, so it is right either way.

What the contract could not express: sampling parameters. A request's penalties are the runner's
constants (the same for every request), which keeps the model small; the mechanism does not need
them per request. No code was copied from the engine.
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
    max_num_reqs=8,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_LEN = SPEC.max_blocks_per_req * SPEC.block_size  # a request's longest sequence
ROWS = max(SPEC.capture_sizes)  # the slot grid the largest graph covers
NO_TOKEN = SPEC.vocab_size  # history padding: counted in a bin that is dropped
FREQUENCY_PENALTY, PRESENCE_PENALTY = 0.7, 0.4
_M32 = 0xFFFFFFFF


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_LEN, HIDDEN),
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
        for name in sorted(self.t):  # in place: the captured graphs read these tensors
            w = self.t[name]
            w.copy_(
                (torch.randn(w.shape, generator=gen) * 2.0 / math.sqrt(w.shape[0])).to(w.device)
            )


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def penalize_and_sample(
    logits: Tensor, history: Tensor, seeds: Tensor, last_pos: Tensor, sampled: Tensor, temps: Tensor
) -> tuple[Tensor, Tensor]:
    """Row-wise: penalties from the row's token history, then greedy or Gumbel-max per row."""
    ones = torch.ones_like(history, dtype=torch.float32)
    counts = torch.zeros(history.shape[0], SPEC.vocab_size + 1, device=logits.device)
    counts = counts.scatter_add(1, history, ones)[:, : SPEC.vocab_size]
    logits = logits - FREQUENCY_PENALTY * counts - PRESENCE_PENALTY * (counts > 0).float()
    key = _mix(_mix(seeds & _M32) ^ ((last_pos * 0x9E3779B1) & _M32))
    ids = torch.arange(SPEC.vocab_size, device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return logits, torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class SlotGridPenaltyRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, pack_history: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.pack_history = SPEC, mode, pack_history
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        # host bookkeeping, the same on every twin: token history per request, slot per request
        self.histories: dict[int, list[int]] = {}
        self.slot_of: dict[int, int] = {}
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            i64 = dict(dtype=torch.int64, device=dev)
            self.buffers = {
                "tokens": torch.zeros(ROWS, **i64),
                "positions": torch.zeros(ROWS, **i64),
                "slot_mapping": torch.zeros(ROWS, **i64),
                "block_tables": torch.zeros(ROWS, SPEC.max_blocks_per_req, **i64),
                "history": torch.zeros(ROWS, MAX_LEN, **i64),
                "seeds": torch.zeros(ROWS, **i64),
                "temperatures": torch.ones(ROWS, device=dev),
                "sampled": torch.zeros(ROWS, dtype=torch.bool, device=dev),
            }
            self.capture()

    # -- model ------------------------------------------------------------------------------------

    def forward(self, tokens: Tensor, pos: Tensor, slots: Tensor, tables: Tensor) -> Tensor:
        """Hidden states of every token; keys and values are stored before they are read."""
        w = self.w.t
        x = w["embed"][tokens] + w["pos"][pos]
        h = _norm(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, (h @ w["wk"]).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, (h @ w["wv"]).view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(SPEC.block_size, device=tokens.device)
        ctx = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, MAX_LEN] slots
        ctx_pos = torch.arange(MAX_LEN, device=tokens.device)
        visible = ctx_pos[None, :] <= pos[:, None]
        keys, vals = self.k_cache[ctx], self.v_cache[ctx]  # [T, MAX_LEN, H, D]
        zero = torch.zeros((), device=tokens.device)
        # masked slots may hold anything (NaN in the null block): select, never multiply
        keys = torch.where(visible[:, :, None, None], keys, zero)
        vals = torch.where(visible[:, :, None, None], vals, zero)
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), -math.inf, device=q.device)
        )
        attn = torch.einsum("thc,tchd->thd", scores.softmax(-1), vals).flatten(1)
        x = x + attn @ w["wo"]
        return x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]

    def head(self, hidden: Tensor) -> Tensor:
        return _norm(hidden) @ self.w.t["head"]

    # -- graphs -----------------------------------------------------------------------------------

    def run_rows(self, size: int) -> tuple[Tensor, Tensor]:
        b = {name: t[:size] for name, t in self.buffers.items()}
        hidden = self.forward(b["tokens"], b["positions"], b["slot_mapping"], b["block_tables"])
        return penalize_and_sample(
            self.head(hidden),
            b["history"],
            b["seeds"],
            b["positions"],
            b["sampled"],
            b["temperatures"],
        )

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.stage({}, [], [])  # every row padding during warm-up and capture
            self.run_rows(size)  # warm-up outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self.run_rows(size)
            self.graphs[size] = graph

    def stage(
        self, rows: dict[int, Request], reqs: Sequence[Request], packed: list[list[int]]
    ) -> None:
        """Write every row of the static buffers: a slot's request, or padding for a hole.

        `packed` holds the histories of `reqs` in batch order, as the history helper returns them.
        """
        null = SPEC.null_block
        tokens, positions, slot_mapping, seeds = (
            [0] * ROWS,
            [0] * ROWS,
            [null * SPEC.block_size] * ROWS,
            [0] * ROWS,
        )
        tables = [[null] * SPEC.max_blocks_per_req for _ in range(ROWS)]
        temps, sampled = [1.0] * ROWS, [False] * ROWS
        history = [[NO_TOKEN] * MAX_LEN for _ in range(ROWS)]
        for row, r in rows.items():
            tokens[row], positions[row] = r.tokens[0], r.context_len
            slot_mapping[row] = kv_slot(r.block_ids, r.context_len, SPEC.block_size)
            tables[row][: len(r.block_ids)] = list(r.block_ids)
            seeds[row] = 0 if r.seed is None else r.seed & _M32
            temps[row], sampled[row] = r.temperature, r.seed is not None
        if self.pack_history:  # the bug: row i holds the i-th request's history, not its slot's
            for i, h in enumerate(packed):
                history[i] = _padded(h)
        else:  # the fix: scatter each request's history to the row of its slot
            by_request = {id(r): h for r, h in zip(reqs, packed, strict=True)}
            for row, r in rows.items():
                history[row] = _padded(by_request[id(r)])
        values = {
            "tokens": tokens,
            "positions": positions,
            "slot_mapping": slot_mapping,
            "block_tables": tables,
            "history": history,
            "seeds": seeds,
            "temperatures": temps,
            "sampled": sampled,
        }
        for name, value in values.items():
            buf = self.buffers[name]
            buf.copy_(torch.tensor(value, dtype=buf.dtype).to(self.device))

    # -- steps ------------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        reqs = batch.requests
        packed = [self.record_history(r) for r in reqs]
        slots = self.assign_slots(reqs)
        if not reqs:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        if self.mode == "eager":
            return self.run_eager(reqs, packed, "eager twin")
        reason = self.fallback_reason(reqs, slots)
        if reason is not None:
            return self.run_eager(reqs, packed, reason)
        span = max(slots) + 1
        size = next(s for s in SPEC.capture_sizes if s >= span)
        self.stage({slot: r for slot, r in zip(slots, reqs, strict=True)}, reqs, packed)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return StepResult(logits[index].clone(), tokens[index].clone(), "full", ("slots", size))

    def fallback_reason(self, reqs: Sequence[Request], slots: Sequence[int]) -> str | None:
        if any(len(r.tokens) != 1 for r in reqs):
            return "not a one-token decode batch"
        if max(slots) + 1 > ROWS:
            return "slot span above the largest graph"
        return None

    def record_history(self, r: Request) -> list[int]:
        """The request's tokens up to its last query token, kept from its own batches."""
        kept = [] if r.context_len == 0 else self.histories.get(r.req_id, [])[: r.context_len]
        self.histories[r.req_id] = kept + list(r.tokens)
        return self.histories[r.req_id]

    def assign_slots(self, reqs: Sequence[Request]) -> list[int]:
        keep = {
            r.req_id: self.slot_of[r.req_id]
            for r in reqs
            if r.context_len > 0 and r.req_id in self.slot_of
        }
        self.slot_of = dict(keep)  # slots of requests this step leaves out (or restarts) free up
        taken = set(keep.values())
        for r in reqs:
            if r.req_id not in self.slot_of:
                free = next(s for s in range(SPEC.max_num_reqs) if s not in taken)
                self.slot_of[r.req_id] = free
                taken.add(free)
        return [self.slot_of[r.req_id] for r in reqs]

    def run_eager(
        self, reqs: Sequence[Request], packed: list[list[int]], reason: str
    ) -> StepResult:
        dev = self.device
        tok = [t for r in reqs for t in r.tokens]
        pos = [r.context_len + i for r in reqs for i in range(len(r.tokens))]
        slots = [
            kv_slot(r.block_ids, p, SPEC.block_size)
            for r in reqs
            for p in range(r.context_len, r.seq_len)
        ]
        tables = []
        for r in reqs:
            row = list(r.block_ids) + [SPEC.null_block] * (
                SPEC.max_blocks_per_req - len(r.block_ids)
            )
            tables += [row] * len(r.tokens)
        last = torch.tensor(
            [sum(len(q.tokens) for q in reqs[: i + 1]) - 1 for i in range(len(reqs))], device=dev
        )
        hidden = self.forward(
            torch.tensor(tok, device=dev),
            torch.tensor(pos, device=dev),
            torch.tensor(slots, device=dev),
            torch.tensor(tables, device=dev),
        )
        logits, tokens = penalize_and_sample(
            self.head(hidden[last]),
            torch.tensor([_padded(h) for h in packed], device=dev),
            torch.tensor([0 if r.seed is None else r.seed & _M32 for r in reqs], device=dev),
            torch.tensor([r.seq_len - 1 for r in reqs], device=dev),
            torch.tensor([r.seed is not None for r in reqs], device=dev),
            torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev),
        )
        return StepResult(logits, tokens, "eager", None, reason)

    # -- contract ---------------------------------------------------------------------------------

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


def _padded(history: list[int]) -> list[int]:
    return history + [NO_TOKEN] * (MAX_LEN - len(history))


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SlotGridPenaltyRunner:
    return SlotGridPenaltyRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SlotGridPenaltyRunner:
    return SlotGridPenaltyRunner(mode, seed=seed, backend=backend, pack_history=True)
