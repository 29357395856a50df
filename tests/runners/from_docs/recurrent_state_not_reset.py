"""A graph runner with a hybrid model whose recurrent state lives in slots handed out per request.

The model: token embedding plus learned positions, one attention block over a slot-major paged KV
cache read through block tables (with a SiLU MLP), then one recurrent block in the manner of a
Mamba or linear-attention layer: each request owns a row of a state pool `[state slots, d]`,
updated once a token as `s = a * s + (1 - a) * u` (`a` a data-dependent decay, `u` an input
projection), whose output joins the residual stream before the LM head. The runner hands the state
slots out itself, from a free list: a slot is released when its request starts again
(`context_len` 0: preempted and recomputing) or when another request lists one of its KV blocks
(its owner finished or was preempted, since live requests never share a block). Graph mode
captures one decode graph per capture size at start-up, largest first, into one shared pool, for
batches of one-token rows (new one-token prompts too); the gather of each row's state by its slot,
the update and the scatter back are inside the graph, and a row's "has initial state" flag is a
static buffer written before every replay. Padding rows point at a dummy state slot that the graph
leaves alone. Prefill, mixed and oversized batches run eagerly, with the same flag.

    make_target:        every request that starts (`context_len` 0: new, or preempted and
                        recomputing) runs with its "has initial state" flag off, so its state slot
                        is read as zeros and overwritten, whoever held the slot before.
    make_buggy_target:  the graph twin clears the flag only for a slot handed out for the first
                        time, trusting a never-used slot to be zero; a slot recycled from a finished
                        or preempted request still holds that request's state, which the new
                        occupant's first token then decays into its own. Nothing on the device
                        clears freed memory, so the new request silently continues someone else's
                        sequence. The eager twin, which keys the reset on the request, resets.
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
HIDDEN, HEADS, HEAD_DIM, STATE_DIM = 32, 2, 16, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
# Every request the runner holds a state slot for owns at least one KV block that no other holder
# lists (a holder is released as soon as another request lists one of its blocks), so the pool
# never runs dry with one slot per allocatable block.
STATE_SLOTS = SPEC.num_blocks - 1
PAD_STATE = STATE_SLOTS  # the dummy row padding points at, after the allocatable ones
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    """One step's device tensors. T tokens, R requests, Q the longest query."""

    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] KV slot each token writes
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    state_slots: Tensor  # [R] each request's row of the state pool; PAD_STATE for padding
    has_state: Tensor  # [R] bool: False = start from zeros
    steps: Tensor | None = None  # [R, Q] row of each request's j-th token, clamped to its last
    step_valid: Tensor | None = None  # [R, Q] bool: j < the request's query length


class HybridDecoder:
    """Weights and the forward pass; no host reads, so a decode step can be captured whole."""

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            **{name: (HIDDEN, HIDDEN) for name in "qkvo"},
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "in": (HIDDEN, STATE_DIM),
            "decay": (HIDDEN, STATE_DIM),
            "out": (STATE_DIM, HIDDEN),
        }
        self.weights = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.device = device
        self.load(seed)

    def load(self, seed: int) -> None:
        """(Re)initialise in place: captured graphs keep reading the same tensors."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    def forward(self, inputs: StepInputs, kv: tuple[Tensor, Tensor], pool: Tensor) -> Tensor:
        w = self.weights
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]  # [T, hidden]
        h = _rms(x)
        q, k, v = (h @ w[n] for n in "qkv")
        kv[0].index_copy_(0, inputs.slots, k.view(-1, HEADS, HEAD_DIM))
        kv[1].index_copy_(0, inputs.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + _attention(q, kv[0], kv[1], inputs) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        x = x + self.recur(_rms(x), inputs, pool) @ w["out"]
        last = x if inputs.steps is None else x[inputs.steps[:, -1]]  # [R, hidden]
        return _rms(last) @ w["head"]  # [R, vocab]

    def recur(self, h: Tensor, inputs: StepInputs, pool: Tensor) -> Tensor:
        """The scan over each request's query tokens, from its state slot and back into it."""
        u = h @ self.weights["in"]  # [T, d]
        a = torch.sigmoid(h @ self.weights["decay"] + 2.0)  # [T, d], decays near 0.9
        rows = inputs.state_slots.shape[0]
        if inputs.steps is None:  # decode: row r is token r
            steps = torch.arange(rows, device=h.device)[:, None]
            valid = torch.ones(rows, 1, dtype=torch.bool, device=h.device)
        else:
            steps, valid = inputs.steps, inputs.step_valid
            assert valid is not None
        old = pool[inputs.state_slots]  # [R, d]
        state = torch.where(inputs.has_state[:, None], old, torch.zeros((), device=h.device))
        out = torch.empty_like(u)
        for j in range(steps.shape[1]):
            t = steps[:, j]
            state = torch.where(valid[:, j, None], a[t] * state + (1 - a[t]) * u[t], state)
            out.index_copy_(0, t, state)
        # Padding rows share the dummy slot: they store what they read, so it never changes.
        live = (inputs.state_slots != PAD_STATE)[:, None]
        pool.index_copy_(0, inputs.state_slots, torch.where(live, state, old))
        return out


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: StepInputs) -> Tensor:
    size = SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    context = (inputs.tables[:, :, None] * size + offsets).flatten(1)  # [T, CONTEXT] slots
    keys, values = k_cache[context], v_cache[context]  # [T, CONTEXT, heads, dim]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inputs.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    # Masked slots may hold NaN (the null block): 0 * NaN would leak it.
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)  # [T, hidden]


