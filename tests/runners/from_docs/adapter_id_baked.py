"""A LoRA graph runner: a one-layer decoder with per-adapter LoRA deltas on the q projection.

Graph mode (backend facade) captures decode graphs lazily, keyed by (size, uses_adapters), the
first time a decode batch of that key arrives, with that batch's inputs staged. Adapters 1..N are
rank-4 LoRA deltas stacked in device tensors of N + 1 entries, entry 0 all zeros (the base).

Bug (make_buggy_target): a single-adapter fast path (A[k], B[k] picked with a host-side index)
is also taken while capturing, so adapter k is baked into the captured graph.
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

NUM_ADAPTERS = 3
SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "adapters"}),
    num_adapters=NUM_ADAPTERS,
)
HIDDEN, HEADS, HEAD_DIM, RANK = 32, 2, 16, 4
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    adapters: Tensor  # [T] adapter id of each token's request (0 = base)
    last: Tensor | None = None  # [R] each request's last token (None for decode: T == R)


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LoraDecoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "lora_a": (SPEC.num_adapters + 1, HIDDEN, RANK),
            "lora_b": (SPEC.num_adapters + 1, RANK, HIDDEN),
        }
        self.weights = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[-2])
            if name.startswith("lora_"):
                fresh[0] = 0.0  # entry 0: the base model, no delta
            weight.copy_(fresh.to(self.device))

    def lora_delta(self, h: Tensor, inputs: StepInputs, plan: Any) -> Tensor:
        a, b = self.weights["lora_a"], self.weights["lora_b"]
        if isinstance(plan, tuple):  # ("single", k): every adapter row names adapter k
            k = plan[1]
            delta = (h @ a[k]) @ b[k]
            mask = (inputs.adapters != 0)[:, None]
            return torch.where(mask, delta, torch.zeros((), device=h.device))
        # general path: each row gathers its own adapter's A/B by its id
        rows_a, rows_b = a[inputs.adapters], b[inputs.adapters]  # [T, H, R], [T, R, H]
        low = torch.einsum("th,thr->tr", h, rows_a)
        return torch.einsum("tr,trh->th", low, rows_b)

    def forward(self, inputs: StepInputs, kv: tuple[Tensor, Tensor], plan: Any) -> Tensor:
        w = self.weights
        k_cache, v_cache = kv
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]
        h = _rms(x)
        q = h @ w["q"]
        if plan is not None:
            q = q + self.lora_delta(h, inputs, plan)
        k, v = h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, inputs.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, inputs.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + _attention(q, k_cache, v_cache, inputs) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if inputs.last is not None:
            x = x[inputs.last]
        return _rms(x) @ w["head"]


def _attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: StepInputs) -> Tensor:
    size = SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    context = (inputs.tables[:, :, None] * size + offsets).flatten(1)
    keys, values = k_cache[context], v_cache[context]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inputs.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


class LoraRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, bake_adapter: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.bake_adapter = bake_adapter
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.model = LoraDecoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
        self.graphs: dict[tuple[int, bool], Any] = {}
        self.outputs: dict[tuple[int, bool], tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=device),
                "positions": torch.zeros(rows, dtype=i64, device=device),
                "slots": torch.zeros(rows, dtype=i64, device=device),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=device),
                "adapters": torch.zeros(rows, dtype=i64, device=device),
            }

    # -- plans ------------------------------------------------------------------------------------

    def lora_plan(self, batch: Batch, capturing: bool) -> Any:
        """None: no adapter in the batch; ("single", k): fast path; "gather": per-row path."""
        used = sorted(batch.adapters - {0})
        if not used:
            return None
        if len(used) == 1 and (not capturing or self.bake_adapter):
            return ("single", used[0])
        return "gather"

    # -- graph mode -------------------------------------------------------------------------------

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{name: buf[:size] for name, buf in self.buffers.items()})

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = _decode_rows(batch.requests)
        for name, values in rows.items():
            buffer = self.buffers[name]
            if n:
                buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype))
            buffer[n:size].fill_(_PADDING[name])

    def capture(self, key: tuple[int, bool], batch: Batch) -> None:
        size = key[0]
        inputs = self.static_inputs(size)
        plan = self.lora_plan(batch, capturing=True)
        self.run_model(inputs, plan)  # warm-up on the staged batch
        self.backend.synchronize()
        graph = self.backend.Graph()
        with self.backend.graph(graph):
            self.outputs[key] = self.run_model(inputs, plan)
        self.graphs[key] = graph

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        key = (size, bool(batch.adapters - {0}))
        self.prepare(batch, size)
        if key not in self.graphs:
            self.capture(key, batch)
        self.graphs[key].replay()
        logits, tokens = self.outputs[key]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", key)

    # -- both modes -------------------------------------------------------------------------------

    def run_model(self, inputs: StepInputs, plan: Any) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv, plan)
        return logits, logits.argmax(-1)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        inputs = _eager_inputs(batch, self.backend.device)
        logits, tokens = self.run_model(inputs, self.lora_plan(batch, capturing=False))
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
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

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


_PADDING: dict[str, int] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "adapters": 0,
}


def _slot(request: Request, position: int) -> int:
    block = request.block_ids[position // SPEC.block_size]
    return block * SPEC.block_size + position % SPEC.block_size


def _table(request: Request) -> list[int]:
    blocks = list(request.block_ids)
    return blocks + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(blocks))


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_slot(r, r.context_len) for r in requests],
        "tables": [_table(r) for r in requests],
        "adapters": [r.adapter for r in requests],
    }


def _eager_inputs(batch: Batch, device: torch.device) -> StepInputs:
    tokens, positions, slots, tables, adapters, last = [], [], [], [], [], []
    for request in batch.requests:
        for i, token in enumerate(request.tokens):
            tokens.append(token)
            positions.append(request.context_len + i)
            slots.append(_slot(request, request.context_len + i))
            tables.append(_table(request))
            adapters.append(request.adapter)
        last.append(len(tokens) - 1)

    def tensor(values: list[Any]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return StepInputs(
        tokens=tensor(tokens),
        positions=tensor(positions),
        slots=tensor(slots),
        tables=tensor(tables).view(-1, SPEC.max_blocks_per_req),
        adapters=tensor(adapters),
        last=tensor(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> LoraRunner:
    return LoraRunner(mode, seed=seed, backend=backend, bake_adapter=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> LoraRunner:
    return LoraRunner(mode, seed=seed, backend=backend, bake_adapter=True)
