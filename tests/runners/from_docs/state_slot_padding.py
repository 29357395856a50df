"""A hybrid graph runner: one attention layer over a paged KV cache plus one recurrent layer.

The recurrent layer (a gated linear recurrence, Mamba-like: s = a(x) * s + (1 - a(x)) * b(x),
output read from s) keeps one running state per request in a runner-owned tensor of
`max_num_reqs + 1` state slots. The runner hands each live request a slot (by req_id), zeroes
it when the request starts or restarts its prompt, and frees it when another request lists one
of its blocks (it finished or was preempted). A step gathers and scatters the states of its rows
through a per-row slot index. The last slot is a dummy for padding rows: the recurrence skips rows whose index is
the dummy slot (as hybrid engines' kernels skip PAD_SLOT_ID rows).

Graph mode (written against the backend facade) captures one decode graph per capture size,
largest first into one pool; any other batch runs eagerly.

`make_buggy_target`: padding rows get state slot 0, which is also handed out to live requests, so
a padded replay advances that request's recurrent state with the padding row's token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=16,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=128,
    # Every started, unfinished request holds a block, so at most num_blocks - 1 are alive at
    # once (the harness may keep more alive than one batch holds): one state slot each.
    max_num_reqs=15,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
STATE_SLOTS = SPEC.max_num_reqs + 1  # one per request the runner may hold, plus the dummy
DUMMY_STATE = SPEC.max_num_reqs  # the padding rows' state slot: never handed to a request
_MASK32 = 0xFFFFFFFF


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] KV slot each token writes
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    state_idx: Tensor  # [R] recurrent state slot of each row
    last: Tensor | None = None  # [R] each request's last token (None: decode, T == R)
    waves: list[tuple[Tensor, Tensor]] | None = None  # eager scan: (token rows, state slots)


class HybridModel:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "gate": (HIDDEN, HIDDEN),
            "inp": (HIDDEN, HIDDEN),
            "out": (HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(weight.device))

    def forward(self, inputs: Inputs, k_cache: Tensor, v_cache: Tensor, state: Tensor) -> Tensor:
        w = self.weights
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, inputs.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, inputs.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + _attention(q, k_cache, v_cache, inputs) @ w["o"]
        h = _rms(x)
        gate = torch.sigmoid(h @ w["gate"])  # [T, hidden]
        drive = (1 - gate) * (h @ w["inp"])
        if inputs.waves is None:  # decode: one token per row, one wave
            new = _recur(state, inputs.state_idx, gate, drive)
        else:  # eager: the j-th query token of every request, wave by wave
            new = torch.empty_like(drive)
            for rows, idx in inputs.waves:
                new[rows] = _recur(state, idx, gate[rows], drive[rows])
        x = x + new @ w["out"]
        if inputs.last is not None:
            x = x[inputs.last]
        return _rms(x) @ w["head"]


def _recur(state: Tensor, idx: Tensor, gate: Tensor, drive: Tensor) -> Tensor:
    """One recurrence step for rows `idx` of `state`; rows at the dummy slot leave it as it was."""
    old = state[idx]
    new = gate * old + drive
    live = (idx != DUMMY_STATE)[:, None]
    state.index_copy_(0, idx, torch.where(live, new, old))
    return new


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: Inputs) -> Tensor:
    size = SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    context = (inputs.tables[:, :, None] * size + offsets).flatten(1)  # [T, CONTEXT]
    keys, values = k_cache[context], v_cache[context]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inputs.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def sample(logits: Tensor, inputs: Inputs) -> Tensor:
    """Gumbel-max with noise from a hash of (seed, position, token id)."""
    positions = inputs.positions if inputs.last is None else inputs.positions[inputs.last]
    key = _hash(_hash(inputs.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inputs.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inputs.sampled, noisy.argmax(-1), logits.argmax(-1))


@dataclass
class _Entry:
    slot: int
    next_pos: int  # the context_len its next step must have
    blocks: tuple[int, ...]


class StateSlots:
    """req_id -> recurrent state slot. Host bookkeeping only; the states live in `state()`.

    No call says a request finished; a block listed by another request says it did (or was
    preempted): a live request's blocks are its own. Such an entry's slot is freed.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.entries: dict[int, _Entry] = {}
        self.owner: dict[int, int] = {}  # block -> req_id of the entry that last listed it

    def assign(self, requests: Sequence[Request]) -> tuple[list[int], list[int]]:
        """Each row's slot, and the slots to zero (requests starting or restarting a prompt)."""
        for r in requests:
            for block in r.block_ids:
                holder = self.owner.get(block)
                if holder is not None and holder != r.req_id:
                    self._drop(holder)
        slots, fresh = [], []
        for r in requests:
            entry = self.entries.get(r.req_id)
            if r.context_len == 0:
                slot = entry.slot if entry is not None else self._take()
                fresh.append(slot)
            elif entry is None or entry.next_pos != r.context_len:
                raise RuntimeError(
                    f"request {r.req_id} continues at {r.context_len} but its recurrent state "
                    f"is {'gone' if entry is None else f'at {entry.next_pos}'}"
                )
            else:
                slot = entry.slot
            if entry is not None:
                for block in entry.blocks:
                    self.owner.pop(block, None)
            self.entries[r.req_id] = _Entry(slot, r.seq_len, tuple(r.block_ids))
            for block in r.block_ids:
                self.owner[block] = r.req_id
            slots.append(slot)
        return slots, fresh

    def _drop(self, req_id: int) -> None:
        entry = self.entries.pop(req_id, None)
        if entry is not None:
            for block in entry.blocks:
                if self.owner.get(block) == req_id:
                    del self.owner[block]

    def _take(self) -> int:
        used = {e.slot for e in self.entries.values()}
        free = [s for s in range(self.slots) if s not in used]
        if not free:
            raise RuntimeError("no free recurrent state slot")
        return free[0]


class HybridRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, pad_state: int
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.model = HybridModel(seed, device)
        kv_shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(kv_shape, device=device)
        self.v_cache = torch.zeros(kv_shape, device=device)
        self.rstate = torch.zeros(STATE_SLOTS, HIDDEN, device=device)
        self.slots = StateSlots(SPEC.max_num_reqs)
        self.padding = {
            "tokens": 0,
            "positions": 0,
            "slots": NULL_SLOT,
            "tables": SPEC.null_block,
            "seeds": 0,
            "temperatures": 1.0,
            "sampled": False,
            "state_idx": pad_state,
        }
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.buffers = self.allocate(SPEC.capture_sizes[-1])
            self.capture()

    # -- graph mode -------------------------------------------------------------------------------

    def allocate(self, rows: int) -> dict[str, Tensor]:
        device, i64 = self.backend.device, torch.int64
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=device),
            "positions": torch.zeros(rows, dtype=i64, device=device),
            "slots": torch.zeros(rows, dtype=i64, device=device),
            "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=device),
            "seeds": torch.zeros(rows, dtype=i64, device=device),
            "temperatures": torch.ones(rows, device=device),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
            "state_idx": torch.zeros(rows, dtype=i64, device=device),
        }

    def static_inputs(self, size: int) -> Inputs:
        return Inputs(**{name: buf[:size] for name, buf in self.buffers.items()})

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare([], [], size)
            inputs = self.static_inputs(size)
            self.run_model(inputs)  # warm-up
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(inputs)
            self.graphs[size] = graph
        # The warm-up ran padding rows through the model: start from clean caches.
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.rstate.zero_()

    def prepare(self, requests: Sequence[Request], state_slots: list[int], size: int) -> None:
        n = len(requests)
        rows = _decode_rows(requests)
        rows["state_idx"] = state_slots
        for name, buffer in self.buffers.items():
            if n:
                buffer[:n].copy_(torch.tensor(rows[name], dtype=buffer.dtype))
            buffer[n:size].fill_(self.padding[name])

    def replay(self, batch: Batch, state_slots: list[int]) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch.requests, state_slots, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes -------------------------------------------------------------------------------

    def run_model(self, inputs: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.k_cache, self.v_cache, self.rstate)
        return logits, sample(logits, inputs)

    def run_eager(self, batch: Batch, state_slots: list[int], fresh: list[int], reason: str):
        device = self.backend.device
        if fresh:
            self.rstate.index_fill_(0, torch.tensor(fresh, device=device), 0.0)
        inputs = _eager_inputs(batch, state_slots, device)
        logits, tokens = self.run_model(inputs)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "query length > 1"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        state_slots, fresh = self.slots.assign(batch.requests)
        reason = self.fallback_reason(batch)
        if reason is None and not fresh:
            return self.replay(batch, state_slots)
        return self.run_eager(batch, state_slots, fresh, reason or "starts a prompt")

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache, "recurrent": self.rstate}

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


def _kv_slot(request: Request, position: int) -> int:
    block = request.block_ids[position // SPEC.block_size]
    return block * SPEC.block_size + position % SPEC.block_size


def _table(request: Request) -> list[int]:
    return list(request.block_ids) + [SPEC.null_block] * (
        SPEC.max_blocks_per_req - len(request.block_ids)
    )


def _sampling(request: Request) -> tuple[int, float, bool]:
    if request.seed is None:
        return 0, 1.0, False
    return request.seed & _MASK32, request.temperature, True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    sampling = [_sampling(r) for r in requests]
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_kv_slot(r, r.context_len) for r in requests],
        "tables": [_table(r) for r in requests],
        "seeds": [s[0] for s in sampling],
        "temperatures": [s[1] for s in sampling],
        "sampled": [s[2] for s in sampling],
    }


def _eager_inputs(batch: Batch, state_slots: list[int], device: torch.device) -> Inputs:
    tokens, positions, slots, tables, last = [], [], [], [], []
    waves: list[tuple[list[int], list[int]]] = []
    for request, state_slot in zip(batch.requests, state_slots, strict=True):
        for i, token in enumerate(request.tokens):
            if i == len(waves):
                waves.append(([], []))
            waves[i][0].append(len(tokens))
            waves[i][1].append(state_slot)
            tokens.append(token)
            positions.append(request.context_len + i)
            slots.append(_kv_slot(request, request.context_len + i))
            tables.append(_table(request))
        last.append(len(tokens) - 1)
    sampling = [_sampling(r) for r in batch.requests]

    def tensor(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return Inputs(
        tokens=tensor(tokens),
        positions=tensor(positions),
        slots=tensor(slots),
        tables=tensor(tables).view(-1, SPEC.max_blocks_per_req),
        seeds=tensor([s[0] for s in sampling]),
        temperatures=tensor([s[1] for s in sampling], torch.float32),
        sampled=tensor([s[2] for s in sampling], torch.bool),
        state_idx=tensor(state_slots),
        last=tensor(last),
        waves=[(tensor(rows), tensor(idx)) for rows, idx in waves],
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridRunner:
    return HybridRunner(mode, seed=seed, backend=backend, pad_state=DUMMY_STATE)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridRunner:
    # BUG: padding rows share state slot 0 with the request that holds it.
    return HybridRunner(mode, seed=seed, backend=backend, pad_state=0)