def sample(logits: Tensor, inputs: StepInputs) -> Tensor:
    """Gumbel-max from a hash of (seed, position, token id): independent of batch and bucket."""
    positions = inputs.positions if inputs.steps is None else inputs.positions[inputs.steps[:, -1]]
    key = _mix(_mix(inputs.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))  # [R]
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])  # [R, vocab]
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inputs.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inputs.sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


@dataclass
class _Holder:
    slot: int
    blocks: tuple[int, ...]
    seq_len: int


@dataclass
class StateSlots:
    """Hands state slots out to requests. No call says a request finished, so a holder is released
    when its request starts again or another request lists one of its blocks."""

    reset_recycled: bool = True  # False: only a never-used slot starts from zeros (the bug)
    free: list[int] = field(default_factory=lambda: list(range(STATE_SLOTS - 1, -1, -1)))
    used: set[int] = field(default_factory=set)
    holders: dict[int, _Holder] = field(default_factory=dict)
    owners: dict[int, int] = field(default_factory=dict)  # KV block -> req_id

    def assign(self, requests: Sequence[Request]) -> list[tuple[int, bool]]:
        """(state slot, has initial state) per request, in batch order."""
        for request in requests:
            holder = self.holders.get(request.req_id)
            if holder is not None and request.context_len == 0:
                self.release(request.req_id)
            for block in request.block_ids:
                owner = self.owners.get(block, request.req_id)
                if owner != request.req_id:
                    self.release(owner)
        return [self.hold(request) for request in requests]

    def hold(self, request: Request) -> tuple[int, bool]:
        holder = self.holders.get(request.req_id)
        if holder is None:
            if request.context_len:
                raise ValueError(
                    f"request {request.req_id} continues at context_len {request.context_len} "
                    "but holds no recurrent state"
                )
            slot = self.free.pop()  # the latest released first, as a free list does
            has_state = slot in self.used and not self.reset_recycled
            self.used.add(slot)
            holder = self.holders[request.req_id] = _Holder(slot, (), 0)
        elif request.context_len != holder.seq_len or request.block_ids[: len(holder.blocks)] != (
            holder.blocks
        ):
            raise ValueError(
                f"request {request.req_id} continues at context_len {request.context_len} with "
                f"blocks {request.block_ids}; its state covers {holder.seq_len} tokens in "
                f"{holder.blocks}"
            )
        else:
            has_state = True
        holder.blocks, holder.seq_len = request.block_ids, request.seq_len
        self.owners.update(dict.fromkeys(request.block_ids, request.req_id))
        return holder.slot, has_state

    def release(self, req_id: int) -> None:
        holder = self.holders.pop(req_id)
        for block in holder.blocks:
            if self.owners.get(block) == req_id:
                del self.owners[block]
        self.free.append(holder.slot)


