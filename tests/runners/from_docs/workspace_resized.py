"""A graph runner whose attention gathers each row's keys and values into a scratch workspace.

The model is a one-layer decoder: token embedding plus learned positions, attention over a
slot-major paged KV cache read through block tables, a SiLU MLP and an LM head, float32, weights
drawn from the seed. Attention does not read the cache in place: it gathers every row's context
(rows x context slots) into a workspace the attention object owns, as FlashInfer-style wrappers
and engines' attention backends keep a buffer for the batch's gathered keys and values, and
attends over that. The workspace is scratch, rewritten by every step before it is read, so it is
neither state nor a static input. Graph mode captures one decode graph per capture size at
start-up, largest first, into one shared pool, keyed by the padded request count; each graph
gathers the full block-table width (the longest context), so it serves any context. A replay
writes the batch into the static buffers' prefix, resets the padding rows to the null block,
replays and clones the results out. Every batch with a query longer than one token, or more
requests than the largest graph, runs eagerly through the same attention and the same workspace,
gathering only as many block-table columns as its longest sequence needs.

    make_target:        the workspace is allocated once, before any capture, at its largest
                        size (max_num_tokens rows x the longest context), so no step ever
                        needs more and every graph keeps reading the tensor it was captured on.
    make_buggy_target:  the workspace is allocated lazily and, when an eager step (a long
                        prefill, a speculative step, an oversized decode batch) needs more rows
                        than it has, rebound to a new, larger tensor. The graphs captured before
                        hold the old tensor's address, not a reference: the old block returns to
                        the caching allocator, which hands it to the next tensors allocated, and
                        every later replay gathers keys and values into memory those tensors now
                        own (a result the caller holds, the next step's activations) and reads
                        them back from it, or faults once the segment is released.
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
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
BLOCK = SPEC.block_size
CONTEXT = SPEC.max_blocks_per_req * BLOCK
MAX_WORKSPACE_ROWS = SPEC.max_num_tokens * CONTEXT
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    """One step's device tensors: T query tokens, R requests (T == R on a decode graph)."""

    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] KV slot each token writes
    tables: Tensor  # [T, width] its request's block table, width blocks gathered
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] each request's last token; None when T == R


class Workspace:
    """Scratch rows for gathered keys and values, grown to the largest need met so far."""

    def __init__(self, device: torch.device, rows: int) -> None:
        self.device = device
        self.buffer = torch.empty(2, rows, HEADS, HEAD_DIM, device=device)

    def take(self, rows: int) -> tuple[Tensor, Tensor]:
        if rows > self.buffer.shape[1]:
            self.buffer = torch.empty(2, rows, HEADS, HEAD_DIM, device=self.device)
        return self.buffer[0, :rows], self.buffer[1, :rows]


class TinyDecoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.device = device
        self.weights = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        """In place, so the captured graphs read the new weights."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    def forward(self, inputs: StepInputs, kv: tuple[Tensor, Tensor], ws: Workspace) -> Tensor:
        w = self.weights
        k_cache, v_cache = kv
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]  # [T, hidden]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, inputs.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, inputs.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + _attention(q, k_cache, v_cache, inputs, ws) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if inputs.last is not None:
            x = x[inputs.last]  # [R, hidden]
        return _rms(x) @ w["head"]  # [R, vocab]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: StepInputs, ws: Workspace
) -> Tensor:
    rows, width = inputs.tables.shape
    context = width * BLOCK
    offsets = torch.arange(BLOCK, device=q.device)
    slots = (inputs.tables[:, :, None] * BLOCK + offsets).flatten()  # [rows * context]
    keys, values = ws.take(rows * context)
    torch.index_select(k_cache, 0, slots, out=keys)
    torch.index_select(v_cache, 0, slots, out=values)
    keys = keys.view(rows, context, HEADS, HEAD_DIM)
    values = values.view(rows, context, HEADS, HEAD_DIM)
    visible = torch.arange(context, device=q.device)[None, :] <= inputs.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    # A masked slot may hold NaN (the null block): zero it rather than multiply it by 0.
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)  # [rows, hidden]


def _sample(logits: Tensor, inputs: StepInputs) -> Tensor:
    """Gumbel-max on a hash of (seed, position, token id): no batch company, no generator."""
    positions = inputs.positions if inputs.last is None else inputs.positions[inputs.last]
    key = _mix(_mix(inputs.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24  # never 0 or 1
    noisy = logits / inputs.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inputs.sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class WorkspaceRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, lazy_workspace: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.model = TinyDecoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
        self.workspace = Workspace(device, 0 if lazy_workspace else MAX_WORKSPACE_ROWS)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.buffers = self._allocate_buffers(SPEC.capture_sizes[-1])
            self._capture()

    def _allocate_buffers(self, rows: int) -> dict[str, Tensor]:
        device, i64 = self.backend.device, torch.int64
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=device),
            "positions": torch.zeros(rows, dtype=i64, device=device),
            "slots": torch.zeros(rows, dtype=i64, device=device),
            "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=device),
            "seeds": torch.zeros(rows, dtype=i64, device=device),
            "temperatures": torch.ones(rows, device=device),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
        }

    def _static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{name: buf[:size] for name, buf in self.buffers.items()})

    def _capture(self) -> None:
        # Largest first: its warm-up sizes a lazy workspace for every graph after it.
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._prepare([], size)
            inputs = self._static_inputs(size)
            self._run_model(inputs)
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self._run_model(inputs)
            self.graphs[size] = graph

    def _prepare(self, requests: Sequence[Request], size: int) -> None:
        n = len(requests)
        for name, values in _decode_rows(requests).items():
            buffer = self.buffers[name]
            if n:
                buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype))
            buffer[n:size].fill_(_PADDING[name])

    def _run_model(self, inputs: StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv, self.workspace)
        return logits, _sample(logits, inputs)

    def _fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(n != 1 for n in batch.query_lens):
            return "a query longer than one token"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest graph"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self._fallback_reason(batch)
        if reason is not None:
            logits, tokens = self._run_model(_eager_inputs(batch, self.backend.device))
            return StepResult(logits, tokens, "eager", None, reason=reason)
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self._prepare(batch.requests, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.kv[0], "v0": self.kv[1]}

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
    "slots": SPEC.null_block * BLOCK,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(request: Request, position: int) -> int:
    return request.block_ids[position // BLOCK] * BLOCK + position % BLOCK


def _table(request: Request, width: int) -> list[int]:
    blocks = list(request.block_ids[:width])
    return blocks + [SPEC.null_block] * (width - len(blocks))


def _sampling(request: Request) -> tuple[int, float, bool]:
    if request.seed is None:
        return 0, 1.0, False
    return request.seed & _MASK32, request.temperature, True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    sampling = [_sampling(r) for r in requests]
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_slot(r, r.context_len) for r in requests],
        "tables": [_table(r, SPEC.max_blocks_per_req) for r in requests],
        "seeds": [s[0] for s in sampling],
        "temperatures": [s[1] for s in sampling],
        "sampled": [s[2] for s in sampling],
    }


def _eager_inputs(batch: Batch, device: torch.device) -> StepInputs:
    # Gather only the columns the longest sequence reaches, as a varlen kernel would.
    width = max(-(-r.seq_len // BLOCK) for r in batch.requests)
    tokens, positions, slots, tables, last = [], [], [], [], []
    for request in batch.requests:
        table = _table(request, width)
        for i, token in enumerate(request.tokens):
            tokens.append(token)
            positions.append(request.context_len + i)
            slots.append(_slot(request, request.context_len + i))
            tables.append(table)
        last.append(len(tokens) - 1)
    sampling = [_sampling(r) for r in batch.requests]

    def tensor(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return StepInputs(
        tokens=tensor(tokens),
        positions=tensor(positions),
        slots=tensor(slots),
        tables=tensor(tables),
        seeds=tensor([s[0] for s in sampling]),
        temperatures=tensor([s[1] for s in sampling], torch.float32),
        sampled=tensor([s[2] for s in sampling], torch.bool),
        last=tensor(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> WorkspaceRunner:
    return WorkspaceRunner(mode, seed=seed, backend=backend, lazy_workspace=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> WorkspaceRunner:
    return WorkspaceRunner(mode, seed=seed, backend=backend, lazy_workspace=True)
