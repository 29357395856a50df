"""A graph runner whose sampler skips the sampling kernels when a batch is all greedy.

The model is a two-layer decoder in float32 (token embedding plus learned positions, attention over
a paged KV cache exposed slot-major through `state()`, a GELU MLP, an LM head), with weights drawn
from the factory's seed. The sampler runs inside the decode graph, with per-batch flags as engines
keep them in their sampling metadata: `all_greedy` takes the argmax and skips the temperature
scaling and the noise, `all_random` skips the argmax and the select, and a mixed batch computes
both and picks per row. Noise is Gumbel-max from a hash of (seed, position, token id). Graph mode
captures a decode graph lazily, the first time a batch of one-token rows padded to a capture size
needs one: the batch is written into max-shape static buffers (padding rows point at the null
block), run once eagerly as a warm-up, captured into one shared pool and replayed; results are
copied out. Prefill, mixed and oversized batches run eagerly.

    make_target:        the graph key is (padded size, sampler mode), the mode being the
                        all-greedy / all-random / mixed flags of the batch, so a size gets up to
                        three graphs and each batch replays one captured with its own flags.
    make_buggy_target:  the graph key is the padded size alone, while the sampler's flags are
                        Python branches taken when the graph is captured, from the batch that
                        happened to trigger the capture. On a GPU the branch is not in the graph:
                        a graph captured for an all-greedy batch replays the argmax alone for a
                        later batch of that size with sampled rows (they come out greedy), and
                        one captured for an all-sampled batch samples a later greedy row by its
                        temperature and noise instead of taking its argmax.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 4, 8, 2
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
_MASK32 = 0xFFFFFFFF

SamplerMode = Literal["greedy", "random", "mixed"]


@dataclass
class StepInputs:
    """One step's device tensors: T tokens, R requests; `last` is None for one token a row."""

    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R] 32-bit
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R]


class Decoder:
    """Weights and a forward pass with no host reads, so a decode step can be captured whole."""

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        for i in range(LAYERS):
            shapes |= {f"qkv{i}": (HIDDEN, 3 * HIDDEN), f"out{i}": (HIDDEN, HIDDEN)}
            shapes |= {f"up{i}": (HIDDEN, 4 * HIDDEN), f"down{i}": (4 * HIDDEN, HIDDEN)}
        self.weights = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        """In place, so captured graphs read the new values."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(weight.device))

    def forward(self, inputs: StepInputs, kv: list[tuple[Tensor, Tensor]]) -> Tensor:
        w = self.weights
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]  # [T, hidden]
        for i, (k_cache, v_cache) in enumerate(kv):
            q, k, v = (_norm(x) @ w[f"qkv{i}"]).split(HIDDEN, dim=-1)
            k_cache.index_copy_(0, inputs.slots, k.reshape(-1, HEADS, HEAD_DIM))
            v_cache.index_copy_(0, inputs.slots, v.reshape(-1, HEADS, HEAD_DIM))
            x = x + _paged_attention(q, k_cache, v_cache, inputs) @ w[f"out{i}"]
            x = x + torch.nn.functional.gelu(_norm(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        if inputs.last is not None:
            x = x[inputs.last]  # [R, hidden]
        return _norm(x) @ w["head"]  # [R, vocab]


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: StepInputs) -> Tensor:
    offsets = torch.arange(SPEC.block_size, device=q.device)
    slots = (inputs.tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT]
    keys, values = k_cache[slots], v_cache[slots]  # [T, CONTEXT, heads, dim]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inputs.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    # The null block holds NaN for padding's sake; a zero probability times NaN is still NaN.
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)  # [T, hidden]


def sample(logits: Tensor, inputs: StepInputs, mode: SamplerMode) -> Tensor:
    """The fast paths are Python branches: whatever `mode` is at capture is what the graph holds."""
    greedy = logits.argmax(-1)
    if mode == "greedy":
        return greedy
    positions = inputs.positions if inputs.last is None else inputs.positions[inputs.last]
    key = _fmix(_fmix(inputs.seeds) ^ ((positions * 0x27D4EB2F) & _MASK32))  # [R]
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _fmix(key[:, None] ^ ((ids * 0x165667B1) & _MASK32)[None, :])  # [R, vocab]
    uniform = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25  # in (0, 1), exact
    gumbel = -torch.log(-torch.log(uniform))
    randomly = (logits / inputs.temperatures[:, None] + gumbel).argmax(-1)
    if mode == "random":
        return randomly
    return torch.where(inputs.sampled, randomly, greedy)


def _fmix(x: Tensor) -> Tensor:
    """murmur3's 32-bit finaliser on int64; products wrap, and the mask keeps the low 32 bits."""
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _MASK32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def sampler_mode(batch: Batch) -> SamplerMode:
    sampled = [r.seed is not None for r in batch.requests]
    if not any(sampled):
        return "greedy"
    return "random" if all(sampled) else "mixed"


