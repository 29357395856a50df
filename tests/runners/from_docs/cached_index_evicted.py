"""A graph runner that memoizes its per-size row-index tensors in a bounded `functools.lru_cache`.

A two-layer decoder (token embedding plus learned positions, attention over a slot-major paged KV
cache read through block tables, a SiLU MLP, an LM head; float32, weights drawn from the seed).
Its forward takes packed tokens: every token names its request's row (`token_rows`, which picks
the block table it attends through) and every request its last token (`last`, which the LM head
gathers). Graph mode captures one graph per capture size, lazily, the first time a batch of
one-token requests pads its row count to that size, into one shared pool, keyed
`("decode", size)`. In such a batch token i is row i, so `token_rows` and `last` are both
`arange(size)`: a constant per size, built by a helper memoized with `functools.lru_cache` on the
padded size (as engines memoize per-batch-size helper tensors) and called on every graph step. A
replay writes the batch into the static buffers' prefix, resets the padding rows to the null
block and replays. Prefill chunks, speculative decode and batches above the largest size run
eagerly, with their indices built from the batch.

    make_target:        the memo holds one entry per capture size, so the index tensor each graph
                        was captured with stays alive, at its address, as long as the graph.
    make_buggy_target:  the memo is bounded at two entries while four sizes are captured: a third
                        size evicts the least recently used one and frees the tensor its graph
                        captured. A CUDA graph keeps the address, not the tensor, so the caching
                        allocator hands that memory to the next allocation, and the next replay
                        of that graph picks block tables and last tokens through whatever was
                        written there since (another row's table, an out-of-range index).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import Backend
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 2, 16, 2
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size  # positions a request can reach
NULL_SLOT = SPEC.null_block * SPEC.block_size
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    """One step's device tensors: T tokens of R requests."""

    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] the KV slot each token writes
    tables: Tensor  # [R, max_blocks_per_req]
    token_rows: Tensor  # [T] the row of each token's request
    last: Tensor  # [R] index of each request's last token
    seeds: Tensor  # [R] sampling seed, reduced to 32 bits
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool: False = greedy


class TinyDecoder:
    """Weights and the forward pass; nothing is read on the host, so a step can be captured."""

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            **{f"{name}{i}": (HIDDEN, HIDDEN) for i in range(LAYERS) for name in "qkvo"},
            **{f"up{i}": (HIDDEN, 2 * HIDDEN) for i in range(LAYERS)},
            **{f"down{i}": (2 * HIDDEN, HIDDEN) for i in range(LAYERS)},
        }
        self.device = device
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
        tables = inputs.tables[inputs.token_rows]  # [T, max_blocks_per_req]
        for i, (k_cache, v_cache) in enumerate(kv):
            h = _rms(x)
            q, k, v = (h @ w[f"{n}{i}"] for n in "qkv")
            k_cache.index_copy_(0, inputs.slots, k.view(-1, HEADS, HEAD_DIM))
            v_cache.index_copy_(0, inputs.slots, v.view(-1, HEADS, HEAD_DIM))
            x = x + _attention(q, k_cache, v_cache, tables, inputs.positions) @ w[f"o{i}"]
            x = x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        return _rms(x[inputs.last]) @ w["head"]  # [R, vocab]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, positions: Tensor
) -> Tensor:
    size = SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    context = (tables[:, :, None] * size + offsets).flatten(1)  # [T, CONTEXT] slots
    keys, values = k_cache[context], v_cache[context]  # [T, CONTEXT, heads, dim]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    # Masked slots may hold anything (NaN in the null block): 0 * NaN would leak it.
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)  # [T, hidden]


def sample(logits: Tensor, inputs: StepInputs) -> Tensor:
    """Gumbel-max from a hash of (seed, position, token id), so a request draws the same noise
    whatever batch, bucket or padding it is in."""
    positions = inputs.positions[inputs.last]  # [R]
    key = _mix(_mix(inputs.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])  # [R, vocab]
    # 23 bits: every value is exact in float32, so the uniform is never 0 or 1.
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inputs.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inputs.sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash; every product stays below 2**63."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class CachedIndexRunner:
    """The target contract; `mode="graph"` captures a decode graph per padded size on first use."""

    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        index_cache_size: int,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.backend: Backend = get_backend(backend)
        device = self.backend.device
        self.model = TinyDecoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = [
            (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in range(LAYERS)
        ]
        # Memoized per runner, not per module: one runner's tensors must not reach another's graphs.
        self.decode_index = functools.lru_cache(maxsize=index_cache_size)(self._arange)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        self.pool: Any = None
        if mode == "graph":
            self.buffers = self.allocate_buffers(SPEC.capture_sizes[-1])
            self.pool = self.backend.graph_pool_handle()

    # -- graph mode -------------------------------------------------------------------------------

    def _arange(self, size: int) -> Tensor:
        return torch.arange(size, device=self.backend.device)

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
        # A decode row holds one token, so the token-to-row map and the last-token gather are the
        # same constant arange for every batch of this padded size.
        index = self.decode_index(size)
        views = {name: buffer[:size] for name, buffer in self.buffers.items()}
        return StepInputs(token_rows=index, last=index, **views)

    def capture(self, size: int, inputs: StepInputs) -> None:
        self.prepare(Batch(()), size)  # every row is padding during warm-up and capture
        self.run_model(inputs)  # warm-up outside the graph
        self.backend.synchronize()
        graph = self.backend.Graph()
        with self.backend.graph(graph, pool=self.pool):
            self.outputs[size] = self.run_model(inputs)
        self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        """Write the batch into the buffers' prefix and reset the padding rows to sentinels."""
        n = batch.num_reqs
        for name, values in _decode_rows(batch.requests).items():
            buffer = self.buffers[name]
            if n:
                buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype))
            buffer[n:size].fill_(_PADDING[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        inputs = self.static_inputs(size)
        if size not in self.graphs:
            self.capture(size, inputs)
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
        if any(length != 1 for length in batch.query_lens):
            return "a request with more than one query token"
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
        self.decode_index.cache_clear()


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
    if request.seed is None:
        return 0, 1.0, False
    return request.seed & _MASK32, request.temperature, True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    """Per-row host values of a batch of one-token requests."""
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
    tokens, positions, slots, token_rows, last = [], [], [], [], []
    for row, request in enumerate(batch.requests):
        for i, token in enumerate(request.tokens):
            tokens.append(token)
            positions.append(request.context_len + i)
            slots.append(_slot(request, request.context_len + i))
            token_rows.append(row)
        last.append(len(tokens) - 1)
    sampling = [_sampling(r) for r in batch.requests]

    def tensor(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return StepInputs(
        tokens=tensor(tokens),
        positions=tensor(positions),
        slots=tensor(slots),
        tables=tensor([_table(r) for r in batch.requests]).view(-1, SPEC.max_blocks_per_req),
        token_rows=tensor(token_rows),
        last=tensor(last),
        seeds=tensor([s[0] for s in sampling]),
        temperatures=tensor([s[1] for s in sampling], torch.float32),
        sampled=tensor([s[2] for s in sampling], torch.bool),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> CachedIndexRunner:
    return CachedIndexRunner(
        mode, seed=seed, backend=backend, index_cache_size=len(SPEC.capture_sizes)
    )


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CachedIndexRunner:
    return CachedIndexRunner(mode, seed=seed, backend=backend, index_cache_size=2)
