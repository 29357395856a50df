"""A decode runner written against the backend facade, using streams and events the way a
production engine does.

Runner: a one-layer paged-KV decoder (embedding + positions, attention through block tables, SiLU
MLP, LM head, counter-based Gumbel sampling). Its stream layout follows vLLM/SGLang-style model
runners:

- a high-priority *decode stream* (`Stream(priority=...)`, the highest priority the backend's
  `Stream.priority_range()` gives) runs every forward: graph replays and eager fallbacks;
- a low-priority *upload stream* moves each step's host inputs from one pinned staging buffer
  (`empty_pinned`, like vLLM's `CpuGpuBuffer`) into fresh device "landing" tensors allocated on the
  upload stream; a `blocking=True` event recorded after the copy is the host's guard before the
  staging buffer is written again (vLLM's `prepare_inputs_event`);
- the landing tensors are handed to the decode stream (`wait_event`) and marked with
  `record_stream(decode)` before they are dropped, so the caching allocator does not give their
  blocks to the next step's upload while the decode stream still reads them;
- decode graphs are captured on a separate capture stream after warm-up iterations on that
  stream, largest size first, into one `graph_pool_handle()` pool shared by all sizes, and
  replayed on the decode stream, bracketed by `enable_timing=True` events whose elapsed time is
  harvested lazily (`query()`), as engines collect step timings;
- results are cloned on the decode stream and `record_stream`-ed onto the caller's stream, which
  is made to wait for the decode stream before `step` returns.

`make_target`: the correct runner.

`make_buggy_target`: the landing tensors are dropped without `record_stream(decode_stream)`. On a
GPU the caching allocator returns their blocks to the upload stream's free list at once; the next
step's upload (an overlapped step under async scheduling) is handed the same block and its H2D
copy overwrites the previous step's inputs before the decode stream's D2D copy/forward read them.
Modelled on the classic cross-stream allocator hazard documented in pytorch/pytorch#23729
(https://github.com/pytorch/pytorch/issues/23729) and fixed the same way in
https://github.com/pytorch/pytorch/pull/193686 (FSDP2: output produced on a side stream, consumed
on the caller's, missing record_stream) and https://github.com/meta-pytorch/torchrec/pull/4231.

`make_buggy_target_staging` (a second, optional variant): the sampling temperatures are written
into the pinned staging buffer *before* the host waits on the previous upload's event (the guarded
section is too small), modelled on vLLM's "Fix async scheduling CPU tensor race take 2"
(https://github.com/vllm-project/vllm/pull/25279: sampling tensors were modified outside the
synchronized section).

No code is copied from those projects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
MB = SPEC.max_blocks_per_req
# packed int64 row: token, position, slot, table[MB], then per-request columns seed, sampled, last
C_TOK, C_POS, C_SLOT, C_TAB = 0, 1, 2, 3
C_SEED, C_SAMPLED, C_LAST = 3 + MB, 4 + MB, 5 + MB
WIDTH = 6 + MB
WARMUP_ITERS = 2
M32 = 0xFFFFFFFF


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
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
        self.device = device
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def forward(
        self, rows: Tensor, temps: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> tuple[Tensor, Tensor]:
        """rows: [T, WIDTH] packed ints (request columns valid in the first R rows); temps: [R]."""
        w, r = self.w, temps.shape[0]
        tokens, positions, slots = rows[:, C_TOK], rows[:, C_POS], rows[:, C_SLOT]
        tables = rows[:, C_TAB : C_TAB + MB]
        seeds, sampled, last = rows[:r, C_SEED], rows[:r, C_SAMPLED] != 0, rows[:r, C_LAST]
        x = w["embed"][tokens] + w["pos"][positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=x.device)
        ctx = (tables[:, :, None] * SPEC.block_size + offs).flatten(1)
        keys, vals = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=x.device))
        att = torch.einsum("thc,tchd->thd", scores.softmax(-1), vals).flatten(1)
        x = x + att @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        x = x[last]
        logits = _rms(x) @ w["head"]
        # Gumbel-max from a hash of (seed, position, token id): batch- and replay-independent.
        key = _hash(_hash(seeds) ^ ((positions[last] * 0x9E3779B1) & M32))
        ids = torch.arange(SPEC.vocab_size, device=x.device)
        bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
        u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = logits / temps[:, None] - torch.log(-torch.log(u))
        return logits, torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (MB - len(r.block_ids))


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _sampling(r: Request) -> tuple[int, float, int]:
    if r.seed is None:
        return 0, 1.0, 0
    return r.seed & M32, float(r.temperature), 1


class FacadeStreamRunner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        record_handoff: bool = True,
        temps_inside_guard: bool = True,
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.be: Any = get_backend(backend)
        self.record_handoff = record_handoff
        self.temps_inside_guard = temps_inside_guard
        dev = self.be.device
        self.model = Model(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        # Streams: decode gets the highest priority the backend offers, uploads the lowest.
        low, high = self._priority_range()
        self.decode_stream = self.be.Stream(priority=high)
        self.upload_stream = self.be.Stream(priority=low)
        self.capture_stream = self.be.Stream()
        # One pinned staging buffer (vLLM CpuGpuBuffer style), guarded by a blocking event.
        self.stage_i = self.be.empty_pinned((SPEC.max_num_tokens, WIDTH), dtype=torch.int64)
        self.stage_f = self.be.empty_pinned((SPEC.max_num_reqs,), dtype=torch.float32)
        self.upload_done = self.be.Event(blocking=True)
        # Step timing on the decode stream, harvested lazily.
        self.t_begin = self.be.Event(enable_timing=True)
        self.t_end = self.be.Event(enable_timing=True)
        self.timing_pending = False
        self.step_ms: list[float] = []
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.static_i: Tensor | None = None
        self.static_f: Tensor | None = None
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            self.static_i = torch.zeros(rows, WIDTH, dtype=torch.int64, device=dev)
            self.static_f = torch.ones(rows, device=dev)
            self._capture_all()

    def _priority_range(self) -> tuple[int, int]:
        get_range = getattr(self.be.Stream, "priority_range", None)
        if get_range is None:
            return 0, 0
        low, high = get_range()
        return int(low), int(high)

    # -- host staging and upload ----------------------------------------------------------------

    def _write_temps(self, temps: Sequence[float]) -> None:
        for i, t in enumerate(temps):
            self.stage_f[i] = t

    def _stage_and_upload(
        self, ints: list[list[int]], temps: list[float]
    ) -> tuple[Tensor, Tensor, Any]:
        """Stage the packed rows in pinned memory and upload them on the upload stream into fresh
        landing tensors allocated there. Returns them and the event the consumer waits on."""
        t_rows, r_rows = len(ints), len(temps)
        if not self.temps_inside_guard:
            self._write_temps(temps)  # BUG (variant): written before the guard below
        self.upload_done.synchronize()  # the previous upload has read the staging buffer
        if self.temps_inside_guard:
            self._write_temps(temps)
        self.stage_i[:t_rows].copy_(torch.tensor(ints, dtype=torch.int64).view(t_rows, WIDTH))
        with self.be.stream(self.upload_stream):
            land_i = torch.empty((t_rows, WIDTH), dtype=torch.int64, device=self.be.device)
            land_f = torch.empty((r_rows,), dtype=torch.float32, device=self.be.device)
            land_i.copy_(self.stage_i[:t_rows], non_blocking=True)
            land_f.copy_(self.stage_f[:r_rows], non_blocking=True)
            self.upload_done.record(self.upload_stream)
        return land_i, land_f, self.upload_done

    def _hand_off(self, *tensors: Tensor) -> None:
        """Tensors allocated on the upload stream and read on the decode stream."""
        if self.record_handoff:
            for t in tensors:
                t.record_stream(self.decode_stream)

    # -- graph capture ----------------------------------------------------------------------------

    def _padding_rows(self, start: int, size: int) -> list[list[int]]:
        row = [0, 0, NULL_SLOT] + [SPEC.null_block] * MB + [0, 0, 0]
        out = []
        for i in range(start, size):
            r = list(row)
            r[C_LAST] = i
            out.append(r)
        return out

    def _capture_all(self) -> None:
        assert self.static_i is not None and self.static_f is not None
        pool = self.be.graph_pool_handle()
        cur = self.be.current_stream()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            pad = torch.tensor(self._padding_rows(0, size), dtype=torch.int64)
            self.static_i[:size].copy_(pad.to(self.be.device))
            self.static_f[:size].fill_(1.0)
            si, sf = self.static_i[:size], self.static_f[:size]
            self.capture_stream.wait_stream(cur)
            with self.be.stream(self.capture_stream):
                for _ in range(WARMUP_ITERS):
                    self.model.forward(si, sf, self.k_cache, self.v_cache)
            cur.wait_stream(self.capture_stream)
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool, stream=self.capture_stream):
                self.outputs[size] = self.model.forward(si, sf, self.k_cache, self.v_cache)
            self.graphs[size] = graph

    # -- steps --------------------------------------------------------------------------------------

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def _host_rows(self, batch: Batch, pad_to: int | None) -> tuple[list[list[int]], list[float]]:
        ints: list[list[int]] = []
        temps: list[float] = []
        lasts: list[int] = []
        for r in batch.requests:
            for i, tok in enumerate(r.tokens):
                pos = r.context_len + i
                ints.append([tok, pos, _slot(r, pos), *_table(r), 0, 0, 0])
            lasts.append(len(ints) - 1)
        for j, r in enumerate(batch.requests):
            seed, temp, sampled = _sampling(r)
            ints[j][C_SEED], ints[j][C_SAMPLED], ints[j][C_LAST] = seed, sampled, lasts[j]
            temps.append(temp)
        if pad_to is not None:
            ints += self._padding_rows(len(ints), pad_to)
            temps += [1.0] * (pad_to - len(temps))
        return ints, temps

    def _harvest_timing(self) -> None:
        if self.timing_pending and self.t_end.query():
            self.step_ms.append(self.t_begin.elapsed_time(self.t_end))
            self.timing_pending = False

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        n = batch.num_reqs
        size = None if reason else next(s for s in SPEC.capture_sizes if s >= n)
        ints, temps = self._host_rows(batch, size)
        land_i, land_f, uploaded = self._stage_and_upload(ints, temps)
        self._harvest_timing()
        caller = self.be.current_stream()
        dec = self.decode_stream
        dec.wait_stream(caller)  # the caller's writes (state, static buffers) come first
        dec.wait_event(uploaded)
        record_timing = not self.timing_pending
        with self.be.stream(dec):
            if record_timing:
                self.t_begin.record(dec)
            if reason is None:
                assert self.static_i is not None and self.static_f is not None and size
                self.static_i[:size].copy_(land_i)
                self.static_f[:size].copy_(land_f)
                self.graphs[size].replay()
                logits_s, tokens_s = self.outputs[size]
                logits, tokens = logits_s[:n].clone(), tokens_s[:n].clone()
                path, key = "full", ("decode", size)
            else:
                logits, tokens = self.model.forward(land_i, land_f, self.k_cache, self.v_cache)
                path, key = "eager", None
            if record_timing:
                self.t_end.record(dec)
                self.timing_pending = True
        self._hand_off(land_i, land_f)
        del land_i, land_f
        for t in (logits, tokens):
            t.record_stream(caller)  # allocated on the decode stream, used on the caller's
        caller.wait_stream(dec)
        return StepResult(logits, tokens, path, key, reason=reason)  # type: ignore[arg-type]

    # -- contract -----------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.static_i is None or self.static_f is None:
            return {}
        return {"ints": self.static_i, "temps": self.static_f}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        # in place, on the caller's stream, after the decode stream's work (replays read them)
        self.be.current_stream().wait_stream(self.decode_stream)
        self.model.load(seed)

    def close(self) -> None:
        self.be.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> FacadeStreamRunner:
    return FacadeStreamRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> FacadeStreamRunner:
    """Landing tensors handed from the upload stream to the decode stream without record_stream."""
    return FacadeStreamRunner(mode, seed=seed, backend=backend, record_handoff=False)


def make_buggy_target_staging(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> FacadeStreamRunner:
    """Temperatures written into the pinned staging buffer before the upload-done guard."""
    return FacadeStreamRunner(mode, seed=seed, backend=backend, temps_inside_guard=False)
