"""A Llama-4-style decode runner with chunked local attention, written against the contract.

Model: token embedding + learned positions, three decoder layers over a slot-major paged KV cache
read through block tables: layers 0 and 1 use CHUNKED LOCAL attention (a query at position p sees
only the keys of its own chunk, positions (p // CHUNK) * CHUNK .. p, CHUNK = 8 = two blocks of 4),
layer 2 full causal attention (Llama 4's interleaving of local "iRoPE" layers with global ones).
Counter-based Gumbel-max sampling from a hash of (seed, position, token id).

The local layers' metadata is vLLM's "virtual batch" for a decode query: per row, the column of
the request's block table where its current chunk starts (`local_base`) and the number of keys it
may see inside that chunk (`local_lens`). It is built on the host at every step
(`_local_meta`) and, in graph mode, written into persistent device buffers that the captured
decode graphs read; the graph gathers the chunk's blocks from the full block table in-graph.
Graph mode captures one decode graph per capture size at start-up (largest first, one pool);
prefill, mixed and speculative batches, and batches above the largest size, run eagerly.

Bug (`make_buggy_target`): the chunk start is treated as per-graph constant metadata. At capture
the runner snapshots the chunk-start tensor for each capture size (as SGLang's
`init_forward_metadata_capture_cuda_graph` pre-allocated and initialised the local-attention
metadata) and at replay only refreshes the visible lengths (plus the full-attention inputs) into
the persistent buffers; the chunk start it still computes and uploads every step lands in the
persistent buffer, which the graphs never read. The graphs keep the capture batch's chunk start
(column 0: every capture row is padding at position 0). Outputs are right while every sequence is
in its first chunk and wrong as soon as a decode position crosses the first chunk boundary
(position >= CHUNK): the query attends to chunk 0's keys with the current chunk's visible length.
Modelled on:
  - SGLang PR #6162 "Fix Llama4 gibberish output with long context and CUDA graph"
    (https://github.com/sgl-project/sglang/pull/6162): local-attention metadata was not part of
    the CUDA-graph state, so replays did not use the step's local metadata; gibberish only past
    the 8192-token chunk.
  - vLLM issue #25960 / PR #26034 ("ChunkedLocalAttention is currently not CG compatible",
    https://github.com/vllm-project/vllm/pull/26034) and issue #28604 / PR #28739 ("Fix
    ChunkedLocalAttention CUDA Graph setting", https://github.com/vllm-project/vllm/pull/28739):
    Llama 4's virtual-batch metadata rebuilt outside the buffers a full CUDA graph reads gave
    incorrect outputs until the backend was marked NEVER for full graphs.
No code was copied from either engine.
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
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
LAYER_KINDS = ("local", "local", "full")  # Llama 4: local (chunked) layers, then a global one
CHUNK = 8  # attention_chunk_size, in positions; a multiple of the block size
CHUNK_BLOCKS = CHUNK // SPEC.block_size
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
assert CONTEXT % CHUNK == 0 and CHUNK % SPEC.block_size == 0
NULL_SLOT = SPEC.null_block * SPEC.block_size
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    """One step's device tensors. T tokens, R requests; `last` is None when T == R (decode)."""

    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req] full block table of each token's request
    local_base: Tensor  # [T] block-table column where the token's chunk starts (virtual batch)
    local_lens: Tensor  # [T] keys visible to the token inside its chunk (1 .. CHUNK)
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R]


