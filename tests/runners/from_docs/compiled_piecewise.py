"""A vLLM-V1-style PIECEWISE CUDA-graph runner over a `torch.compile(fullgraph=True)` model.

Plain `torch.cuda` only (drop-in style, like tests/runners/plain_cuda.py). A small float32 decoder
(2 layers) whose attention is an opaque `torch.library.custom_op`
(`graphmode_docs_piecewise::unified_attention(q, k, v, out, layer)`, mutating `out`) that, like vLLM's
`unified_attention_with_output`, takes nothing about the batch as arguments: it reads a
module-level *forward context* (`set_forward_context`) holding the attention metadata (slot
mapping, block table, positions and the host int `max_seq_len`) and the runner's KV caches, writes
the step's keys/values into the paged cache and attends.

The model is split at the attention op into pieces, as vLLM's compilation splits the FX graph:
`first` (embedding + layer-0 QKV), `mid` (layer-0 out-proj + MLP + layer-1 QKV), `last` (layer-1
out-proj + MLP + LM head). The eager path runs the whole model compiled with
`torch.compile(fullgraph=True)` (the custom op stays one opaque node); graph mode compiles each
piece with `torch.compile(fullgraph=True)`, captures one `torch.cuda.CUDAGraph` per piece and
capture size (one shared pool, largest size first), and at replay runs the attention op eagerly
between the piece replays (StepResult path "piecewise"), with attention outputs written into
static per-size buffers the next piece's graph reads. The attention metadata is rebuilt every
step: its tensors are views of the static input buffer, `max_seq_len` is computed from the batch.

Bug (`make_buggy_target`): the runner builds the forward context's attention metadata once per
capture size during capture (the dummy all-padding batch, `max_seq_len` = 1) and reuses that
object at replay. Its tensors are views of the static buffers, so slot mapping, block table and
positions are current, but its host field `max_seq_len` is the capture-time one, so the attention
op reads only the first block of every request's context. Modelled on vLLM's stale attention
metadata bugs around cudagraph capture/replay: https://github.com/vllm-project/vllm/pull/48261
("Fix stale attn metadata in speculator prefill cudagraph capture": metadata not rebuilt before
the forward, "they will contain whatever garbage/dummy values they had during capture") and
https://github.com/vllm-project/vllm/pull/44868 ("Refresh forward-context tensors before FULL
CUDA graph replay").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 64
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS, VOCAB = 24, 4, 6, 48
CAPTURE_SIZES = (1, 2, 4)
NULL_BLOCK = 0
CONTEXT = MAX_BLOCKS * BLOCK_SIZE
SLOTS = NUM_BLOCKS * BLOCK_SIZE
COLS = 3 + MAX_BLOCKS

SPEC = TargetSpec(
    num_blocks=NUM_BLOCKS,
    block_size=BLOCK_SIZE,
    max_blocks_per_req=MAX_BLOCKS,
    vocab_size=VOCAB,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=CAPTURE_SIZES,
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=NULL_BLOCK,
)


# -- the forward context (vLLM's `set_forward_context` / `get_forward_context`) ------------------


@dataclass
class AttnMetadata:
    slot_mapping: Tensor  # [T] int64
    block_table: Tensor  # [T, MAX_BLOCKS] int64 (per token: its request's table)
    positions: Tensor  # [T] int64
    max_seq_len: int  # host int, as FlashAttentionMetadata.max_seq_len


@dataclass
class ForwardContext:
    attn_metadata: AttnMetadata
    kv_caches: list[tuple[Tensor, Tensor]]


_FORWARD_CONTEXT: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _FORWARD_CONTEXT
    prev, _FORWARD_CONTEXT = _FORWARD_CONTEXT, ctx
    try:
        yield
    finally:
        _FORWARD_CONTEXT = prev


@torch.library.custom_op("graphmode_docs_piecewise::unified_attention", mutates_args=("out",))
def unified_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer: int) -> None:
    ctx = _FORWARD_CONTEXT
    assert ctx is not None, "unified_attention outside a forward context"
    md = ctx.attn_metadata
    k_cache, v_cache = ctx.kv_caches[layer]
    k_cache.index_copy_(0, md.slot_mapping, k.view(-1, HEADS, HEAD_DIM))
    v_cache.index_copy_(0, md.slot_mapping, v.view(-1, HEADS, HEAD_DIM))
    blocks = -(-md.max_seq_len // BLOCK_SIZE)  # only the blocks some sequence reaches
    offsets = torch.arange(BLOCK_SIZE, device=q.device)
    context = (md.block_table[:, :blocks, None] * BLOCK_SIZE + offsets).flatten(1)
    visible = torch.arange(blocks * BLOCK_SIZE, device=q.device)[None, :] <= md.positions[:, None]
    keys, values = k_cache[context], v_cache[context]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    out.copy_(torch.einsum("thc,tchd->thd", probs, values).reshape(out.shape))


@unified_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer: int) -> None:
    return None


# -- the model, as pieces split at the attention op -----------------------------------------------


class PiecewiseModel:
    def __init__(self, seed: int) -> None:
        dev = torch.device("cuda")
        shapes = {"embed": (VOCAB, HIDDEN), "pos": (CONTEXT, HIDDEN), "head": (HIDDEN, VOCAB)}
        for layer in range(2):
            for n in ("qkv", "o"):
                shapes[f"{n}{layer}"] = (HIDDEN, 3 * HIDDEN if n == "qkv" else HIDDEN)
            shapes[f"up{layer}"] = (HIDDEN, FFN)
            shapes[f"down{layer}"] = (FFN, HIDDEN)
        self.w = {n: torch.empty(s, device=dev) for n, s in shapes.items()}
        self.load_weights(seed)

    def load_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            fresh = torch.randn(t.shape, generator=g)
            if name not in ("embed", "pos"):
                fresh = fresh / math.sqrt(t.shape[0])
            t.copy_(fresh.to(t.device))

    def _qkv(self, x: Tensor, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = (x @ self.w[f"qkv{layer}"]).split(HIDDEN, dim=-1)
        return q.contiguous(), k.contiguous(), v.contiguous()

    def _post(self, x: Tensor, attn: Tensor, layer: int) -> Tensor:
        x = x + attn.reshape(x.shape[0], HIDDEN) @ self.w[f"o{layer}"]
        return x + torch.nn.functional.silu(x @ self.w[f"up{layer}"]) @ self.w[f"down{layer}"]

    def first(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        x = self.w["embed"][tokens] + self.w["pos"][positions]
        return (x, *self._qkv(x, 0))

    def mid(self, x: Tensor, attn: Tensor) -> tuple[Tensor, ...]:
        x = self._post(x, attn, 0)
        return (x, *self._qkv(x, 1))

    def last(self, x: Tensor, attn: Tensor) -> tuple[Tensor, Tensor]:
        logits = self._post(x, attn, 1) @ self.w["head"]
        return logits, logits.argmax(-1)

    def forward(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        x, q, k, v = self.first(tokens, positions)
        out = torch.empty_like(q)
        torch.ops.graphmode_docs_piecewise.unified_attention(q, k, v, out, 0)
        x, q, k, v = self.mid(x, out)
        out = torch.empty_like(q)
        torch.ops.graphmode_docs_piecewise.unified_attention(q, k, v, out, 1)
        return self.last(x, out)


class PiecewiseRunner:
    def __init__(self, *, graphs: bool, seed: int, reuse_capture_metadata: bool) -> None:
        self.device = torch.device("cuda")
        self.model = PiecewiseModel(seed)
        self.reuse_capture_metadata = reuse_capture_metadata
        self.kv_caches = [
            (
                torch.zeros(SLOTS, HEADS, HEAD_DIM, device=self.device),
                torch.zeros(SLOTS, HEADS, HEAD_DIM, device=self.device),
            )
            for _ in range(2)
        ]
        self.compiled = torch.compile(self.model.forward, fullgraph=True)
        self.pieces = [
            torch.compile(p, fullgraph=True)
            for p in (self.model.first, self.model.mid, self.model.last)
        ]
        rows = max(CAPTURE_SIZES)
        self.static = torch.zeros(rows, COLS, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.piece_out: dict[int, list[tuple[Tensor, ...]]] = {}
        self.attn_out: dict[int, list[Tensor]] = {}
        self.capture_md: dict[int, AttnMetadata] = {}
        if graphs:
            self._capture()

    def _metadata(self, size: int, max_seq_len: int) -> AttnMetadata:
        s = self.static[:size]
        return AttnMetadata(s[:, 2], s[:, 3:], s[:, 1], max_seq_len)

    def _upload(self, rows: Sequence[list[int]], size: int) -> None:
        pad = [0, 0, NULL_BLOCK * BLOCK_SIZE] + [NULL_BLOCK] * MAX_BLOCKS
        full = [rows[i] if i < len(rows) else pad for i in range(size)]
        self.static[:size].copy_(torch.tensor(full, dtype=torch.int64).to(self.device))

    def _run_pieces(
        self, size: int, md: AttnMetadata, capture: torch.cuda.graph_pool_handle | None
    ):
        """Run (or, with a pool, capture) the pieces of `size`, attention eagerly between them."""
        s = self.static[:size]
        outs, graphs = [], []
        args: tuple[Tensor, ...] = (s[:, 0], s[:, 1])
        with set_forward_context(ForwardContext(md, self.kv_caches)):
            for i, piece in enumerate(self.pieces):
                if capture is not None:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=capture):
                        out = piece(*args)
                    graphs.append(g)
                else:
                    out = piece(*args)
                outs.append(out)
                if i < 2:
                    x, q, k, v = out
                    attn = self.attn_out[size][i]
                    torch.ops.graphmode_docs_piecewise.unified_attention(q, k, v, attn, i)
                    args = (x, attn)
        return outs, graphs

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in sorted(CAPTURE_SIZES, reverse=True):
                self.attn_out[size] = [
                    torch.zeros(size, HEADS * HEAD_DIM, device=self.device) for _ in range(2)
                ]
                self._upload([], size)
                md = self._metadata(size, max_seq_len=1)  # the dummy batch: padding rows only
                self._run_pieces(size, md, None)  # warm-up
                torch.cuda.synchronize()
                self.piece_out[size], self.graphs[size] = self._run_pieces(size, md, pool)
                self.capture_md[size] = md

    def decode(self, rows: Sequence[list[int]]) -> tuple[Tensor, Tensor, int]:
        size = next(s for s in CAPTURE_SIZES if s >= len(rows))
        self._upload(rows, size)
        if self.reuse_capture_metadata:
            md = self.capture_md[size]
        else:
            md = self._metadata(size, max(r[1] for r in rows) + 1)
        with torch.inference_mode(), set_forward_context(ForwardContext(md, self.kv_caches)):
            for i, graph in enumerate(self.graphs[size]):
                graph.replay()
                if i < 2:
                    _, q, k, v = self.piece_out[size][i]
                    torch.ops.graphmode_docs_piecewise.unified_attention(
                        q, k, v, self.attn_out[size][i], i
                    )
            logits, tokens = self.piece_out[size][2]
            n = len(rows)
            return logits[:n].clone(), tokens[:n].clone(), size

    def eager(self, rows: Sequence[list[int]], last: Sequence[int]) -> tuple[Tensor, Tensor]:
        t = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), COLS).to(self.device)
        md = AttnMetadata(t[:, 2], t[:, 3:], t[:, 1], max(r[1] for r in rows) + 1)
        with torch.inference_mode(), set_forward_context(ForwardContext(md, self.kv_caches)):
            logits, tokens = self.compiled(t[:, 0], t[:, 1])
            index = torch.tensor(list(last), dtype=torch.int64, device=self.device)
            return logits[index], tokens[index]

    def close(self) -> None:
        for gs in self.graphs.values():
            for g in gs:
                g.reset()
        self.graphs.clear()
        self.piece_out.clear()


def rows_of(request: Request) -> list[list[int]]:
    table = list(request.block_ids) + [NULL_BLOCK] * (MAX_BLOCKS - len(request.block_ids))
    return [
        [
            tok,
            request.context_len + i,
            kv_slot(request.block_ids, request.context_len + i, BLOCK_SIZE),
            *table,
        ]
        for i, tok in enumerate(request.tokens)
    ]


class PiecewiseTarget:
    def __init__(self, mode: str, *, seed: int, buggy: bool = False) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.runner = PiecewiseRunner(
            graphs=mode == "graph", seed=seed, reuse_capture_metadata=buggy
        )

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.context_len == 0 or r.query_len != 1 for r in batch.requests):
            return "not a pure one-token decode"
        if batch.num_reqs > max(CAPTURE_SIZES):
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            logits, tokens, size = self.runner.decode([rows_of(r)[0] for r in batch.requests])
            return StepResult(logits, tokens, "piecewise", ("decode", size))
        rows: list[list[int]] = []
        last: list[int] = []
        for r in batch.requests:
            rows.extend(rows_of(r))
            last.append(len(rows) - 1)
        if not rows:
            dev = self.runner.device
            return StepResult(
                torch.zeros(0, VOCAB, device=dev),
                torch.zeros(0, dtype=torch.int64, device=dev),
                "eager",
                None,
                reason=reason,
            )
        logits, tokens = self.runner.eager(rows, last)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {
            f"{kv}{i}": c[j]
            for i, c in enumerate(self.runner.kv_caches)
            for j, kv in enumerate("kv")
        }

    def static_buffers(self) -> Mapping[str, Tensor]:
        if not self.runner.graphs:
            return {}
        bufs = {"rows": self.runner.static}
        for size, outs in self.runner.attn_out.items():
            for i, t in enumerate(outs):
                bufs[f"attn_out{i}_{size}"] = t
        return bufs

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.model.load_weights(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PiecewiseTarget:
    return PiecewiseTarget(mode, seed=seed)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PiecewiseTarget:
    return PiecewiseTarget(mode, seed=seed, buggy=True)
