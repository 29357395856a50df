"""A decode runner that captures its CUDA graphs lazily, while serving (plain `torch.cuda`).

What it is: a one-layer paged-KV decoder (embedding + learned positions, attention through block
tables over a slot-major cache, SiLU MLP, LM head, counter-hash Gumbel sampling). Nothing is
captured at start-up. The first time a decode batch (one query token per request, at most 4 rows)
needs capture size c, the step captures c on the spot and then replays it:

  1. stage c padding rows in pinned memory and upload them (copy stream) into the static buffers;
  2. warm up once on the runner's capture stream, which first waits for the current stream (so
     for the previous step's replay or eager forward still in flight, and for the upload);
  3. capture on that stream with `torch.cuda.graph(..., pool=<one shared pool>, stream=...)`,
     which synchronizes the device first;
  4. upload the real batch (it waits for the warm-up through the current stream) and replay.

Host inputs always go through a ring of two pinned staging buffers; before the host rewrites one
it waits for the event recorded after the last upload out of it, and the copy stream waits for
the current stream before it overwrites device inputs that earlier work may still read. So a lazy
capture in the middle of a pipelined pair (the previous step's uploads and forward still queued)
is ordered after that work, and the graph reads only device static buffers (never the staging
contents of some step as constants). Prefill, mixed, speculative and >4-row batches run eagerly.

The padding / null block of this runner is the LAST block (`NULL_BLOCK = NUM_BLOCKS - 1`), as in
engines that keep a reserved dummy slot at the end of the pool.

The bug (`make_buggy_target`): the lazy capture's warm-up uses zero-filled dummy inputs
(`static.zero_()`: token 0, position 0, slot 0, block table all 0) instead of padding rows that
point at the null block. At start-up that is harmless (the cache holds nothing yet, and every
request writes a slot before it reads it), which is why engines got away with zero dummies while
they captured before serving. Captured lazily, the warm-up forward runs on the LIVE cache and
stores the dummy token's key/value into slot 0 of block 0, which may belong to a running request
(its position-0 entry is clobbered; later tokens attend to garbage).

Modelled on: SGLang "[BUGFIX] Skip Mamba Cache Slot 0 to Avoid Using Dummy Cache"
(https://github.com/sgl-project/sglang/pull/17404: the CUDA-graph capture's dummy run writes the
dummy state into slot 0, which the pool still hands out to requests), combined with vLLM's lazy /
delayed CUDA-graph capture proposals (https://github.com/vllm-project/vllm/issues/20098,
https://github.com/vllm-project/vllm/pull/22897, https://github.com/vllm-project/vllm/pull/23184),
where capture (and its dummy warm-up run) moves from start-up into serving. No engine code copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot

NUM_BLOCKS, BLOCK, MAX_BLOCKS = 24, 4, 6
NULL_BLOCK = NUM_BLOCKS - 1
NULL_SLOT = NULL_BLOCK * BLOCK
SPEC = TargetSpec(
    num_blocks=NUM_BLOCKS,
    block_size=BLOCK,
    max_blocks_per_req=MAX_BLOCKS,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=NULL_BLOCK,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = MAX_BLOCKS * BLOCK
MASK32 = 0xFFFFFFFF
# int64 columns of one staged row: per token (token, position, slot, table...), then per request
# (seed, sampled, index of its last token) in the first R rows.
TOK, POS, SLOT, TAB = 0, 1, 2, 3
SEED, SAMPLED, LAST = TAB + MAX_BLOCKS, TAB + MAX_BLOCKS + 1, TAB + MAX_BLOCKS + 2
COLS = LAST + 1
ROWS = SPEC.max_num_tokens  # staging and eager buffers hold the largest step


def _padding_row() -> list[int]:
    row = [0] * COLS
    row[SLOT] = NULL_SLOT
    row[TAB : TAB + MAX_BLOCKS] = [NULL_BLOCK] * MAX_BLOCKS
    return row


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


class Staging:
    """One pinned staging slot of the ring, and the event its last upload recorded."""

    def __init__(self) -> None:
        self.ints = torch.zeros(ROWS, COLS, dtype=torch.int64, pin_memory=True)
        self.floats = torch.ones(ROWS, dtype=torch.float32, pin_memory=True)
        self.read = torch.cuda.Event()  # recorded after the copies out of this slot


class LazyCaptureRunner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        zero_dummy: bool,
        ordered_warmup: bool = True,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.zero_dummy = zero_dummy
        self.ordered_warmup = ordered_warmup
        dev = self.device = torch.device("cuda")
        with torch.inference_mode():
            shapes = {
                "embed": (SPEC.vocab_size, HIDDEN),
                "pos": (CONTEXT, HIDDEN),
                "q": (HIDDEN, HIDDEN),
                "k": (HIDDEN, HIDDEN),
                "v": (HIDDEN, HIDDEN),
                "o": (HIDDEN, HIDDEN),
                "up": (HIDDEN, 2 * HIDDEN),
                "down": (2 * HIDDEN, HIDDEN),
                "head": (HIDDEN, SPEC.vocab_size),
            }
            self.w = {n: torch.empty(s, device=dev) for n, s in shapes.items()}
            self._load(seed)
            self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
            self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
            # Device inputs: the graphs' static buffers (decode rows) and the eager path's.
            top = SPEC.capture_sizes[-1]
            self.static_ints = torch.zeros(top, COLS, dtype=torch.int64, device=dev)
            self.static_floats = torch.ones(top, device=dev)
            self.eager_ints = torch.zeros(ROWS, COLS, dtype=torch.int64, device=dev)
            self.eager_floats = torch.ones(ROWS, device=dev)
        self.ring = [Staging(), Staging()]
        self.turn = 0
        self.copy_stream = torch.cuda.Stream()
        self.capture_stream = torch.cuda.Stream()
        self.pool = None  # made at the first capture, shared by all
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}

    # -- weights --------------------------------------------------------------------------------

    def _load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self._load(seed)

    # -- staging and upload -----------------------------------------------------------------------

    def _upload(
        self, ints: list[list[int]], floats: list[float], dst_i: Tensor, dst_f: Tensor
    ) -> None:
        """Stage rows in the next pinned ring slot, copy them on the copy stream into dst[:n], and
        make the current stream wait for the copy."""
        slot = self.ring[self.turn]
        self.turn ^= 1
        slot.read.synchronize()  # the last upload out of this slot has read it
        n = len(ints)
        slot.ints[:n].copy_(torch.tensor(ints, dtype=torch.int64))
        slot.floats[:n].copy_(torch.tensor(floats, dtype=torch.float32))
        current = torch.cuda.current_stream()
        self.copy_stream.wait_stream(current)  # earlier work has finished reading dst
        with torch.cuda.stream(self.copy_stream):
            dst_i[:n].copy_(slot.ints[:n], non_blocking=True)
            dst_f[:n].copy_(slot.floats[:n], non_blocking=True)
            slot.read.record()
        current.wait_event(slot.read)

    # -- the model --------------------------------------------------------------------------------

    def _forward(
        self, ints: Tensor, floats: Tensor, rows: int, gather: bool
    ) -> tuple[Tensor, Tensor]:
        """ints: [T, COLS] device; the first `rows` rows carry the per-request columns."""
        w = self.w
        tokens, positions, slots, tables = (
            ints[:, TOK],
            ints[:, POS],
            ints[:, SLOT],
            ints[:, TAB:SEED],
        )
        x = w["embed"][tokens] + w["pos"][positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(BLOCK, device=x.device)
        ctx = (tables[:, :, None] * BLOCK + offsets).flatten(1)  # [T, CONTEXT]
        keys, values = self.k_cache[ctx], self.v_cache[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(
            HEAD_DIM
        )
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", probs, values).flatten(1) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if gather:
            last = ints[:rows, LAST]
            x, positions = x[last], positions[last]
        logits = _rms(x) @ w["head"]
        return logits, self._sample(logits, ints[:rows], floats[:rows], positions)

    def _sample(self, logits: Tensor, req: Tensor, temps: Tensor, positions: Tensor) -> Tensor:
        key = _mix(_mix(req[:, SEED]) ^ ((positions * 0x9E3779B1) & MASK32))
        ids = torch.arange(logits.shape[-1], device=logits.device)
        bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & MASK32)[None, :])
        uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
        return torch.where(req[:, SAMPLED] != 0, noisy.argmax(-1), logits.argmax(-1))

    # -- lazy capture ---------------------------------------------------------------------------

    def _capture(self, size: int) -> None:
        """Capture `size` now, in the middle of serving; earlier steps may still be in flight."""
        current = torch.cuda.current_stream()
        if self.zero_dummy:
            # BUG: zero dummies (slot 0, block table of block 0) instead of null-block padding.
            self.static_ints[:size].zero_()  # on the current stream, after the in-flight step
            self.static_floats[:size].fill_(1.0)
        else:
            self._upload(
                [_padding_row()] * size, [1.0] * size, self.static_ints, self.static_floats
            )
        ints, floats = self.static_ints[:size], self.static_floats[:size]
        if self.ordered_warmup:
            self.capture_stream.wait_stream(current)  # after the in-flight step and the upload
        with torch.cuda.stream(self.capture_stream):
            self._forward(ints, floats, size, gather=False)  # warm-up on the live cache
        current.wait_stream(self.capture_stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
            self.outputs[size] = self._forward(ints, floats, size, gather=False)
        self.graphs[size] = graph

    # -- contract -------------------------------------------------------------------------------

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length above one (prefill, mixed or speculative)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            if reason is not None:
                return self._eager(batch, reason)
            n = batch.num_reqs
            size = next(s for s in SPEC.capture_sizes if s >= n)
            if size not in self.graphs:
                self._capture(size)
            ints, floats = _rows(batch)
            pad = size - n
            self._upload(
                ints + [_padding_row()] * pad,
                floats + [1.0] * pad,
                self.static_ints,
                self.static_floats,
            )
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.empty(0, SPEC.vocab_size, device=self.device)
            return StepResult(
                empty,
                torch.empty(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason=reason,
            )
        ints, floats = _rows(batch)
        t, r = len(ints), batch.num_reqs
        self._upload(ints, floats + [1.0] * (t - r), self.eager_ints, self.eager_floats)
        logits, tokens = self._forward(self.eager_ints[:t], self.eager_floats[:t], r, gather=True)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode == "eager":
            return {}
        return {
            "static_ints": self.static_ints,
            "static_floats": self.static_floats,
            "eager_ints": self.eager_ints,
            "eager_floats": self.eager_floats,
        }

    def address_views(self) -> Sequence[AddressView]:
        return []

    def close(self) -> None:
        torch.cuda.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rows(batch: Batch) -> tuple[list[list[int]], list[float]]:
    """Per-token rows, with each request's sampling columns in row r; temperatures per request."""
    ints: list[list[int]] = []
    last: list[int] = []
    for req in batch.requests:
        table = list(req.block_ids) + [NULL_BLOCK] * (MAX_BLOCKS - len(req.block_ids))
        for i, tok in enumerate(req.tokens):
            pos = req.context_len + i
            row = [0] * COLS
            row[TOK], row[POS], row[SLOT] = tok, pos, kv_slot(req.block_ids, pos, BLOCK)
            row[TAB : TAB + MAX_BLOCKS] = table
            ints.append(row)
        last.append(len(ints) - 1)
    floats = []
    for r, req in enumerate(batch.requests):
        sampled = req.seed is not None
        ints[r][SEED] = (req.seed & MASK32) if sampled else 0
        ints[r][SAMPLED] = int(sampled)
        ints[r][LAST] = last[r]
        floats.append(float(req.temperature) if sampled else 1.0)
    return ints, floats


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> LazyCaptureRunner:
    return LazyCaptureRunner(mode, seed=seed, zero_dummy=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> LazyCaptureRunner:
    return LazyCaptureRunner(mode, seed=seed, zero_dummy=True)


def make_buggy_target_unordered_warmup(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> LazyCaptureRunner:
    """Extra probe (not the module's bug): the lazy warm-up on the capture stream does not wait for
    the current stream, so it may run before the padding upload landed and while the previous
    step's forward still reads/writes the cache."""
    return LazyCaptureRunner(mode, seed=seed, zero_dummy=False, ordered_warmup=False)
