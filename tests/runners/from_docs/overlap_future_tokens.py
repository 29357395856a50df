"""Overlap-scheduler decode runner with a device-side "future map" (SGLang style), plain torch.cuda.

What it is. The host stages step N+1 while step N may still be queued on the device. Inputs go
pinned host buffer -> device staging tensor (ring of two) on a copy ("schedule") stream; a forward
stream copies them into the graph's static buffers, resolves placeholders, and replays one
`torch.cuda.CUDAGraph` per capture size (1, 2, 4 requests; other batches run eagerly). A
continuing request's value that step N produces on the device is not staged from the host:
its row holds a negative placeholder `-slot`, and a small resolve kernel
(`where(x < 0, future_map[-x], x)`) reads it from a device-side future map that step N's graph
(or eager forward) wrote at `slot`. Slots come from a host-side ring (`RING` entries, slot 0
reserved for padding rows); a slot is handed out again only after its entry is forgotten, so a
pending placeholder never points at a reused slot.

Adaptation to the contract. SGLang relays `next_token_ids` through the map. The harness supplies
every step's tokens, which are seldom the ones the previous step sampled, so a runner that fed
its own samples back would be wrong by the contract. This runner relays the one per-request value
of the same kind that the contract lets step N decide on the device: the request's next input
position (its seq_len,
written by step N's graph as `position + 1`). The host uses the placeholder only where the new
batch's `context_len` equals the seq_len it recorded for that request at its last step
(otherwise it stages the position itself). The resolved position drives the position embedding,
the KV slot (computed on the device from the block table), the attention mask and the sampling
hash, so a stale map entry shows in logits, samples and KV writes.

Correct ordering (make_target): the resolve runs on the forward stream, after the copy-in and in
stream order after step N's replay (and after an eager step's map write on the current stream,
which the forward stream waits for at every step).

The bug (make_buggy_target): the resolve runs on the copy/schedule stream right after the upload
into the device staging tensor, ordered after the upload only, not after the forward stream that
is still writing step N's map entries. In a pipelined pair step N+1 reads the map before step N
wrote it (a stale position). Modelled on SGLang's cross-stream FutureMap races:
  - https://github.com/sgl-project/sglang/pull/35748 ("Fix overlap prebuilt row reuse race":
    FutureMap publish() from the schedule stream must wait for the forward stream),
  - https://github.com/sgl-project/sglang/pull/35198 (state written by the forward stream was
    gathered on the schedule stream while that forward may still be in flight; fix: relay it
    through the FutureMap and resolve on the forward stream, in order after the stash),
  - ring-slot lifetime class: https://github.com/sgl-project/sglang-jax/issues/1487,
    https://github.com/sgl-project/sglang/pull/13713, https://github.com/sgl-project/sglang/pull/25862
    (not this module's bug; the correct runner guards against it by forgetting reused slots).
No engine code is copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec

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
BS = SPEC.block_size
CONTEXT = SPEC.max_blocks_per_req * BS
RING = 3 * SPEC.max_num_reqs + 1  # slot 0: padding rows write it, no placeholder reads it
MASK32 = 0xFFFFFFFF
# int64 input columns: token, position-or-placeholder, future slot written, seed, sampled, table...
C_TOK, C_POS, C_OUT, C_SEED, C_SAMP, C_TAB = 0, 1, 2, 3, 4, 5
WIDTH = C_TAB + SPEC.max_blocks_per_req


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


class Model:
    def __init__(self, seed: int) -> None:
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
        self.w = {n: torch.empty(s, device="cuda") for n, s in shapes.items()}
        self.load(seed)
        self.k = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device="cuda")
        self.v = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device="cuda")

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to("cuda"))

    def forward(
        self, ints: Tensor, temps: Tensor, last: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """ints: [T, WIDTH] (positions resolved); temps: [R]. Logits, tokens and next positions of
        the R rows (the last query token of each request)."""
        w = self.w
        tokens, pos, tables = ints[:, C_TOK], ints[:, C_POS], ints[:, C_TAB:]
        slots = tables.gather(1, (pos // BS)[:, None]).squeeze(1) * BS + pos % BS
        x = w["embed"][tokens] + w["pos"][pos]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = (h @ w[n] for n in "qkv")
        self.k.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        ctx = (tables[:, :, None] * BS + torch.arange(BS, device=x.device)).flatten(1)
        keys, vals = self.k[ctx], self.v[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= pos[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(
            HEAD_DIM
        )
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", probs, vals).flatten(1) @ w["o"]
        x = x + torch.nn.functional.silu(x @ w["up"]) @ w["down"]
        rows = ints if last is None else ints[last]
        if last is not None:
            x = x[last]
        logits = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) @ w["head"]
        rpos = rows[:, C_POS]
        key = _mix(_mix(rows[:, C_SEED]) ^ ((rpos * 0x9E3779B1) & MASK32))
        ids = torch.arange(SPEC.vocab_size, device=x.device)
        bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & MASK32)[None, :])
        u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = logits / temps[:, None] - torch.log(-torch.log(u))
        toks = torch.where(rows[:, C_SAMP] != 0, noisy.argmax(-1), logits.argmax(-1))
        return logits, toks, rpos + 1


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, int, float]:
    if r.seed is None or r.temperature <= 0:
        return 0, 0, 1.0
    return r.seed & MASK32, 1, float(r.temperature)


PAD_ROW = [0, 0, 0, 0, 0] + [SPEC.null_block] * SPEC.max_blocks_per_req


class OverlapRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, resolve_on_copy_stream: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec, self.mode, self.bug = SPEC, mode, resolve_on_copy_stream
        self.model = Model(seed)
        self.future_map = torch.zeros(RING, dtype=torch.int64, device="cuda")
        self.ring_ct = 0
        self.pending: dict[int, tuple[int, int]] = {}  # req_id -> (slot, seq_len it will resume at)
        self.slot_owner: dict[int, int] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self.static_i = torch.zeros(0)
        self.static_f = torch.zeros(0)
        if mode == "graph":
            rows = max(SPEC.capture_sizes)
            self.pin_i = [
                torch.zeros(rows, WIDTH, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
            self.pin_f = [torch.ones(rows, dtype=torch.float32, pin_memory=True) for _ in range(2)]
            self.dev_i = [
                torch.zeros(rows, WIDTH, dtype=torch.int64, device="cuda") for _ in range(2)
            ]
            self.dev_f = [torch.ones(rows, device="cuda") for _ in range(2)]
            self.static_i = torch.zeros(rows, WIDTH, dtype=torch.int64, device="cuda")
            self.static_f = torch.ones(rows, device="cuda")
            self.uploaded = [torch.cuda.Event() for _ in range(2)]
            self.consumed = [torch.cuda.Event() for _ in range(2)]
            self.copy_stream = torch.cuda.Stream()
            self.fwd_stream = torch.cuda.Stream()
            self.flip = 0
            self._capture()

    # -- future slots (host ring) -------------------------------------------------------------------

    def _alloc(self, reqs: Sequence[Request]) -> list[int]:
        """One ring slot per request; a slot handed out again drops the placeholder that read it."""
        slots = []
        for r in reqs:
            slot = 1 + self.ring_ct
            self.ring_ct = (self.ring_ct + 1) % (RING - 1)
            old = self.slot_owner.get(slot)
            if old is not None and self.pending.get(old, (None,))[0] == slot:
                del self.pending[old]
            self.slot_owner[slot] = r.req_id
            slots.append(slot)
        return slots

    def _position_or_placeholder(self, r: Request) -> int:
        entry = self.pending.get(r.req_id)
        if entry is not None and entry[1] == r.context_len and r.context_len > 0:
            return -entry[0]
        return r.context_len

    def _record(self, reqs: Sequence[Request], slots: Sequence[int]) -> None:
        for r, s in zip(reqs, slots, strict=True):
            self.pending[r.req_id] = (s, r.seq_len)

    def _resolve(self, ints: Tensor) -> None:
        p = ints[:, C_POS]
        p.copy_(torch.where(p < 0, self.future_map[(-p).clamp(min=0)], p))

    # -- graph path ---------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.static_i[:size].copy_(torch.tensor([PAD_ROW] * size, dtype=torch.int64))
            self.static_f[:size].fill_(1.0)
            self._graph_body(size)  # warm-up
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[size] = self._graph_body(size)
            self.graphs[size] = g
        torch.cuda.synchronize()

    def _graph_body(self, size: int) -> tuple[Tensor, Tensor, Tensor]:
        ints = self.static_i[:size]
        logits, toks, nxt = self.model.forward(ints, self.static_f[:size], None)
        self.future_map.index_copy_(0, ints[:, C_OUT], nxt)  # step N's future entries
        return logits, toks, nxt

    def _stage(self, reqs: Sequence[Request], slots: Sequence[int], size: int, k: int) -> None:
        self.uploaded[k].synchronize()  # the upload that last read pin[k] has run
        rows = []
        for r, s in zip(reqs, slots, strict=True):
            seed, samp, temp = _sampling(r)
            rows.append(
                ([r.tokens[0], self._position_or_placeholder(r), s, seed, samp, *_table(r)], temp)
            )
        rows += [(PAD_ROW, 1.0)] * (size - len(reqs))
        self.pin_i[k][:size].copy_(torch.tensor([x for x, _ in rows], dtype=torch.int64))
        self.pin_f[k][:size].copy_(torch.tensor([t for _, t in rows], dtype=torch.float32))

    def _replay(self, batch: Batch, size: int) -> StepResult:
        k, self.flip = self.flip, 1 - self.flip
        reqs = batch.requests
        slots = self._alloc(reqs)
        self._stage(reqs, slots, size, k)
        with torch.cuda.stream(self.copy_stream):  # schedule stream: upload step N+1's inputs
            self.copy_stream.wait_event(self.consumed[k])  # dev[k] copied in by its last step
            self.dev_i[k][:size].copy_(self.pin_i[k][:size], non_blocking=True)
            self.dev_f[k][:size].copy_(self.pin_f[k][:size], non_blocking=True)
            if self.bug:
                self._resolve(self.dev_i[k][:size])  # BUG: not ordered after step N's forward
            self.uploaded[k].record()
        cur = torch.cuda.current_stream()
        self.fwd_stream.wait_stream(cur)  # harness poisoning, eager steps' map and KV writes
        with torch.cuda.stream(self.fwd_stream):
            self.fwd_stream.wait_event(self.uploaded[k])
            self.static_i[:size].copy_(self.dev_i[k][:size])
            self.static_f[:size].copy_(self.dev_f[k][:size])
            self.consumed[k].record()
            if not self.bug:
                self._resolve(self.static_i[:size])  # in order after step N's replay
            self.graphs[size].replay()
        cur.wait_stream(self.fwd_stream)
        self._record(reqs, slots)
        logits, toks, _ = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), toks[:n].clone(), "full", ("decode", size))

    # -- eager path (both twins) ----------------------------------------------------------------------

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        rows, temps, last = [], [], []
        for r in batch.requests:
            seed, samp, temp = _sampling(r)
            for i, t in enumerate(r.tokens):
                rows.append([t, r.context_len + i, 0, seed, samp, *_table(r)])
            last.append(len(rows) - 1)
            temps.append(temp)
        ints = torch.tensor(rows, dtype=torch.int64, device="cuda").view(-1, WIDTH)
        temps_t = torch.tensor(temps, dtype=torch.float32, device="cuda")
        last_t = torch.tensor(last, dtype=torch.int64, device="cuda")
        logits, toks, nxt = self.model.forward(ints, temps_t, last_t)
        if self.mode == "graph" and batch.num_reqs:
            slots = self._alloc(batch.requests)
            self.future_map.index_copy_(0, torch.tensor(slots, device="cuda"), nxt)
            self._record(batch.requests, slots)
        return StepResult(logits, toks, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens) or any(r.context_len == 0 for r in batch.requests):
            return "not a one-token decode batch"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
            return self._replay(batch, size)
        return self._eager(batch, reason)

    # -- contract --------------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.model.k, "v": self.model.v}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {"ints": self.static_i, "temps": self.static_f} if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OverlapRunner:
    return OverlapRunner(mode, seed=seed, resolve_on_copy_stream=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OverlapRunner:
    return OverlapRunner(mode, seed=seed, resolve_on_copy_stream=True)