def _local_meta(position: int) -> tuple[int, int]:
    """Virtual batch of one query token: (chunk's first block-table column, visible length)."""
    start = (position // CHUNK) * CHUNK
    return start // SPEC.block_size, position - start + 1


class Llama4ishDecoder:
    """Weights and forward; no host reads, so a decode step can be captured whole."""

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        for i in range(len(LAYER_KINDS)):
            shapes.update({f"{n}{i}": (HIDDEN, HIDDEN) for n in "qkvo"})
            shapes[f"up{i}"] = (HIDDEN, 2 * HIDDEN)
            shapes[f"down{i}"] = (2 * HIDDEN, HIDDEN)
        self.device = device
        self.weights = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))  # in place: graphs keep reading these tensors

    def forward(self, inputs: StepInputs, kv: list[tuple[Tensor, Tensor]]) -> Tensor:
        w = self.weights
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]
        for i, (kind, (k_cache, v_cache)) in enumerate(zip(LAYER_KINDS, kv, strict=True)):
            h = _rms(x)
            q, k, v = (h @ w[f"{n}{i}"] for n in "qkv")
            k_cache.index_copy_(0, inputs.slots, k.view(-1, HEADS, HEAD_DIM))
            v_cache.index_copy_(0, inputs.slots, v.view(-1, HEADS, HEAD_DIM))
            if kind == "local":
                context, visible = _local_context(inputs, q.device)
            else:
                context, visible = _full_context(inputs, q.device)
            x = x + _attend(q, k_cache, v_cache, context, visible) @ w[f"o{i}"]
            x = x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        if inputs.last is not None:
            x = x[inputs.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _slots_of(table: Tensor, device: torch.device) -> Tensor:
    offsets = torch.arange(SPEC.block_size, device=device)
    return (table[:, :, None] * SPEC.block_size + offsets).flatten(1)


def _full_context(inputs: StepInputs, device: torch.device) -> tuple[Tensor, Tensor]:
    context = _slots_of(inputs.tables, device)  # [T, CONTEXT]
    visible = torch.arange(CONTEXT, device=device)[None, :] <= inputs.positions[:, None]
    return context, visible


def _local_context(inputs: StepInputs, device: torch.device) -> tuple[Tensor, Tensor]:
    """The chunk's blocks, gathered in-graph from the full table at the virtual batch's start."""
    columns = inputs.local_base[:, None] + torch.arange(CHUNK_BLOCKS, device=device)
    chunk_table = inputs.tables.gather(1, columns)  # [T, CHUNK_BLOCKS]
    context = _slots_of(chunk_table, device)  # [T, CHUNK]
    visible = torch.arange(CHUNK, device=device)[None, :] < inputs.local_lens[:, None]
    return context, visible


def _attend(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, context: Tensor, visible: Tensor
) -> Tensor:
    keys, values = k_cache[context], v_cache[context]  # [T, C, heads, dim]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    # masked slots may hold NaN (the null block): zero them rather than multiply by 0
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def sample(logits: Tensor, inputs: StepInputs) -> Tensor:
    positions = inputs.positions if inputs.last is None else inputs.positions[inputs.last]
    key = _mix(_mix(inputs.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inputs.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inputs.sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class ChunkedLocalRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, bake_chunk_start: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.bake_chunk_start = bake_chunk_start
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.model = Llama4ishDecoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = [
            (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in LAYER_KINDS
        ]
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.graph_meta: dict[int, dict[str, Tensor]] = {}  # per-size metadata a graph owns
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
            "local_base": torch.zeros(rows, dtype=i64, device=device),
            "local_lens": torch.ones(rows, dtype=i64, device=device),
            "seeds": torch.zeros(rows, dtype=i64, device=device),
            "temperatures": torch.ones(rows, device=device),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
        }

    def static_inputs(self, size: int) -> StepInputs:
        views = {name: buf[:size] for name, buf in self.buffers.items()}
        if self.bake_chunk_start:
            # BUG: the chunk start is "per-graph metadata", initialised once for the capture.
            views["local_base"] = self.graph_meta[size]["local_base"]
        return StepInputs(**views)

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)  # every row is padding for warm-up and capture
            self.graph_meta[size] = {"local_base": self.buffers["local_base"][:size].clone()}
            inputs = self.static_inputs(size)
            self.run_model(inputs)  # warm-up outside the graph
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(inputs)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        """Build the step's rows (virtual batches included) on the host; write every row."""
        n = batch.num_reqs
        for name, values in _decode_rows(batch.requests).items():
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
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.query_len != 1 or r.context_len == 0 for r in batch.requests):
            return f"{batch.phase} batch (query length > 1 or a new request)"
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
        self.graph_meta.clear()


_PADDING: dict[str, float | int | bool] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "local_base": 0,  # with the null table row: the chunk is the null block
    "local_lens": 1,  # sees the one null slot it just wrote (never 0: an all-masked softmax is NaN)
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
    if request.seed is None:
        return 0, 1.0, False
    return request.seed & _MASK32, request.temperature, True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    sampling = [_sampling(r) for r in requests]
    local = [_local_meta(r.context_len) for r in requests]
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_slot(r, r.context_len) for r in requests],
        "tables": [_table(r) for r in requests],
        "local_base": [m[0] for m in local],
        "local_lens": [m[1] for m in local],
        "seeds": [s[0] for s in sampling],
        "temperatures": [s[1] for s in sampling],
        "sampled": [s[2] for s in sampling],
    }


def _eager_inputs(batch: Batch, device: torch.device) -> StepInputs:
    tokens, positions, slots, tables, base, lens, last = [], [], [], [], [], [], []
    for request in batch.requests:
        for i, token in enumerate(request.tokens):
            position = request.context_len + i
            tokens.append(token)
            positions.append(position)
            slots.append(_slot(request, position))
            tables.append(_table(request))
            chunk_base, visible = _local_meta(position)
            base.append(chunk_base)
            lens.append(visible)
        last.append(len(tokens) - 1)
    sampling = [_sampling(r) for r in batch.requests]

    def tensor(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return StepInputs(
        tokens=tensor(tokens),
        positions=tensor(positions),
        slots=tensor(slots),
        tables=tensor(tables).view(-1, SPEC.max_blocks_per_req),
        local_base=tensor(base),
        local_lens=tensor(lens),
        seeds=tensor([s[0] for s in sampling]),
        temperatures=tensor([s[1] for s in sampling], torch.float32),
        sampled=tensor([s[2] for s in sampling], torch.bool),
        last=tensor(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ChunkedLocalRunner:
    return ChunkedLocalRunner(mode, seed=seed, backend=backend, bake_chunk_start=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> ChunkedLocalRunner:
    return ChunkedLocalRunner(mode, seed=seed, backend=backend, bake_chunk_start=True)
