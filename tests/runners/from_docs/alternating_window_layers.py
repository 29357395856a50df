"""Paged-KV decode runner for a Gemma-2 / Gemma-3 / GPT-OSS style model whose layers alternate
between sliding-window ("local", window 6 positions) and global attention, with attention-logit
soft-capping (`50 * tanh(s / 50)`) and final-logit soft-capping (`30 * tanh(l / 30)`), weights and
KV cache in bfloat16, RoPE positions, counter-based (seed, position) Gumbel sampling.

Each layer kind has its own attention-metadata group (kept in static buffers on the graph path):

- local:  first visible position (`start`), sequence length (`kv_len`), the position of the first
          slot its window table covers (`base`) and a window block table (`table`, WINDOW_BLOCKS
          columns starting at the window's first block, like SGLang's window_kv_indices);
- global: sequence length (`kv_len`) and the full block table (`table`).

Graph mode captures one decode graph per capture size (1, 2, 4) at start-up, largest first, into
one shared pool, written against the backend facade. `prepare` writes the common inputs and
*every* group's metadata (prefix and padding rows) before every replay. Prefill, mixed,
speculative and oversized batches run eagerly.

Bug (`make_buggy_target`): metadata planning of the secondary layer group (the sliding-window
group) is deferred to the first forward of a layer of that kind ("plan lazily, the layer knows
its window"); `prepare` plans only the primary (global) group. In eager mode the forward runs in
Python every step, so the lazy plan happens and results are correct. A CUDA-graph replay never
re-enters the Python forward, so the local group's static metadata keeps whatever the warm-up
before capture (or anything else) last left there: the sliding-window layers attend with a
stale window start / window table. Graph path only.

Modelled on TensorRT-LLM PR #18443 ("[https://nvbugs/6566726][fix] Replan FlashInfer wrappers
before CUDA graph replay", https://github.com/NVIDIA/TensorRT-LLM/pull/18443): with several
persistent FlashInfer wrappers (Gemma3 global + sliding-window) `prepare()` refreshed the KV page
metadata but deferred re-planning of the extra wrappers to `forward_impl()`, which "is valid for
eager execution, but CUDA graph replay does not re-enter Python", so replay used a schedule from
an earlier batch. Related: SGLang PR #29858 (SWA window kv buffers not built on one cuda-graph
path, https://github.com/sgl-project/sglang/pull/29858). No engine code copied.
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
DTYPE = torch.bfloat16
HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 64
KINDS = ("local", "global", "local", "global")  # Gemma-2 style alternation
WINDOWS: dict[str, int | None] = {"local": 6, "global": None}  # None: full context
ATTN_CAP, FINAL_CAP = 50.0, 30.0
BS = SPEC.block_size
NULL = SPEC.null_block
NULL_SLOT = NULL * BS
WINDOW_BLOCKS = (WINDOWS["local"] - 1 + BS - 1) // BS + 1  # blocks a window of 6 can touch: 3
_MASK32 = 0xFFFFFFFF


# -- per-layer-kind attention metadata ---------------------------------------------------------


def _group_row(kind: str, request: Request, position: int) -> dict[str, Any]:
    """Host metadata of one query token for one layer kind."""
    blocks = request.block_ids
    window = WINDOWS[kind]
    if window is None:
        table = list(blocks) + [NULL] * (SPEC.max_blocks_per_req - len(blocks))
        return {"kv_len": position + 1, "table": table}
    start = max(0, position - window + 1)
    first = start // BS
    table = [blocks[b] if b < len(blocks) else NULL for b in range(first, first + WINDOW_BLOCKS)]
    return {"start": start, "kv_len": position + 1, "base": first * BS, "table": table}


_GROUP_PADDING: dict[str, dict[str, int]] = {
    "local": {"start": 0, "kv_len": 1, "base": 0, "table": NULL},
    "global": {"kv_len": 1, "table": NULL},
}


class GroupMetadata:
    """One layer kind's metadata: device buffers of `rows` rows, planned from host rows."""

    def __init__(self, kind: str, rows: int, device: torch.device) -> None:
        self.kind = kind
        width = SPEC.max_blocks_per_req if WINDOWS[kind] is None else WINDOW_BLOCKS
        i64 = torch.int64
        self.buffers: dict[str, Tensor] = {
            name: torch.zeros(rows, dtype=i64, device=device)
            for name in _GROUP_PADDING[kind]
            if name != "table"
        }
        self.buffers["table"] = torch.zeros(rows, width, dtype=i64, device=device)
        self.pending: tuple[list[dict[str, Any]], int] | None = None

    def stage(self, rows: list[dict[str, Any]], size: int) -> None:
        self.pending = (rows, size)

    def plan(self) -> None:
        """Write the staged rows into the buffers' prefix, padding sentinels into rows n..size."""
        if self.pending is None:
            return
        rows, size = self.pending
        self.pending = None
        n = len(rows)
        for name, buffer in self.buffers.items():
            if n:
                values = torch.tensor([r[name] for r in rows], dtype=buffer.dtype)
                buffer[:n].copy_(values)
            buffer[n:size].fill_(_GROUP_PADDING[self.kind][name])

    def view(self, size: int) -> dict[str, Tensor]:
        return {name: buffer[:size] for name, buffer in self.buffers.items()}


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] index of each request's last token (None: decode, T == R)


