"""A TensorRT-LLM-style decode graph runner (PyTorch backend) with its overlap scheduler's tokens.

Modelled on TensorRT-LLM's `PyTorchModelEngine` / `DecodingCUDAGraphRunner` as of mid-2025, written
against the backend facade and the target contract only:

- one CUDA graph per batch size (1, 2, 4, 8), captured largest first into one pool, each with its
  own attention metadata (kv lengths, block offsets, slots) and its own input ids, which the engine
  prepares before every replay;
- a batch is padded up to a captured size with *dummy requests*: one padding dummy, made once,
  whose KV cache block the cache manager reserved for it (here the spec's null block), replicated
  for every padding row at the end of the batch;
- an overlap scheduler: a generation request that continues from the token its last step sampled
  takes that token from the device (the engine's per-slot `new_tokens` buffer) instead of from the
  host, so the host never waits for a step's tokens. The engine's staging buffer `input_ids_cuda`
  holds the host tokens first (requests without a token on the device) and the device tokens after
  them, and the rows are ordered to match: [no device token..., device token..., padding dummies].

The bug (`make_buggy_target`): TensorRT-LLM PR #3839, "CUDA Graph padding with overlap scheduler"
(https://github.com/NVIDIA/TensorRT-LLM/pull/3839, nvbugs 5241495). With the overlap scheduler on,
the padding dummies were handled like requests without a device token, so each added its own token
to the host part of `input_ids_cuda`. The device tokens were then copied after the dummies' host
tokens, `padding_size` entries later than the rows that read them: every continuing request took
its neighbour's token (the first ones a dummy's), with its own position and KV slot, and the
padding rows took the last real tokens. Nothing fails: the real rows write plausible keys and
values into their own slots and return plausible, wrong tokens, only when a graph was padded and
only on the graph path (eager steps are never padded). The fix leaves the dummies out of the host
token list (this runner then gives the padding rows a token of its own). The bug predates the
one-dummy-replicated padding used here, which came with TensorRT-LLM PR #4729
(https://github.com/NVIDIA/TensorRT-LLM/pull/4729); PR #4853
(https://github.com/NVIDIA/TensorRT-LLM/pull/4853) later moved the speculative dummies to the end
of their rows too, to keep this layout.

The device tokens are keyed by request: a row uses its request's last sampled token only where its
`context_len` is the position that token was sampled for, so every twin (and a company twin that
runs some requests alone) substitutes alike. The harness cannot tell a substitution from the
batch's token (docs/contract.md); what it sees here is the graph twin disagreeing with the eager one.
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
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),  # TensorRT-LLM's default cuda_graph_batch_sizes, cut at the batch
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
BLOCK = SPEC.block_size
CONTEXT = SPEC.max_blocks_per_req * BLOCK
SEQ_SLOTS = (
    256  # per-request device token slots (the sampler's new_tokens); larger ids never use one
)
M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class PaddingDummy:
    """The one padding request: a generation request on the block the cache manager reserved for it."""

    token: int = 1
    position: int = 0
    block: int = SPEC.null_block


DUMMY = PaddingDummy()


@dataclass
class Rows:
    """Per-row inputs of one forward. T rows (tokens); R requests when `last` is given."""

    tokens: Tensor
    positions: Tensor
    slots: Tensor
    tables: Tensor
    kv_lens: Tensor
    seeds: Tensor
    temps: Tensor
    sampled: Tensor
    last: Tensor | None = None


SHAPES = {
    "embed": (SPEC.vocab_size, HIDDEN),
    "pos": (CONTEXT, HIDDEN),
    "wq": (HIDDEN, HIDDEN),
    "wk": (HIDDEN, HIDDEN),
    "wv": (HIDDEN, HIDDEN),
    "wo": (HIDDEN, HIDDEN),
    "up": (HIDDEN, 2 * HIDDEN),
    "down": (2 * HIDDEN, HIDDEN),
    "head": (HIDDEN, SPEC.vocab_size),
}


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        self.t = {name: torch.empty(shape, device=device) for name, shape in SHAPES.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: the graphs keep reading these tensors
            fresh = torch.randn(SHAPES[name], generator=gen) / math.sqrt(SHAPES[name][0])
            self.t[name].copy_(fresh.to(self.t[name].device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def _sample(logits: Tensor, positions: Tensor, rows: Rows) -> Tensor:
    """Gumbel-max on noise hashed from (seed, position, token): no generator, nothing baked."""
    key = _hash32(_hash32(rows.seeds) ^ ((positions * 0x9E3779B1) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash32(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / rows.temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(rows.sampled, noisy.argmax(-1), logits.argmax(-1))


class OverlapGraphRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, dummy_bug: bool = False
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.dummy_bug = SPEC, mode, dummy_bug
        self.be: Any = get_backend(backend)
        dev = self.dev = self.be.device
        self.w = Weights(seed, dev)
        shape = (SPEC.num_blocks * BLOCK, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.new_tokens = torch.zeros(SEQ_SLOTS, dtype=torch.int64, device=dev)
        self.sampled_for: dict[int, int] = {}  # req_id -> position its device token belongs to
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.meta: dict[int, Rows] = {}
        self.input_ids_cuda = torch.zeros(SPEC.max_num_tokens, dtype=torch.int64, device=dev)
        if mode == "graph":
            self._capture()

    # -- the model ------------------------------------------------------------------------------

    def _forward(self, rows: Rows) -> tuple[Tensor, Tensor]:
        w = self.w.t
        x = w["embed"][rows.tokens] + w["pos"][rows.positions]
        h = _norm(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        self.k_cache.index_copy_(0, rows.slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, rows.slots, v.view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(BLOCK, device=x.device)
        ctx = (rows.tables[:, :, None] * BLOCK + offsets).flatten(1)  # [T, CONTEXT]
        keys, values = self.k_cache[ctx], self.v_cache[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] < rows.kv_lens[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)
        x = x + attended @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        positions = rows.positions
        if rows.last is not None:
            x, positions = x[rows.last], positions[rows.last]
        logits = _norm(x) @ w["head"]
        return logits, _sample(logits, positions, rows)

    # -- the overlap scheduler's device tokens --------------------------------------------------

    def _has_device_token(self, r: Request) -> bool:
        """The request continues from the token its last step sampled, which is on the device."""
        return (
            r.query_len == 1
            and r.context_len > 0
            and r.req_id < SEQ_SLOTS
            and self.sampled_for.get(r.req_id) == r.context_len
        )

    def _record(self, batch: Batch, tokens: Tensor) -> None:
        """What the sampler leaves for the next step: each request's token in its slot."""
        keep = [i for i, r in enumerate(batch.requests) if r.req_id < SEQ_SLOTS]
        for r in batch.requests:
            self.sampled_for.pop(r.req_id, None)
        if not keep:
            return
        index = torch.tensor(keep, dtype=torch.int64, device=self.dev)
        slots = torch.tensor([batch.requests[i].req_id for i in keep], device=self.dev)
        self.new_tokens.index_copy_(0, slots, tokens.index_select(0, index))
        for i in keep:
            self.sampled_for[batch.requests[i].req_id] = batch.requests[i].seq_len

    def _device_tokens(self, requests: Sequence[Request]) -> Tensor:
        slots = torch.tensor([r.req_id for r in requests], dtype=torch.int64, device=self.dev)
        return self.new_tokens[slots]

    # -- graph mode -----------------------------------------------------------------------------

    def _alloc_meta(self, size: int) -> Rows:
        def buf(*shape: int, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.dev)

        return Rows(
            tokens=buf(size),
            positions=buf(size),
            slots=buf(size),
            tables=buf(size, SPEC.max_blocks_per_req),
            kv_lens=buf(size),
            seeds=buf(size),
            temps=buf(size, dtype=torch.float32),
            sampled=buf(size, dtype=torch.bool),
        )

    def _capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.meta[size] = self._alloc_meta(size)
            self._prepare([], [], size)  # every row a padding dummy
            for _ in range(2):  # warm-up runs, as the engine does before capturing
                self._forward(self.meta[size])
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self._forward(self.meta[size])
            self.graphs[size] = graph

    def _stage_input_ids(self, host_rows: list[Request], device_rows: list[Request], size: int):
        """Build `input_ids_cuda`: host tokens first, then the device tokens after them."""
        host = [r.tokens[0] for r in host_rows]
        padding = size - len(host_rows) - len(device_rows)
        if self.dummy_bug:  # before PR #3839: the dummies' own tokens join the host part
            host += [DUMMY.token] * padding
        staged = self.input_ids_cuda
        if host:
            staged[: len(host)].copy_(torch.tensor(host, dtype=torch.int64, device=self.dev))
        if device_rows:
            end = len(host) + len(device_rows)
            staged[len(host) : end].copy_(self._device_tokens(device_rows))
        if not self.dummy_bug and padding:
            staged[size - padding : size].fill_(DUMMY.token)
        self.meta[size].tokens.copy_(staged[:size])

    def _prepare(self, host_rows: list[Request], device_rows: list[Request], size: int) -> None:
        """Write the padded batch into the graph's metadata: real rows, then the dummies."""
        self._stage_input_ids(host_rows, device_rows, size)
        rows = host_rows + device_rows
        dummies = size - len(rows)
        null_table = [DUMMY.block] * SPEC.max_blocks_per_req
        positions = [r.context_len for r in rows] + [DUMMY.position] * dummies
        slots = [kv_slot(r.block_ids, r.context_len, BLOCK) for r in rows]
        slots += [DUMMY.block * BLOCK + DUMMY.position] * dummies
        params = [_sampling(r) for r in rows] + [(0, 1.0, False)] * dummies
        meta = self.meta[size]
        for tensor, values in (
            (meta.positions, positions),
            (meta.slots, slots),
            (meta.tables, [_table(r) for r in rows] + [null_table] * dummies),
            (meta.kv_lens, [p + 1 for p in positions]),
            (meta.seeds, [p[0] for p in params]),
            (meta.temps, [p[1] for p in params]),
            (meta.sampled, [p[2] for p in params]),
        ):
            tensor.copy_(torch.tensor(values, dtype=tensor.dtype, device=self.dev))

    def _replay(self, batch: Batch, size: int) -> StepResult:
        on_device = [self._has_device_token(r) for r in batch.requests]
        order = [i for i, d in enumerate(on_device) if not d] + [
            i for i, d in enumerate(on_device) if d
        ]
        rows = [batch.requests[i] for i in order]
        split = on_device.count(False)
        self._prepare(rows[:split], rows[split:], size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        back = [0] * len(order)  # results in the batch's order, copied out of the graph
        for row, i in enumerate(order):
            back[i] = row
        index = torch.tensor(back, dtype=torch.int64, device=self.dev)
        return StepResult(
            logits.index_select(0, index), tokens.index_select(0, index), "full", ("gen", size)
        )

    def _graph_size(self, batch: Batch) -> tuple[int | None, str | None]:
        if self.mode == "eager":
            return None, "eager twin"
        if batch.num_reqs == 0:
            return None, "empty batch"
        if batch.phase != "decode" or batch.query_lens[0] != 1:
            return None, f"{batch.phase} batch with query lengths {set(batch.query_lens)}"
        size = next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)
        return (size, None) if size is not None else (None, "more requests than the largest graph")

    # -- eager ----------------------------------------------------------------------------------

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.dev)
            return StepResult(
                empty, torch.zeros(0, dtype=torch.int64, device=self.dev), "eager", None, reason
            )
        tokens, positions, slots, tables, last, use_device = [], [], [], [], [], []
        for r in batch.requests:
            from_device = self._has_device_token(r)
            for i, token in enumerate(r.tokens):
                tokens.append(token)
                use_device.append(from_device)
                positions.append(r.context_len + i)
                slots.append(kv_slot(r.block_ids, r.context_len + i, BLOCK))
                tables.append(_table(r))
            last.append(len(tokens) - 1)
        params = [_sampling(r) for r in batch.requests]

        def dev(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=self.dev)

        host_tokens = dev(tokens)
        if any(use_device):
            owners = [r for r in batch.requests for _ in r.tokens]
            device_ids = self.new_tokens[dev([min(r.req_id, SEQ_SLOTS - 1) for r in owners])]
            host_tokens = torch.where(dev(use_device, torch.bool), device_ids, host_tokens)
        rows = Rows(
            tokens=host_tokens,
            positions=dev(positions),
            slots=dev(slots),
            tables=dev(tables).view(-1, SPEC.max_blocks_per_req),
            kv_lens=dev(positions) + 1,
            seeds=dev([p[0] for p in params]),
            temps=dev([p[1] for p in params], torch.float32),
            sampled=dev([p[2] for p in params], torch.bool),
            last=dev(last),
        )
        logits, next_tokens = self._forward(rows)
        return StepResult(logits, next_tokens, "eager", None, reason)

    # -- the contract ---------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        size, reason = self._graph_size(batch)
        result = self._replay(batch, size) if size is not None else self._eager(batch, reason or "")
        if batch.num_reqs:
            self._record(batch, result.next_tokens)
        return result

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode == "eager":
            return {}
        buffers = {"input_ids_cuda": self.input_ids_cuda}
        for size, meta in self.meta.items():
            for name in ("tokens", "positions", "slots", "tables", "kv_lens", "seeds", "temps"):
                buffers[f"bs{size}.{name}"] = getattr(meta, name)
            buffers[f"bs{size}.sampled"] = meta.sampled  # every row rewritten before each replay
        return buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, r.temperature, True


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OverlapGraphRunner:
    return OverlapGraphRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> OverlapGraphRunner:
    return OverlapGraphRunner(mode, seed=seed, backend=backend, dummy_bug=True)