class LazyGraphRunner:
    """Implements the target contract; `mode="graph"` captures decode graphs on first use."""

    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, key_by_size: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.key_by_size = key_by_size
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.model = Decoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = [
            (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in range(LAYERS)
        ]
        self.graphs: dict[Hashable, Any] = {}
        self.outputs: dict[Hashable, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        self.pool: Any = None
        if mode == "graph":
            self.buffers = self.allocate_buffers(SPEC.capture_sizes[-1])
            self.pool = self.backend.graph_pool_handle()

    def allocate_buffers(self, rows: int) -> dict[str, Tensor]:
        device, i64 = self.backend.device, torch.int64
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=device),
            "positions": torch.zeros(rows, dtype=i64, device=device),
            "slots": torch.full((rows,), NULL_SLOT, dtype=i64, device=device),
            "tables": torch.full((rows, SPEC.max_blocks_per_req), SPEC.null_block, device=device),
            "seeds": torch.zeros(rows, dtype=i64, device=device),
            "temperatures": torch.ones(rows, device=device),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
        }

    # -- graph mode -------------------------------------------------------------------------------

    def graph_key(self, size: int, mode: SamplerMode) -> Hashable:
        return ("decode", size) if self.key_by_size else ("decode", size, mode)

    def capture(self, key: Hashable, size: int, mode: SamplerMode) -> None:
        """With the step's batch already in the buffers: warm up, then record into the pool."""
        inputs = self.static_inputs(size)
        self.run_model(inputs, mode)
        self.backend.synchronize()
        graph = self.backend.Graph()
        with self.backend.graph(graph, pool=self.pool):
            self.outputs[key] = self.run_model(inputs, mode)
        self.graphs[key] = graph

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{name: buffer[:size] for name, buffer in self.buffers.items()})

    def prepare(self, batch: Batch, size: int) -> None:
        """Every row a graph reads is rewritten: the batch in the prefix, sentinels after it."""
        n = batch.num_reqs
        for name, values in _decode_rows(batch.requests).items():
            buffer = self.buffers[name]
            buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype))
            buffer[n:size].fill_(_PADDING[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        mode = sampler_mode(batch)
        key = self.graph_key(size, mode)
        self.prepare(batch, size)
        if key not in self.graphs:
            self.capture(key, size, mode)
        self.graphs[key].replay()
        logits, tokens = self.outputs[key]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", key)

    # -- both modes -------------------------------------------------------------------------------

    def run_model(self, inputs: StepInputs, mode: SamplerMode) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv)
        return logits, sample(logits, inputs, mode)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "a row with more than one query token"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more rows than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            return self.replay(batch)
        inputs = _eager_inputs(batch, self.backend.device)
        logits, tokens = self.run_model(inputs, sampler_mode(batch))
        return StepResult(logits, tokens, "eager", None, reason=reason)

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
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(request: Request, position: int) -> int:
    return request.block_ids[position // SPEC.block_size] * SPEC.block_size + (
        position % SPEC.block_size
    )


def _table(request: Request) -> list[int]:
    return list(request.block_ids) + [SPEC.null_block] * (
        SPEC.max_blocks_per_req - len(request.block_ids)
    )


def _sampling(request: Request) -> tuple[int, float, bool]:
    """A greedy row keeps its temperature: only the `sampled` flag says it is greedy."""
    if request.seed is None:
        return 0, float(request.temperature), False
    return (request.seed ^ (request.seed >> 32)) & _MASK32, float(request.temperature), True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
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
            position = request.context_len + i
            tokens.append(token)
            positions.append(position)
            slots.append(_slot(request, position))
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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> LazyGraphRunner:
    return LazyGraphRunner(mode, seed=seed, backend=backend, key_by_size=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> LazyGraphRunner:
    return LazyGraphRunner(mode, seed=seed, backend=backend, key_by_size=True)
