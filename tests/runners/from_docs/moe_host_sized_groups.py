"""A decode runner whose MLP is a small mixture of experts, run as a sorted grouped GEMM.

The model: one decoder layer (token embedding + learned positions, attention over a slot-major
paged KV cache read through block tables) whose MLP is a top-2 mixture of 4 SwiGLU-free SiLU
experts. The MoE follows the fused-MoE recipe of serving engines: route (top-k over the router
logits), "align/sort by expert" (a stable argsort of the flattened expert ids, per-expert counts
and exclusive offsets), run each expert over its contiguous group of sorted rows (the grouped
GEMM), then unsort and combine the top-k outputs with the routing weights.

Graph mode captures one decode graph per capture size, lazily: the first time a decode batch needs
a size, the runner writes that batch into the static buffers, runs a warm-up step eagerly, captures,
and replays. Everything else (prefill, mixed, speculative, oversize batches) runs eagerly.

Correct runner (`make_target`): the per-expert counts and offsets never leave the device. Every
expert runs over all N = rows * top_k sorted rows (a padded per-expert capacity equal to the number
of rows) and keeps only the rows whose sorted index lies in [offset[e], offset[e] + count[e]),
selected with `torch.where`; so the captured graph serves any routing.

Buggy runner (`make_buggy_target`), one realistic bug: the grouped GEMM takes the group bounds as
Python ints, `counts.tolist()`, and slices `xs[start:end]` per expert, as host-sized grouped-GEMM
launchers do (the problem sizes of a CUTLASS/FBGEMM grouped GEMM, `m_sizes` / split sizes read on
the host). A host read is refused inside a capture, so the runner "fixes" that by reusing the split
its warm-up run counted right before the capture (`if is_current_stream_capturing(): use the last
split`). The graph then bakes the capture batch's routing split: a later batch that routes
differently has its sorted rows run through the wrong expert's weights (or left at zero when its
group lies past the baked bounds).

Public sources this is modelled on (no code copied):
- vLLM PR https://github.com/vllm-project/vllm/pull/12036 (and its successor #12222):
  `moe_align_block_size` (the sort-by-expert step that produces the per-expert counts/offsets the
  fused-MoE kernel consumes) "is not compatible with cuda graph"; the fix keeps the counts,
  cumsum and `num_tokens_post_padded` in device buffers instead of host-sized allocations.
- SGLang PR https://github.com/sgl-project/sglang/pull/29461: the FlashInfer MoE A2A dispatcher
  queried runtime per-rank token counts during CUDA graph capture; "the captured graph uses fixed
  geometry, so querying runtime token counts during capture is incorrect".
- FastDeploy PR https://github.com/PaddlePaddle/FastDeploy/pull/6803: the decode group_gemm's
  prefix-sum of per-expert counts was copied device-to-host to size the per-expert loop, which
  had to go before the ERNIE MoE models could run under CUDA graphs.
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
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
EXPERTS, TOP_K, FFN = 4, 2, 48
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] last query token of each request (None for decode)


class MoEDecoder:
    """Weights plus the forward pass; `host_split` selects the grouped GEMM with host bounds."""

    def __init__(self, seed: int, backend: Any, host_split: bool) -> None:
        self.backend = backend
        self.host_split = host_split
        self.last_split: list[int] | None = None  # counted by the last eager MoE (buggy path)
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "router": (HIDDEN, EXPERTS),
            "w_up": (EXPERTS, HIDDEN, FFN),
            "w_down": (EXPERTS, FFN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=backend.device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            fan_in = t.shape[-2] if t.dim() == 3 else t.shape[0]
            scale = 2.0 if name == "router" else 1.0  # sharper routing: experts really differ
            host = torch.randn(t.shape, generator=gen) * scale / math.sqrt(fan_in)
            t.copy_(host.to(t.device))  # in place: captured graphs keep reading these tensors

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, x_in: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][x_in.tokens] + w["pos"][x_in.positions]
        h = rms(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, x_in.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x_in.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + attend(q, k_cache, v_cache, x_in) @ w["wo"]
        x = x + self.moe(rms(x))
        if x_in.last is not None:
            x = x[x_in.last]
        return rms(x) @ w["head"]

    def moe(self, h: Tensor) -> Tensor:
        rows = h.shape[0]
        top_val, top_idx = (h @ self.w["router"]).topk(TOP_K, dim=-1)  # [T, K]
        gates = top_val.softmax(-1)  # [T, K]
        flat_expert = top_idx.reshape(-1)  # [N], N = T * K
        order = torch.argsort(flat_expert, stable=True)  # sorted position -> flat index
        xs = h[torch.div(order, TOP_K, rounding_mode="floor")]  # [N, H] rows grouped by expert
        experts = torch.arange(EXPERTS, device=h.device)
        counts = (flat_expert[:, None] == experts[None, :]).sum(0)  # [E] on the device
        if self.host_split:
            ys = self.grouped_host_bounds(xs, self.split_sizes(counts))
        else:
            ys = self.grouped_device_bounds(xs, counts)
        unsorted = ys[torch.argsort(order)].view(rows, TOP_K, HIDDEN)  # back to [T, K, H]
        return (unsorted * gates[:, :, None]).sum(1)

    def expert(self, e: int, xs: Tensor) -> Tensor:
        return torch.nn.functional.silu(xs @ self.w["w_up"][e]) @ self.w["w_down"][e]

    def grouped_device_bounds(self, xs: Tensor, counts: Tensor) -> Tensor:
        """Each expert over all N rows (capacity N); a row keeps its own group's output."""
        n = xs.shape[0]
        ends = counts.cumsum(0)
        starts = ends - counts
        idx = torch.arange(n, device=xs.device)
        ys = torch.zeros_like(xs)
        for e in range(EXPERTS):
            mine = (idx >= starts[e]) & (idx < ends[e])
            ys = torch.where(mine[:, None], self.expert(e, xs), ys)
        return ys

    def split_sizes(self, counts: Tensor) -> list[int]:
        # BUG: the group sizes are host ints. Inside a capture the host read is refused, so the
        # split counted by the warm-up run right before it is reused, and baked into the graph.
        if self.backend.is_current_stream_capturing():
            assert self.last_split is not None, "warm-up must run before capture"
            return self.last_split
        self.last_split = [int(c) for c in counts.tolist()]
        return self.last_split

    def grouped_host_bounds(self, xs: Tensor, split: list[int]) -> Tensor:
        ys = torch.zeros_like(xs)
        start = 0
        for e, size in enumerate(split):
            if size:
                ys[start : start + size] = self.expert(e, xs[start : start + size])
            start += size
        return ys


def rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, x_in: Inputs) -> Tensor:
    bs = SPEC.block_size
    ctx = (x_in.tables[:, :, None] * bs + torch.arange(bs, device=q.device)).flatten(1)
    keys, values = k_cache[ctx], v_cache[ctx]  # [T, C, heads, dim]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= x_in.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def hash32(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def sample(logits: Tensor, x_in: Inputs) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): company-independent."""
    pos = x_in.positions if x_in.last is None else x_in.positions[x_in.last]
    key = hash32(hash32(x_in.seeds) ^ ((pos * 0x9E3779B1) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = hash32(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
    u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / x_in.temperatures[:, None] - torch.log(-torch.log(u))
    return torch.where(x_in.sampled, noisy.argmax(-1), logits.argmax(-1))


class MoERunner:
    HOST_SPLIT = False

    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"bad mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = MoEDecoder(seed, self.be, self.HOST_SPLIT)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        self.pool: Any = None
        if mode == "graph":
            rows, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.zeros(rows, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(rows, dtype=i64, device=dev),
                "temperatures": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
            }
            self.pool = self.be.graph_pool_handle()

    # -- graph path -------------------------------------------------------------------------------

    def static_inputs(self, size: int) -> Inputs:
        return Inputs(**{k: b[:size] for k, b in self.buffers.items()})

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        for name, values in decode_rows(batch.requests).items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(PADDING[name])

    def capture(self, size: int) -> None:
        """Lazy capture on the batch already written into the static buffers."""
        inputs = self.static_inputs(size)
        self.run(inputs)  # warm-up, eagerly
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            self.outputs[size] = self.run(inputs)
        self.graphs[size] = graph

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        if size not in self.graphs:
            self.capture(size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes -------------------------------------------------------------------------------

    def run(self, x_in: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(x_in, self.k_cache, self.v_cache)
        return logits, sample(logits, x_in)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length above one (prefill, mixed or speculative)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest graph"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            return self.replay(batch)
        logits, tokens = self.run(eager_inputs(batch, self.be.device))
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


class BuggyMoERunner(MoERunner):
    HOST_SPLIT = True


PADDING: dict[str, float | int | bool] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def slot_of(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def table_of(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def sampling_of(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, r.temperature, True


def decode_rows(reqs: Sequence[Request]) -> dict[str, list[Any]]:
    s = [sampling_of(r) for r in reqs]
    return {
        "tokens": [r.tokens[0] for r in reqs],
        "positions": [r.context_len for r in reqs],
        "slots": [slot_of(r, r.context_len) for r in reqs],
        "tables": [table_of(r) for r in reqs],
        "seeds": [x[0] for x in s],
        "temperatures": [x[1] for x in s],
        "sampled": [x[2] for x in s],
    }


def eager_inputs(batch: Batch, dev: torch.device) -> Inputs:
    toks, pos, slots, tables, last = [], [], [], [], []
    for r in batch.requests:
        for i, t in enumerate(r.tokens):
            p = r.context_len + i
            toks.append(t)
            pos.append(p)
            slots.append(slot_of(r, p))
            tables.append(table_of(r))
        last.append(len(toks) - 1)
    s = [sampling_of(r) for r in batch.requests]

    def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=dev)

    return Inputs(
        tokens=t(toks),
        positions=t(pos),
        slots=t(slots),
        tables=t(tables).view(-1, SPEC.max_blocks_per_req),
        seeds=t([x[0] for x in s]),
        temperatures=t([x[1] for x in s], torch.float32),
        sampled=t([x[2] for x in s], torch.bool),
        last=t(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> MoERunner:
    return MoERunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> BuggyMoERunner:
    return BuggyMoERunner(mode, seed=seed, backend=backend)