# -- model -------------------------------------------------------------------------------------


class AlternatingWindowModel:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes: dict[str, tuple[int, ...]] = {"embed": (SPEC.vocab_size, HIDDEN)}
        for i in range(len(KINDS)):
            for name in "qkvo":
                shapes[f"{name}{i}"] = (HIDDEN, HIDDEN)
            shapes[f"up{i}"] = (HIDDEN, FFN)
            shapes[f"down{i}"] = (FFN, HIDDEN)
        self.weights = {n: torch.empty(s, dtype=DTYPE, device=device) for n, s in shapes.items()}
        exponents = torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM
        self.inv_freq = (1.0 / (10000.0**exponents)).to(device)  # constant, made once
        self.load(seed)

    def load(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            if name == "embed":
                fresh = fresh * 2.0
            weight.copy_(fresh.to(device=weight.device, dtype=DTYPE))

    def forward(
        self, inputs: StepInputs, groups: Mapping[str, GroupMetadata], size: int, kv: list
    ) -> Tensor:
        w = self.weights
        x = w["embed"][inputs.tokens] * math.sqrt(HIDDEN)  # [T, hidden] bf16
        cos, sin = self._rope(inputs.positions)
        for i, kind in enumerate(KINDS):
            group = groups[kind]
            group.plan()  # no-op unless this group's planning was deferred to its first layer
            meta = group.view(size)
            k_cache, v_cache = kv[i]
            h = _rms(x)
            q = _rotate((h @ w[f"q{i}"]).view(-1, HEADS, HEAD_DIM), cos, sin)
            k = _rotate((h @ w[f"k{i}"]).view(-1, HEADS, HEAD_DIM), cos, sin)
            v = (h @ w[f"v{i}"]).view(-1, HEADS, HEAD_DIM)
            k_cache.index_copy_(0, inputs.slots, k)
            v_cache.index_copy_(0, inputs.slots, v)
            attn = _attend(q, k_cache, v_cache, meta, WINDOWS[kind])
            x = x + _rms(attn @ w[f"o{i}"])  # Gemma-2 post-attention norm
            up = torch.nn.functional.gelu(_rms(x) @ w[f"up{i}"], approximate="tanh")
            x = x + _rms(up @ w[f"down{i}"])
        if inputs.last is not None:
            x = x[inputs.last]
        logits = (_rms(x) @ w["embed"].t()).float()  # tied LM head
        return FINAL_CAP * torch.tanh(logits / FINAL_CAP)

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, dim/2]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _rms(x: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _attend(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: Mapping[str, Tensor], window: int | None
) -> Tensor:
    """Soft-capped attention over the slots of the group's own block table."""
    table = meta["table"]  # [T, columns]
    offsets = torch.arange(BS, device=q.device)
    context = (table[:, :, None] * BS + offsets).flatten(1)  # [T, C] slots
    span = torch.arange(context.shape[1], device=q.device)[None, :]
    if window is None:
        visible = span < meta["kv_len"][:, None]
    else:
        pos = meta["base"][:, None] + span
        visible = (pos >= meta["start"][:, None]) & (pos < meta["kv_len"][:, None])
    keys, values = k_cache[context].float(), v_cache[context].float()  # [T, C, heads, dim]
    scores = torch.einsum("thd,tchd->thc", q.float(), keys) / math.sqrt(HEAD_DIM)
    scores = ATTN_CAP * torch.tanh(scores / ATTN_CAP)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1).to(q.dtype)


