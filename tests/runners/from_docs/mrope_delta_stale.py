"""M-RoPE decode runner with a persistent batch whose per-row `mrope_position_delta` can go stale.

What the runner is
------------------
A one-layer decoder whose attention uses multimodal rotary positions in the style of Qwen2-VL's
M-RoPE as served by vLLM: each token carries three position streams (temporal, height, width) and
the rotary frequency pairs are split into three sections, one per stream. A request may start
with a (simulated) image: its layout (a grid of H x W patches, or none for a text-only request) is
derived once, when the request is admitted (`context_len == 0`), from its `req_id` and the first
token of its prompt, so every twin derives the same one. Tokens of the admitted chunk at
positions below H*W are image tokens with grid positions (t=0, h=p//W, w=p%W); every other token
(the rest of the prompt, every later chunk, every decoded token) is text at `p + delta` on all
three streams, with `mrope_position_delta = max(H, W) - H*W` (0 for text-only requests), as
Qwen2-VL continues text after an image.

Graph mode keeps a vLLM-style persistent batch: requests own rows; at every step the rows of
requests not scheduled are freed, the survivors are condensed (the last row moves into the
lowest hole) and newcomers are appended. Decode batches (one query token per request) replay a
graph captured per capture size whose row r is persistent row r. The per-row delta lives in a
persistent device buffer `row_delta[max_num_reqs]`, and the graph itself builds the 3xT position
tensor from `positions[r] + row_delta[r]`. Prefill, mixed, speculative and oversize batches run
eagerly, computing positions on the host from the per-request layout table.

Correct runner (`make_target`): before every replay every row's delta is rewritten for the
request that occupies the row now (padding rows get 0).

Bug (make_buggy_target): `row_delta[row]` is written only when a request is admitted to a row.
When the batch is condensed (a request earlier in the batch finishes or sits out a step and a
later request moves down into its row), the moved request reads the delta of whoever held its new
row before; padding rows keep a departed request's delta. Its decode tokens then rotate q and k at
the wrong M-RoPE position: wrong logits and wrong keys in the cache, on the graph path only.

Public sources it is modelled on (no code copied):
- vllm-project/vllm-omni PR #803 "[BugFix] Fix incorrect mrope positions under cuda graph"
  https://github.com/vllm-project/vllm-omni/pull/803 (issue
  https://github.com/vllm-project/vllm-omni/issues/732): decode mrope positions wrong only
  under CUDA graphs.
- NVIDIA/TensorRT-LLM PR #18207 https://github.com/NVIDIA/TensorRT-LLM/pull/18207 and PR #7122
  https://github.com/NVIDIA/TensorRT-LLM/pull/7122: the graph's static mrope-delta buffer/slots
  kept stale values for rows not explicitly filled ("Fill explicitly instead of leaving stale
  values").
- vllm-project/vllm PR #32143 https://github.com/vllm-project/vllm/pull/32143 (Model Runner V2
  M-RoPE: per-request prefill delta stored at admission and materialised per step through the
  batch->request index mapping, which is what avoids reading a row's old delta).
The bug here is the persistent-batch form of those stale-delta reports.
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
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
PAIRS = HEAD_DIM // 2
MROPE_SECTION = (2, 3, 3)  # frequency pairs rotated by the t, h, w streams
ROPE_BASE = 100.0
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
GRIDS = ((0, 0), (2, 2), (2, 3), (3, 3), (2, 4))  # (H, W); (0, 0): text-only
_MASK32 = 0xFFFFFFFF


def _hash(*values: int) -> int:
    x = 0x12345
    for v in values:
        x = ((x ^ (v & _MASK32)) * 0x45D9F3B) & _MASK32
        x = ((x >> 16) ^ x) & _MASK32
    return x


@dataclass(frozen=True)
class Layout:
    """What admission derives for a request: its simulated image grid and its M-RoPE delta."""

    h: int
    w: int

    @property
    def n_img(self) -> int:
        return self.h * self.w

    @property
    def delta(self) -> int:
        return max(self.h, self.w) - self.n_img if self.n_img else 0

    def positions(self, p: int, in_admitted_chunk: bool) -> tuple[int, int, int]:
        if in_admitted_chunk and p < self.n_img:
            return 0, p // self.w, p % self.w
        q = p + self.delta
        return q, q, q


def layout_of(request: Request) -> Layout:
    h, w = GRIDS[_hash(request.req_id, request.tokens[0]) % len(GRIDS)]
    return Layout(h, w)


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T] sequence positions (attention mask, sampling key)
    mrope: Tensor  # [3, T] rotary positions
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R]
    last: Tensor | None = None


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            **{n: (HIDDEN, HIDDEN) for n in "qkvo"},
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
        }
        self.weights = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.inv_freq = (ROPE_BASE ** (-torch.arange(PAIRS, dtype=torch.float32) / PAIRS)).to(
            device
        )
        stream = [s for s, n in enumerate(MROPE_SECTION) for _ in range(n)]
        self.section = torch.tensor(stream, dtype=torch.int64, device=device)  # [PAIRS]
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            w = self.weights[name]
            w.copy_((torch.randn(w.shape, generator=g) / math.sqrt(w.shape[0])).to(w.device))

    def rotate(self, x: Tensor, mrope: Tensor) -> Tensor:
        """x [T, heads, dim]; mrope [3, T]. Pair i is rotated by stream section[i]."""
        pos = mrope[self.section].t().to(torch.float32)  # [T, PAIRS]
        angle = pos * self.inv_freq
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
        x1, x2 = x[..., :PAIRS], x[..., PAIRS:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def forward(self, inp: StepInputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.weights
        x = w["embed"][inp.tokens]
        h = _rms(x)
        q = self.rotate((h @ w["q"]).view(-1, HEADS, HEAD_DIM), inp.mrope)
        k = self.rotate((h @ w["k"]).view(-1, HEADS, HEAD_DIM), inp.mrope)
        v = (h @ w["v"]).view(-1, HEADS, HEAD_DIM)
        k_cache.index_copy_(0, inp.slots, k)
        v_cache.index_copy_(0, inp.slots, v)
        size = SPEC.block_size
        ctx = (inp.tables[:, :, None] * size + torch.arange(size, device=x.device)).flatten(1)
        keys, values = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= inp.positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", probs, values).flatten(1) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if inp.last is not None:
            x = x[inp.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def sample(logits: Tensor, inp: StepInputs) -> Tensor:
    pos = inp.positions if inp.last is None else inp.positions[inp.last]
    key = _mix(_mix(inp.seeds) ^ ((pos * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inp.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


def _slot(r: Request, p: int) -> int:
    return r.block_ids[p // SPEC.block_size] * SPEC.block_size + p % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & _MASK32, r.temperature, True


class MRopeRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, stale_delta: bool = False) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec, self.mode, self.stale_delta = SPEC, mode, stale_delta
        self.backend: Any = get_backend(backend)
        dev = self.device = self.backend.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.layouts: dict[int, Layout] = {}  # req_id -> layout, set at admission
        # persistent batch (graph mode): row -> req_id and its per-row delta on the device
        self.rows: list[int | None] = [None] * SPEC.max_num_reqs
        self.row_delta = torch.zeros(SPEC.max_num_reqs, dtype=torch.int64, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            n, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.full((n,), NULL_SLOT, dtype=i64, device=dev),
                "tables": torch.full(
                    (n, SPEC.max_blocks_per_req), SPEC.null_block, dtype=i64, device=dev
                ),
                "seeds": torch.zeros(n, dtype=i64, device=dev),
                "temperatures": torch.ones(n, device=dev),
                "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
            }
            self.capture()

    # -- admission and the persistent batch --------------------------------------------------

    def admit(self, batch: Batch) -> set[int]:
        """Derive the layout of every request that starts (again) at this step."""
        fresh = set()
        for r in batch.requests:
            if r.context_len == 0:
                self.layouts[r.req_id] = layout_of(r)
                fresh.add(r.req_id)
        return fresh

    def update_rows(self, batch: Batch, fresh: set[int]) -> None:
        wanted = {r.req_id for r in batch.requests}
        rows = [rid if rid in wanted else None for rid in self.rows]  # free unscheduled rows
        # condense: the last occupied row moves into the lowest hole
        while True:
            holes = [i for i, rid in enumerate(rows) if rid is None]
            used = [i for i, rid in enumerate(rows) if rid is not None]
            if not holes or not used or holes[0] > used[-1]:
                break
            rows[holes[0]], rows[used[-1]] = rows[used[-1]], None
        present = set(rid for rid in rows if rid is not None)
        admitted = []
        for r in batch.requests:
            if r.req_id not in present:
                i = rows.index(None)
                rows[i] = r.req_id
                present.add(r.req_id)
                admitted.append(i)
            elif r.req_id in fresh:  # restarted in the row it holds
                admitted.append(rows.index(r.req_id))
        self.rows = rows
        if self.stale_delta:
            # BUG: the delta is written only for a request admitted to a row
            for i in admitted:
                self.row_delta[i].fill_(self.layouts[self.rows[i]].delta)  # type: ignore[index]

    def write_row_deltas(self) -> None:
        deltas = [self.layouts[rid].delta if rid is not None else 0 for rid in self.rows]
        self.row_delta.copy_(torch.tensor(deltas, dtype=torch.int64))

    # -- graph mode -------------------------------------------------------------------------

    def static_inputs(self, size: int) -> StepInputs:
        b = self.buffers
        positions = b["positions"][:size]
        mrope = (positions + self.row_delta[:size]).expand(3, size)  # built on the device
        return StepInputs(
            b["tokens"][:size],
            positions,
            mrope,
            b["slots"][:size],
            b["tables"][:size],
            b["seeds"][:size],
            b["temperatures"][:size],
            b["sampled"][:size],
        )

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.fill_rows([], size)
            inputs = self.static_inputs(size)
            self.run_model(inputs)
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(self.static_inputs(size))
            self.graphs[size] = graph

    def fill_rows(self, requests: list[Request], size: int) -> None:
        n = len(requests)
        values: dict[str, list[Any]] = {k: [] for k in self.buffers}
        for r in requests:
            p = r.context_len
            seed, temp, sampled = _sampling(r)
            values["tokens"].append(r.tokens[0])
            values["positions"].append(p)
            values["slots"].append(_slot(r, p))
            values["tables"].append(_table(r))
            values["seeds"].append(seed)
            values["temperatures"].append(temp)
            values["sampled"].append(sampled)
        pad = {
            "tokens": 0,
            "positions": 0,
            "slots": NULL_SLOT,
            "tables": SPEC.null_block,
            "seeds": 0,
            "temperatures": 1.0,
            "sampled": False,
        }
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(values[name], dtype=buf.dtype))
            buf[n:size].fill_(pad[name])

    def replay(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        size = next(s for s in SPEC.capture_sizes if s >= n)
        by_id = {r.req_id: r for r in batch.requests}
        ordered = [by_id[rid] for rid in self.rows[:n]]  # type: ignore[index]
        self.fill_rows(ordered, size)
        if not self.stale_delta:
            self.write_row_deltas()
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        row_of = {rid: i for i, rid in enumerate(self.rows[:n])}
        index = torch.tensor([row_of[r.req_id] for r in batch.requests], device=self.device)
        return StepResult(logits[index].clone(), tokens[index].clone(), "full", ("decode", size))

    # -- both modes -------------------------------------------------------------------------

    def run_model(self, inputs: StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.k_cache, self.v_cache)
        return logits, sample(logits, inputs)

    def eager_inputs(self, batch: Batch) -> StepInputs:
        tokens, pos, mrope, slots, tables, last = [], [], [], [], [], []
        for r in batch.requests:
            layout = self.layouts[r.req_id]
            for i, t in enumerate(r.tokens):
                p = r.context_len + i
                tokens.append(t)
                pos.append(p)
                mrope.append(layout.positions(p, r.context_len == 0))
                slots.append(_slot(r, p))
                tables.append(_table(r))
            last.append(len(tokens) - 1)
        s = [_sampling(r) for r in batch.requests]
        dev, i64 = self.device, torch.int64
        return StepInputs(
            torch.tensor(tokens, dtype=i64, device=dev),
            torch.tensor(pos, dtype=i64, device=dev),
            torch.tensor(mrope, dtype=i64, device=dev).t().contiguous(),
            torch.tensor(slots, dtype=i64, device=dev),
            torch.tensor(tables, dtype=i64, device=dev).view(-1, SPEC.max_blocks_per_req),
            torch.tensor([x[0] for x in s], dtype=i64, device=dev),
            torch.tensor([x[1] for x in s], dtype=torch.float32, device=dev),
            torch.tensor([x[2] for x in s], dtype=torch.bool, device=dev),
            torch.tensor(last, dtype=i64, device=dev),
        )

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.query_len != 1 or r.context_len == 0 for r in batch.requests):
            return f"{batch.phase} batch"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        fresh = self.admit(batch)
        if self.mode == "graph" and batch.num_reqs:
            self.update_rows(batch, fresh)
        reason = self.fallback_reason(batch)
        if reason is None:
            return self.replay(batch)
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(
                empty,
                torch.zeros(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason=reason,
            )
        logits, tokens = self.run_model(self.eager_inputs(batch))
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> MRopeRunner:
    return MRopeRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> MRopeRunner:
    return MRopeRunner(mode, seed=seed, backend=backend, stale_delta=True)
