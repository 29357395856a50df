"""A graph runner that stores keys and values with torch advanced indexing through a slot mapping.

The model is a two-layer decoder (token embedding plus learned positions, attention over a paged
KV cache of `[num_blocks, block_size, heads, head_dim]` per layer, a SiLU MLP, an LM head) in
float32, its weights drawn from the seed. The cache store is a pure-PyTorch port of vLLM's
`reshape_and_cache`: `cache.view(-1, heads, head_dim)[slot_mapping] = k`, with `slot_mapping` a
static buffer of `max_num_tokens` entries. Graph mode captures one decode graph per capture size at
start-up, largest first, into one shared pool, after an all-padding warm-up run of each size; a
graph is keyed by its padded row count. A step whose requests all have one query token, and no more
of them than the largest capture size, writes its rows into the static buffers' prefix, resets the
padding rows and replays; prefills, mixed and speculative steps, and larger batches, run eagerly
with the same store.

    make_target:        padding rows' `slot_mapping` entries point at the null block's first slot,
                        which the contract lets padding write, so a padded replay stores its
                        padding rows' keys and values there and nowhere else.
    make_buggy_target:  padding rows get slot -1, vLLM's `PAD_SLOT_ID`. vLLM's CUDA kernel skips
                        negative slots, but torch's advanced indexing wraps -1 to the last row of
                        the slot-major view, the last offset of the last block, so every padded
                        warm-up and replay writes the padding row's keys and values into a block the
                        null block is not: a request that owns that block has a context token
                        overwritten, and an idle block holds garbage.
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
    num_blocks=20,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=40,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 2, 16, 2
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
PAD_SLOT_ID = -1  # vLLM's marker for "store nothing"; its CUDA kernel skips negative slots
_MASK32 = 0xFFFFFFFF


@dataclass
class Inputs:
    """One step on the device: T tokens, R requests; `last` is None when every request has one."""

    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slot_mapping: Tensor  # [T]
    block_table: Tensor  # [T, max_blocks_per_req] each token's request's blocks
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] each request's last token


def reshape_and_cache(cache: Tensor, slot_mapping: Tensor, x: Tensor) -> None:
    """The pure-PyTorch store: one row of the slot-major view per token."""
    cache.view(-1, HEADS, HEAD_DIM)[slot_mapping] = x.view(-1, HEADS, HEAD_DIM)


class Decoder:
    """Weights and a forward pass with no host reads, so a decode step can be captured whole."""

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {"embed": (SPEC.vocab_size, HIDDEN), "pos": (CONTEXT, HIDDEN)}
        shapes["lm_head"] = (HIDDEN, SPEC.vocab_size)
        for i in range(LAYERS):
            shapes |= {f"wqkv{i}": (HIDDEN, 3 * HIDDEN), f"wo{i}": (HIDDEN, HIDDEN)}
            shapes |= {f"up{i}": (HIDDEN, 2 * HIDDEN), f"down{i}": (2 * HIDDEN, HIDDEN)}
        self.device = device
        self.weights = {name: torch.empty(s, device=device) for name, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        """In place: the captured graphs read these very tensors."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            drawn = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(drawn.to(self.device))

    def forward(self, inputs: Inputs, caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        w = self.weights
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]  # [T, hidden]
        for i, (k_cache, v_cache) in enumerate(caches):
            q, k, v = (_rms(x) @ w[f"wqkv{i}"]).split(HIDDEN, dim=-1)
            reshape_and_cache(k_cache, inputs.slot_mapping, k)
            reshape_and_cache(v_cache, inputs.slot_mapping, v)
            x = x + _paged_attention(q, k_cache, v_cache, inputs) @ w[f"wo{i}"]
            x = x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        if inputs.last is not None:
            x = x[inputs.last]  # [R, hidden]
        return _rms(x) @ w["lm_head"]  # [R, vocab]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: Inputs) -> Tensor:
    offsets = torch.arange(SPEC.block_size, device=q.device)
    slots = (inputs.block_table[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT]
    keys = k_cache.view(-1, HEADS, HEAD_DIM)[slots]  # [T, CONTEXT, heads, dim]
    values = v_cache.view(-1, HEADS, HEAD_DIM)[slots]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inputs.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    # A masked slot may hold NaN (the null block): zero it rather than multiply it by zero.
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)  # [T, hidden]