def sample(logits: Tensor, positions: Tensor, inputs: StepInputs) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id)."""
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


# -- runner ------------------------------------------------------------------------------------

_COMMON_PADDING: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(request: Request, position: int) -> int:
    return request.block_ids[position // BS] * BS + position % BS


def _sampling(request: Request) -> tuple[int, float, bool]:
    if request.seed is None:
        return 0, 1.0, False
    return request.seed & _MASK32, request.temperature, True


class AlternatingWindowRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, defer_secondary: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.defer_secondary = defer_secondary
        self.backend: Any = get_backend(backend)
        self.device = self.backend.device
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.common: dict[str, Tensor] = {}
        self.groups: dict[str, GroupMetadata] = {}
        with torch.inference_mode():
            self.model = AlternatingWindowModel(seed, self.device)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.kv = [
                (
                    torch.zeros(shape, dtype=DTYPE, device=self.device),
                    torch.zeros(shape, dtype=DTYPE, device=self.device),
                )
                for _ in KINDS
            ]
            if mode == "graph":
                rows = SPEC.capture_sizes[-1]
                i64 = torch.int64
                self.common = {
                    "tokens": torch.zeros(rows, dtype=i64, device=self.device),
                    "positions": torch.zeros(rows, dtype=i64, device=self.device),
                    "slots": torch.zeros(rows, dtype=i64, device=self.device),
                    "seeds": torch.zeros(rows, dtype=i64, device=self.device),
                    "temperatures": torch.ones(rows, device=self.device),
                    "sampled": torch.zeros(rows, dtype=torch.bool, device=self.device),
                }
                # Primary group first: "global" is planned eagerly, the other may be deferred.
                self.groups = {k: GroupMetadata(k, rows, self.device) for k in ("global", "local")}
                self.capture()

    # -- graph mode ------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inputs = self.static_inputs(size)
            self.run_model(inputs, self.groups, size)  # warm-up outside the graph
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(inputs, self.groups, size)
            self.graphs[size] = graph

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{name: buf[:size] for name, buf in self.common.items()})

    def prepare(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        sampling = [_sampling(r) for r in reqs]
        values = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "seeds": [s[0] for s in sampling],
            "temperatures": [s[1] for s in sampling],
            "sampled": [s[2] for s in sampling],
        }
        for name, buffer in self.common.items():
            if n:
                buffer[:n].copy_(torch.tensor(values[name], dtype=buffer.dtype))
            buffer[n:size].fill_(_COMMON_PADDING[name])
        for index, (kind, group) in enumerate(self.groups.items()):
            group.stage([_group_row(kind, r, r.context_len) for r in reqs], size)
            if index == 0 or not self.defer_secondary:
                group.plan()
            # else: planned lazily by the first layer of this kind (GroupMetadata.plan in
            # forward) -- which a graph replay never runs.

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ------------------------------------------------------------------------

    def run_model(
        self, inputs: StepInputs, groups: Mapping[str, GroupMetadata], size: int
    ) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, groups, size, self.kv)
        positions = inputs.positions if inputs.last is None else inputs.positions[inputs.last]
        return logits, sample(logits, positions, inputs)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        tokens, positions, slots, last = [], [], [], []
        rows: dict[str, list[dict[str, Any]]] = {"global": [], "local": []}
        for request in batch.requests:
            for i, token in enumerate(request.tokens):
                position = request.context_len + i
                tokens.append(token)
                positions.append(position)
                slots.append(_slot(request, position))
                for kind in rows:
                    rows[kind].append(_group_row(kind, request, position))
            last.append(len(tokens) - 1)
        sampling = [_sampling(r) for r in batch.requests]
        dev = self.device

        def tensor(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        inputs = StepInputs(
            tokens=tensor(tokens),
            positions=tensor(positions),
            slots=tensor(slots),
            seeds=tensor([s[0] for s in sampling]),
            temperatures=tensor([s[1] for s in sampling], torch.float32),
            sampled=tensor([s[2] for s in sampling], torch.bool),
            last=tensor(last),
        )
        count = len(tokens)
        groups = {kind: GroupMetadata(kind, count, dev) for kind in ("global", "local")}
        for index, (kind, group) in enumerate(groups.items()):
            group.stage(rows[kind], count)
            if index == 0 or not self.defer_secondary:
                group.plan()
        logits, next_tokens = self.run_model(inputs, groups, count)
        return StepResult(logits, next_tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.query_len != 1 for r in batch.requests):
            return "query length > 1 (prefill, mixed or speculative)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        out: dict[str, Tensor] = {}
        for i, (k, v) in enumerate(self.kv):
            out[f"k{i}"], out[f"v{i}"] = k, v
        return out

    def static_buffers(self) -> Mapping[str, Tensor]:
        buffers = dict(self.common)
        for kind, group in self.groups.items():
            for name, buffer in group.buffers.items():
                buffers[f"{kind}.{name}"] = buffer
        return buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> AlternatingWindowRunner:
    return AlternatingWindowRunner(mode, seed=seed, backend=backend, defer_secondary=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> AlternatingWindowRunner:
    return AlternatingWindowRunner(mode, seed=seed, backend=backend, defer_secondary=True)
