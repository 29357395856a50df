"""Two-wrapper (full + sliding-window) decode-graph runner whose attention plans can be deferred.

Bug modelled (flag `defer_multi_wrapper_plan`): NVIDIA/TensorRT-LLM PR #18769, "Re-plan FlashInfer
decode schedule on page-table changes under CUDA graphs". A model with more than one FlashInfer decode
wrapper (a mixed sliding-window / full-attention checkpoint gets one wrapper per distinct window) had
its plans deferred from `prepare()` to `forward_impl`, which a CUDA-graph replay never re-enters: every
replay then ran the plan made for the warm-up batch (one max-length dummy in slot 0, one-token dummies
elsewhere). A single-wrapper model was fine because `prepare()` planned it eagerly. The fix plans every
wrapper in `prepare()`, before the replay.

Here: one decoder, two attention layers (layer 0 global, layer 1 a sliding window of WINDOW positions),
each with its own slot-major KV cache and its own "decode wrapper". A wrapper's `plan()` computes on the
host, per token row, the page table and the visible range [start, end) and uploads them (pinned staging,
non_blocking copy, an event guarding the staging) into the wrapper's persistent device workspace, which
`run()` (and so the captured graph) reads. Graphs: one per decode size (1, 2, 4, 8 rows, one token a
row), captured largest first into a shared pool; everything else runs eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
WINDOW = 6
NULL_BLOCK = 0
CAPTURE_SIZES = (1, 2, 4, 8)

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=CAPTURE_SIZES,
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=NULL_BLOCK,
)


class DecodeWrapper:
    """Persistent plan workspace for one attention kind (window None = global)."""

    def __init__(self, window: int | None, rows: int, width: int) -> None:
        self.window = window
        self.tables = torch.zeros(rows, width, dtype=torch.int64, device="cuda")
        self.start = torch.zeros(rows, dtype=torch.int64, device="cuda")
        self.end = torch.ones(rows, dtype=torch.int64, device="cuda")
        self._staging = torch.zeros(rows, width + 2, dtype=torch.int64, pin_memory=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()
        self.pending: tuple[list[list[int]], list[int]] | None = None

    def plan(self, tables: list[list[int]], positions: list[int]) -> None:
        """Host-side planning for len(positions) token rows; rows past them keep old contents."""
        n = len(positions)
        if n == 0:
            return
        self._uploaded.synchronize()  # the last upload has read the staging
        stage = self._staging
        for i, (row, pos) in enumerate(zip(tables, positions, strict=True)):
            start = 0 if self.window is None else max(0, pos + 1 - self.window)
            stage[i, 0] = start
            stage[i, 1] = pos + 1
            stage[i, 2:] = torch.tensor(row, dtype=torch.int64)
        self.start[:n].copy_(stage[:n, 0], non_blocking=True)
        self.end[:n].copy_(stage[:n, 1], non_blocking=True)
        self.tables[:n].copy_(stage[:n, 2:], non_blocking=True)
        self._uploaded.record()
        self.pending = None

    def run(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: int) -> Tensor:
        bs = SPEC.block_size
        tables, start, end = self.tables[:rows], self.start[:rows], self.end[:rows]
        offs = torch.arange(bs, device="cuda")
        ctx = (tables[:, :, None] * bs + offs).flatten(1)  # [T, context]
        keys, values = k_cache[ctx], v_cache[ctx]
        p = torch.arange(ctx.shape[1], device="cuda")[None, :]
        visible = (p >= start[:, None]) & (p < end[:, None])
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device="cuda"))
        return torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)


class TwoWrapperRunner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, defer: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.defer = defer
        s = SPEC
        self.context = s.max_blocks_per_req * s.block_size
        shapes = {
            "embed": (s.vocab_size, HIDDEN),
            "pos": (self.context, HIDDEN),
            "head": (HIDDEN, s.vocab_size),
        }
        for layer in range(2):
            for n in "qkvo":
                shapes[f"{n}{layer}"] = (HIDDEN, HIDDEN)
        self.weights = {n: torch.empty(sh, device="cuda") for n, sh in shapes.items()}
        self.load_weights(seed)
        slots = s.num_blocks * s.block_size
        self.kv = {
            f"{kind}{layer}": torch.zeros(slots, HEADS, HEAD_DIM, device="cuda")
            for layer in range(2)
            for kind in "kv"
        }
        t = s.max_num_tokens
        self.wrappers = [
            DecodeWrapper(None, t, s.max_blocks_per_req),
            DecodeWrapper(WINDOW, t, s.max_blocks_per_req),
        ]
        self.tokens = torch.zeros(t, dtype=torch.int64, device="cuda")
        self.positions = torch.zeros(t, dtype=torch.int64, device="cuda")
        self.slots = torch.zeros(t, dtype=torch.int64, device="cuda")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self._capture()

    # -- weights -------------------------------------------------------------------------------

    def load_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            for name in sorted(self.weights):
                w = self.weights[name]
                w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to("cuda"))

    def update_weights(self, seed: int) -> None:
        self.load_weights(seed)

    # -- inputs --------------------------------------------------------------------------------

    def _prepare(self, batch: Batch, rows: int, capture: bool = False) -> None:
        """Write the batch's tokens (one row per token) and pad to `rows` token rows."""
        s = SPEC
        width = s.max_blocks_per_req
        toks: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        for r in batch.requests:
            table = list(r.block_ids) + [NULL_BLOCK] * (width - len(r.block_ids))
            for j, tok in enumerate(r.tokens):
                p = r.context_len + j
                toks.append(tok)
                pos.append(p)
                slots.append(table[p // s.block_size] * s.block_size + p % s.block_size)
                tables.append(table)
        pad = rows - len(toks)
        null_row = [NULL_BLOCK] * width
        # padding token rows: token 0 at position 0, writing the null block's first slot;
        # at capture, row 0 is the warm-up's max-length dummy (over null blocks)
        pad_pos = [0] * pad
        if capture and pad:
            pad_pos[0] = self.context - 1
        toks += [0] * pad
        pos += pad_pos
        slots += [NULL_BLOCK * s.block_size] * pad
        tables += [null_row] * pad
        n = len(toks)
        self.tokens[:n].copy_(torch.tensor(toks, dtype=torch.int64))
        self.positions[:n].copy_(torch.tensor(pos, dtype=torch.int64))
        self.slots[:n].copy_(torch.tensor(slots, dtype=torch.int64))
        if self.defer and len(self.wrappers) > 1:
            # BUG (graph mode): with more than one wrapper, planning is left to forward_impl,
            # which a graph replay never runs
            for w in self.wrappers:
                w.pending = (tables, pos)
        else:
            for w in self.wrappers:
                w.plan(tables, pos)

    # -- model ---------------------------------------------------------------------------------

    def _forward(self, rows: int, last: Tensor | None) -> tuple[Tensor, Tensor]:
        for wr in self.wrappers:  # forward_impl: run deferred plans
            if wr.pending is not None:
                wr.plan(*wr.pending)
        w = self.weights
        ids, pos, slots = self.tokens[:rows], self.positions[:rows], self.slots[:rows]
        x = w["embed"][ids] + w["pos"][pos]
        for layer, wrapper in enumerate(self.wrappers):
            q, k, v = (x @ w[f"{n}{layer}"] for n in "qkv")
            kc, vc = self.kv[f"k{layer}"], self.kv[f"v{layer}"]
            kc.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
            vc.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
            x = x + wrapper.run(q, kc, vc, rows) @ w[f"o{layer}"]
        hidden = x if last is None else x[last]
        logits = hidden @ w["head"]
        return logits, logits.argmax(-1)

    # -- graphs --------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in sorted(CAPTURE_SIZES, reverse=True):
                self._prepare(Batch(()), size, capture=True)
                self._forward(size, None)  # warm-up (runs the deferred plans)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[size] = self._forward(size, None)
                self.graphs[size] = g
            torch.cuda.synchronize()

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(len(r.tokens) != 1 for r in batch.requests):
            return "query length above one"
        if batch.num_reqs > max(CAPTURE_SIZES):
            return "more requests than the largest graph"
        return None

    # -- contract ------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        reason = self.fallback_reason(batch)
        with torch.inference_mode():
            if reason is None:
                size = next(c for c in CAPTURE_SIZES if c >= n)
                self._prepare(batch, size)
                self.graphs[size].replay()
                logits, tokens = self.outputs[size]
                return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
            vocab = SPEC.vocab_size
            if n == 0:
                return StepResult(
                    torch.zeros(0, vocab, device="cuda"),
                    torch.zeros(0, dtype=torch.int64, device="cuda"),
                    "eager",
                    None,
                    reason=reason,
                )
            T = batch.num_tokens
            self._prepare(batch, T)
            lens = torch.tensor([len(r.tokens) for r in batch.requests])
            last = (torch.cumsum(lens, 0) - 1).to("cuda")
            logits, tokens = self._forward(T, last)
            return StepResult(logits.clone(), tokens.clone(), "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return self.kv

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode != "graph":
            return {}
        out = {"tokens": self.tokens, "positions": self.positions, "slots": self.slots}
        for i, w in enumerate(self.wrappers):
            out[f"plan{i}_tables"] = w.tables
            out[f"plan{i}_start"] = w.start
            out[f"plan{i}_end"] = w.end
        return out

    def address_views(self) -> Sequence[AddressView]:
        return []

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> TwoWrapperRunner:
    return TwoWrapperRunner(mode, seed=seed, defer=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> TwoWrapperRunner:
    return TwoWrapperRunner(mode, seed=seed, defer=True)
