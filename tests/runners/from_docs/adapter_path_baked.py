"""A small graph runner with multi-LoRA adapters, written against the backend facade.

One decoder layer (embedding + learned positions, attention over a slot-major paged KV cache read
through block tables, SiLU MLP, LM head). Adapters are rank-4 LoRA deltas on the value projection:
per-adapter A/B weights are stacked in device tensors and each token row gathers its own by adapter
slot (slot 0 = base model, all-zero A/B, so it adds an exact zero delta).

Graph mode captures decode graphs lazily: the first time a decode batch of a size bucket arrives,
its inputs are staged into the static buffers, the step is warmed up, captured and replayed. Any
other batch runs eagerly.

To save work, the forward skips the LoRA gather/matmul when the batch has no adapter request (a
host-side `if`). That is fine eagerly; a captured graph must always include the LoRA path
(`make_target`). The buggy variant (`make_buggy_target`) captures with whatever the capturing batch
had, and keys graphs by size only, so a graph captured without adapters skips later rows' deltas.
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
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "adapters"}),
)
HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 64
RANK, NUM_ADAPTERS, LORA_SCALE = 4, 4, 2.0  # adapter slots 1..NUM_ADAPTERS, slot 0 = base
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size


def adapter_slot(adapter: int) -> int:
    """Adapter id -> row of the stacked LoRA weights. 0 is the base model (zero delta); any other
    id is one of NUM_ADAPTERS loaded adapters (ids beyond that wrap around)."""
    return 0 if adapter == 0 else 1 + (adapter - 1) % NUM_ADAPTERS


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    adapters: Tensor  # [T] adapter slot of each token's request
    last: Tensor | None = None  # [R] last token of each request; None for decode (T == R)


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, FFN),
            "down": (FFN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            "lora_a": (NUM_ADAPTERS + 1, HIDDEN, RANK),
            "lora_b": (NUM_ADAPTERS + 1, RANK, HIDDEN),
        }
        self.w = {k: torch.zeros(s, device=device) for k, s in shapes.items()}
        self.device = device
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            fresh = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[-2])
            if name.startswith("lora_"):
                fresh[0] = 0.0  # adapter slot 0: the base model, no delta
            t.copy_(fresh.to(self.device))

    def forward(self, x_in: Inputs, k_cache: Tensor, v_cache: Tensor, lora: bool) -> Tensor:
        w = self.w
        x = w["embed"][x_in.tokens] + w["pos"][x_in.positions]
        h = _rms(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        if lora:  # skipped when no request of the batch has an adapter
            a = w["lora_a"][x_in.adapters]  # [T, hidden, rank]
            b = w["lora_b"][x_in.adapters]  # [T, rank, hidden]
            v = v + LORA_SCALE * torch.einsum("tr,trh->th", torch.einsum("th,thr->tr", h, a), b)
        k_cache.index_copy_(0, x_in.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x_in.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + _attend(q, k_cache, v_cache, x_in) @ w["wo"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if x_in.last is not None:
            x = x[x_in.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, x_in: Inputs) -> Tensor:
    bs = SPEC.block_size
    ctx = (x_in.tables[:, :, None] * bs + torch.arange(bs, device=q.device)).flatten(1)
    keys, values = k_cache[ctx], v_cache[ctx]  # [T, CONTEXT, heads, dim]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= x_in.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


_PAD = {"tokens": 0, "positions": 0, "slots": NULL_SLOT, "tables": SPEC.null_block, "adapters": 0}


class LoraRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, bake_lora_path: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.bake_lora_path = bake_lora_path  # the bug: capture LoRA only if the batch had one
        self.backend: Any = get_backend(backend)
        dev = self.backend.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.zeros(rows, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "adapters": torch.zeros(rows, dtype=i64, device=dev),
            }

    # -- model ------------------------------------------------------------------------------------
    def run_model(self, x_in: Inputs, lora: bool) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(x_in, self.k_cache, self.v_cache, lora)
        return logits, logits.argmax(-1)

    # -- graph mode -------------------------------------------------------------------------------
    def static_inputs(self, size: int) -> Inputs:
        return Inputs(**{name: buf[:size] for name, buf in self.buffers.items()})

    def prepare(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        rows = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "adapters": [adapter_slot(r.adapter) for r in reqs],
        }
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(_PAD[name])

    def capture(self, batch: Batch, size: int) -> None:
        """Lazy capture with the first batch of this size staged in the static buffers."""
        # A graph serves any mix of adapters only with the LoRA path in it; the bug decides
        # from the capturing batch, and that choice is baked into the graph.
        lora = any(r.adapter for r in batch.requests) if self.bake_lora_path else True
        inputs = self.static_inputs(size)
        self.run_model(inputs, lora)  # warm-up
        self.backend.synchronize()
        graph = self.backend.Graph()
        with self.backend.graph(graph):
            self.outputs[size] = self.run_model(inputs, lora)
        self.graphs[size] = graph

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        if size not in self.graphs:
            self.capture(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager ------------------------------------------------------------------------------------
    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        toks, pos, slots, tables, adapters, last = [], [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                toks.append(t)
                pos.append(r.context_len + i)
                slots.append(_slot(r, r.context_len + i))
                tables.append(_table(r))
                adapters.append(adapter_slot(r.adapter))
            last.append(len(toks) - 1)
        dev = self.backend.device

        def t(v: list[Any]) -> Tensor:
            return torch.tensor(v, dtype=torch.int64, device=dev)

        x_in = Inputs(
            t(toks),
            t(pos),
            t(slots),
            t(tables).view(-1, SPEC.max_blocks_per_req),
            t(adapters),
            t(last),
        )
        lora = any(r.adapter for r in batch.requests)  # eager: skip LoRA when nobody uses one
        logits, tokens = self.run_model(x_in, lora)
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

    # -- contract ---------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.k_cache, "v0": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> LoraRunner:
    return LoraRunner(mode, seed=seed, backend=backend, bake_lora_path=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> LoraRunner:
    return LoraRunner(mode, seed=seed, backend=backend, bake_lora_path=True)