class HybridRunner:
    """Implements the target contract; `mode="graph"` captures decode graphs at start-up."""

    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, buggy: bool = False
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.model = HybridDecoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
        self.pool = torch.zeros(STATE_SLOTS + 1, STATE_DIM, device=device)
        self.slots = StateSlots(reset_recycled=not (buggy and mode == "graph"))
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.buffers = self.allocate_buffers(SPEC.capture_sizes[-1])
            self.capture()

    # -- graph mode -------------------------------------------------------------------------------

    def allocate_buffers(self, rows: int) -> dict[str, Tensor]:
        device, i64 = self.backend.device, torch.int64
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=device),
            "positions": torch.zeros(rows, dtype=i64, device=device),
            "slots": torch.zeros(rows, dtype=i64, device=device),
            "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=device),
            "seeds": torch.zeros(rows, dtype=i64, device=device),
            "temperatures": torch.ones(rows, device=device),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
            "state_slots": torch.full((rows,), PAD_STATE, dtype=i64, device=device),
            "has_state": torch.ones(rows, dtype=torch.bool, device=device),
        }

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare({}, 0, size)  # every row is padding during warm-up and capture
            inputs = StepInputs(**{name: buf[:size] for name, buf in self.buffers.items()})
            self.run_model(inputs)
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(inputs)
            self.graphs[size] = graph

    def prepare(self, rows: Mapping[str, list[Any]], n: int, size: int) -> None:
        """Write the batch into the buffers' prefix and reset the padding rows to sentinels."""
        for name, buffer in self.buffers.items():
            if n:
                buffer[:n].copy_(torch.tensor(rows[name], dtype=buffer.dtype))
            buffer[n:size].fill_(_PADDING[name])

    def replay(self, batch: Batch, state: list[tuple[int, bool]]) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        n = batch.num_reqs
        self.prepare(_decode_rows(batch.requests, state), n, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes -------------------------------------------------------------------------------

    def run_model(self, inputs: StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv, self.pool)
        return logits, sample(logits, inputs)

    def fallback_reason(self, batch: Batch) -> str | None:
        """Why `batch` cannot replay a graph; None when it can."""
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "a row with more than one query token"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        state = self.slots.assign(batch.requests)
        reason = self.fallback_reason(batch)
        if reason is None:
            return self.replay(batch, state)
        inputs = _eager_inputs(batch, state, self.backend.device)
        logits, tokens = self.run_model(inputs)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.kv[0], "v0": self.kv[1], "recurrent1": self.pool}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


_PADDING: dict[str, float | int | bool] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
    "state_slots": PAD_STATE,
    "has_state": True,
}


def _slot(request: Request, position: int) -> int:
    block = request.block_ids[position // SPEC.block_size]
    return block * SPEC.block_size + position % SPEC.block_size


def _table(request: Request) -> list[int]:
    blocks = list(request.block_ids)
    return blocks + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(blocks))


def _sampling(request: Request) -> tuple[int, float, bool]:
    if request.seed is None:
        return 0, 1.0, False
    return request.seed & _MASK32, request.temperature, True


def _row_values(requests: Sequence[Request], state: list[tuple[int, bool]]) -> dict[str, list]:
    sampling = [_sampling(r) for r in requests]
    return {
        "seeds": [s[0] for s in sampling],
        "temperatures": [s[1] for s in sampling],
        "sampled": [s[2] for s in sampling],
        "state_slots": [s[0] for s in state],
        "has_state": [s[1] for s in state],
    }


def _decode_rows(requests: Sequence[Request], state: list[tuple[int, bool]]) -> dict[str, list]:
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_slot(r, r.context_len) for r in requests],
        "tables": [_table(r) for r in requests],
        **_row_values(requests, state),
    }


def _eager_inputs(batch: Batch, state: list[tuple[int, bool]], device: torch.device) -> StepInputs:
    tokens, positions, slots, tables, starts = [], [], [], [], []
    for request in batch.requests:
        starts.append(len(tokens))
        for i, token in enumerate(request.tokens):
            tokens.append(token)
            positions.append(request.context_len + i)
            slots.append(_slot(request, request.context_len + i))
            tables.append(_table(request))
    longest = max(batch.query_lens, default=1)
    steps = [
        [s + min(j, q - 1) for j in range(longest)]
        for s, q in zip(starts, batch.query_lens, strict=True)
    ]
    valid = [[j < q for j in range(longest)] for q in batch.query_lens]

    def tensor(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    rows = _row_values(batch.requests, state)
    return StepInputs(
        tokens=tensor(tokens),
        positions=tensor(positions),
        slots=tensor(slots),
        tables=tensor(tables).view(-1, SPEC.max_blocks_per_req),
        seeds=tensor(rows["seeds"]),
        temperatures=tensor(rows["temperatures"], torch.float32),
        sampled=tensor(rows["sampled"], torch.bool),
        state_slots=tensor(rows["state_slots"]),
        has_state=tensor(rows["has_state"], torch.bool),
        steps=tensor(steps).view(-1, longest),
        step_valid=tensor(valid, torch.bool).view(-1, longest),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridRunner:
    return HybridRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridRunner:
    return HybridRunner(mode, seed=seed, backend=backend, buggy=True)
