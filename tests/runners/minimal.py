"""An independent minimal graph runner: the harness's second, correct target.

Written only against the backend facade and the target contract, so it shares no code with the
runtime it cross-checks. A one-layer decoder (embedding + learned positions, attention over a
slot-major paged KV cache read through block tables, a SiLU MLP, LM head) with counter-based
sampling. Graph mode captures one decode graph per capture size, largest first, into one shared
pool; a replay writes the batch into the static buffers' prefix, resets the padding rows to
sentinels that point at the null block, replays, and copies the results out. Any other batch runs
eagerly. Each stage is one small method so a variant with one realistic bug is a few lines.
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
HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 2, 16, 1
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size  # positions a request can reach
NULL_SLOT = SPEC.null_block * SPEC.block_size
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    """One step's device tensors. T tokens, R requests; `last` is None when T == R (decode)."""

    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] KV slot each token writes
    tables: Tensor  # [T, max_blocks_per_req] the block table of each token's request
    seeds: Tensor  # [R] sampling seed, reduced to 32 bits
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool: False = greedy
    last: Tensor | None = None  # [R] index of each request's last token


class TinyDecoder:
    """Weights and the forward pass; no host reads, so a whole step can be captured."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            **{f"{name}{i}": (HIDDEN, HIDDEN) for i in range(LAYERS) for name in "qkvo"},
            **{f"up{i}": (HIDDEN, 2 * HIDDEN) for i in range(LAYERS)},
            **{f"down{i}": (2 * HIDDEN, HIDDEN) for i in range(LAYERS)},
        }
        self.weights = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        """(Re)initialise in place: captured graphs keep reading the same tensors."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):  # a fixed order: same seed, same weights
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    def forward(self, inputs: StepInputs, kv: list[tuple[Tensor, Tensor]]) -> Tensor:
        w = self.weights
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]  # [T, hidden]
        for i, (k_cache, v_cache) in enumerate(kv):
            h = _rms(x)
            q, k, v = (h @ w[f"{n}{i}"] for n in "qkv")
            k_cache.index_copy_(0, inputs.slots, k.view(-1, HEADS, HEAD_DIM))
            v_cache.index_copy_(0, inputs.slots, v.view(-1, HEADS, HEAD_DIM))
            x = x + _attention(q, k_cache, v_cache, inputs) @ w[f"o{i}"]
            x = x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        if inputs.last is not None:
            x = x[inputs.last]  # [R, hidden]
        return _rms(x) @ w["head"]  # [R, vocab]


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
    # Masked slots may hold anything (NaN in the null block): 0 * NaN would leak it.
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)  # [T, hidden]


def sample(logits: Tensor, inputs: StepInputs) -> Tensor:
    """Gumbel-max from a hash of (seed, position, token id): the same request at the same position
    draws the same noise whatever batch or bucket it is in."""
    positions = inputs.positions if inputs.last is None else inputs.positions[inputs.last]
    key = _mix(_mix(inputs.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))  # [R]
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])  # [R, vocab]
    # 23 bits: every value, and the largest (1 - 2**-24), is exact in float32, so never 0 or 1.
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inputs.temperatures[:, None] - torch.log(-torch.log(uniform)).to(logits.dtype)
    return torch.where(inputs.sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash; every product stays below 2**63."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class MinimalRunner:
    """Implements the target contract; `mode="graph"` captures decode graphs at start-up."""

    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.model = TinyDecoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = [
            (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in range(LAYERS)
        ]
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
        }

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{name: buf[:size] for name, buf in self.buffers.items()})

    def capture(self) -> None:
        """Largest first into one pool, so smaller graphs reuse the largest one's memory."""
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)  # every row is padding during warm-up and capture
            inputs = self.static_inputs(size)
            self.run_model(inputs)  # warm-up outside the graph
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(inputs)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        """Write the batch into the buffers' prefix and reset the padding rows to sentinels."""
        n = batch.num_reqs
        rows = _decode_rows(batch.requests)
        for name, values in rows.items():
            buffer = self.buffers[name]
            if n:
                buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype))
            buffer[n:size].fill_(_PADDING[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes -------------------------------------------------------------------------------

    def run_model(self, inputs: StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv)
        return logits, sample(logits, inputs)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        logits, tokens = self.run_model(_eager_inputs(batch, self.backend.device))
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        """Why `batch` cannot replay a graph; None when it can."""
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode (query length > 1)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{kind}{i}": kv[j] for i, kv in enumerate(self.kv) for j, kind in enumerate("kv")}

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
    "slots": NULL_SLOT,  # padding may write the null block and nothing else
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(request: Request, position: int) -> int:
    block = request.block_ids[position // SPEC.block_size]
    return block * SPEC.block_size + position % SPEC.block_size


def _table(request: Request) -> list[int]:
    blocks = list(request.block_ids)
    return blocks + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(blocks))


def _sampling(request: Request) -> tuple[int, float, bool]:
    if request.seed is None or request.temperature <= 0:
        return 0, 1.0, False
    return request.seed & _MASK32, request.temperature, True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    """Per-row host values of a decode batch (one query token per request)."""
    sampling = [_sampling(r) for r in requests]
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_slot(r, r.context_len) for r in requests],
        "tables": [_table(r) for r in requests],
        "seeds": [s[0] for s in sampling],
        "temperatures": [s[1] for s in sampling],
        "sampled": [s[2] for s in sampling],
    }


def _eager_inputs(batch: Batch, device: torch.device) -> StepInputs:
    tokens, positions, slots, tables, last = [], [], [], [], []
    for request in batch.requests:
        for i, token in enumerate(request.tokens):
            tokens.append(token)
            positions.append(request.context_len + i)
            slots.append(_slot(request, request.context_len + i))
            tables.append(_table(request))
        last.append(len(tokens) - 1)
    sampling = [_sampling(r) for r in batch.requests]

    def tensor(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return StepInputs(
        tokens=tensor(tokens),
        positions=tensor(positions),
        slots=tensor(slots),
        tables=tensor(tables).view(-1, SPEC.max_blocks_per_req),
        seeds=tensor([s[0] for s in sampling]),
        temperatures=tensor([s[1] for s in sampling], torch.float32),
        sampled=tensor([s[2] for s in sampling], torch.bool),
        last=tensor(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> MinimalRunner:
    return MinimalRunner(mode, seed=seed, backend=backend)