def sample(logits: Tensor, inputs: Inputs) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): no generator, no company."""
    positions = inputs.positions if inputs.last is None else inputs.positions[inputs.last]
    key = _hash(_hash(inputs.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))  # [R]
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])  # [R, vocab]
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24  # in (0, 1), exact in float32
    noisy = logits / inputs.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inputs.sampled, noisy.argmax(-1), logits.argmax(-1))


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class PagedRunner:
    """The target contract over `Decoder`; `mode="graph"` captures decode graphs at start-up."""

    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, pad_slot: int
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.model = Decoder(seed, device)
        shape = (SPEC.num_blocks, SPEC.block_size, HEADS, HEAD_DIM)
        self.caches = [
            (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in range(LAYERS)
        ]
        self.padding: dict[str, int | float | bool] = {
            "tokens": 0,
            "positions": 0,
            "slot_mapping": pad_slot,
            "block_table": SPEC.null_block,
            "seeds": 0,
            "temperatures": 1.0,
            "sampled": False,
        }
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self.buffers = self.allocate_buffers()
            self.capture()

    # -- graph mode -------------------------------------------------------------------------------

    def allocate_buffers(self) -> dict[str, Tensor]:
        rows, device, i64 = SPEC.max_num_tokens, self.backend.device, torch.int64
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=device),
            "positions": torch.zeros(rows, dtype=i64, device=device),
            "slot_mapping": torch.zeros(rows, dtype=i64, device=device),
            "block_table": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=device),
            "seeds": torch.zeros(rows, dtype=i64, device=device),
            "temperatures": torch.ones(rows, device=device),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
        }

    def static_inputs(self, size: int) -> Inputs:
        return Inputs(**{name: buffer[:size] for name, buffer in self.buffers.items()})

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inputs = self.static_inputs(size)
            self.run_model(inputs)  # warm-up, outside the graph
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(inputs)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        """The batch into the buffers' prefix, padding values into rows n..size."""
        n = batch.num_reqs
        for name, values in _decode_rows(batch.requests).items():
            buffer = self.buffers[name]
            if n:
                buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype))
            buffer[n:size].fill_(self.padding[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes -------------------------------------------------------------------------------

    def run_model(self, inputs: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.caches)
        return logits, sample(logits, inputs)

    def fallback_reason(self, batch: Batch) -> str | None:
        """None where a decode graph can run `batch`: one query token a request, few enough rows."""
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(length != 1 for length in batch.query_lens):
            return "a request with more than one query token"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            return self.replay(batch)
        logits, tokens = self.run_model(_eager_inputs(batch, self.backend.device))
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {
            f"{kind}{i}": cache.view(SPEC.num_slots, HEADS, HEAD_DIM)
            for i, pair in enumerate(self.caches)
            for kind, cache in zip("kv", pair, strict=True)
        }

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
        "slot_mapping": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in requests],
        "block_table": [_table(r) for r in requests],
        "seeds": [s[0] for s in sampling],
        "temperatures": [s[1] for s in sampling],
        "sampled": [s[2] for s in sampling],
    }


def _eager_inputs(batch: Batch, device: torch.device) -> Inputs:
    tokens, positions, slots, tables, last = [], [], [], [], []
    for request in batch.requests:
        for offset, token in enumerate(request.tokens):
            position = request.context_len + offset
            tokens.append(token)
            positions.append(position)
            slots.append(kv_slot(request.block_ids, position, SPEC.block_size))
            tables.append(_table(request))
        last.append(len(tokens) - 1)
    sampling = [_sampling(r) for r in batch.requests]

    def tensor(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return Inputs(
        tokens=tensor(tokens),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        block_table=tensor(tables).view(-1, SPEC.max_blocks_per_req),
        seeds=tensor([s[0] for s in sampling]),
        temperatures=tensor([s[1] for s in sampling], torch.float32),
        sampled=tensor([s[2] for s in sampling], torch.bool),
        last=tensor(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PagedRunner:
    return PagedRunner(mode, seed=seed, backend=backend, pad_slot=SPEC.null_block * SPEC.block_size)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PagedRunner:
    return PagedRunner(mode, seed=seed, backend=backend, pad_slot=PAD_SLOT_ID)
