"""A decode runner with a pinned host KV store and swap-in before the step (plain torch.cuda).

What it is
----------
A one-layer paged-attention decoder (token + position embedding, attention over a slot-major KV
cache read through block tables, LM head, Gumbel-max sampling hashed from (seed, position, token))
written against plain `torch.cuda`, with KV offloading in the style of vLLM's CPU KV-offloading
connector / the old swap space and SGLang's hierarchical cache (HiCache):

- Store (write-through back-up): after every step, the blocks the step wrote are copied
  device -> pinned host store (`host_k` / `host_v`, slot-major like the device cache) on a
  dedicated copy stream that first waits for the compute; the current stream waits for that copy
  before `step()` returns (the harness marks and restores idle blocks on the current stream).
- Load (swap-in): a request that sat out the previous step (a request the runner treats as
  evicted: in an engine its device blocks would have been handed to others) gets the whole blocks
  holding its context copied back host -> device on the same copy stream, `non_blocking=True`,
  before the step runs. One copy stream for store and load keeps the pinned store from being
  rewritten while a copy out of it may still be in flight.
- Graph path: the step's integer inputs are staged in pinned memory and uploaded on the copy
  stream too; the replay, on the current stream, waits for the event `uploaded`, recorded on the
  copy stream after the swap-in copies and the upload. The eager path waits for `swapped`.

The bug (make_buggy_target)
---------------------------
The graph path issues the swap-in after it recorded `uploaded` (the load was bolted on after the
input upload, "to overlap it with the replay"), so the replay waits on an event recorded before
the swap-in copies: a graph may read, and write, a block before the reload lands. A reload that
lands after the replay overwrites the new token's keys/values in the returning request's partial
last block with the host copy's old bytes. Only graph replays are affected; the eager path waits
for `swapped` as before.

Public source: vLLM issue "CUDA Graph Replay Skips KV Transfer Synchronization in Full Cache Hit
Scenarios" (https://github.com/vllm-project/vllm/issues/29608: with FULL cudagraphs the replay
bypasses the connector's wait_for_layer_load, so attention may read a KV cache still being
loaded); the same race for a reloaded (retracted) request's decode replay in tokenspeed
(https://github.com/lightseekorg/tokenspeed/pull/370, "the replay ... read KV mid-reload": the
compute stream is fenced behind the host load-back stream); and SGLang HiCache's load-back/forward
ordering fixes (https://github.com/sgl-project/sglang/pull/36738). No code was copied.

Contract note: the harness is the block allocator and a request that sits out keeps its blocks
(marked during the step, restored after), so the runner cannot actually reuse an evicted
request's device blocks; its swap-in rewrites the context slots with the bits they already hold,
plus the not-yet-written slots of the partial last block, which the step then overwrites.
That partial block is what makes the bug visible by value: a late reload puts the host copy's old
bytes over the new token's slot. A runner that reloads full blocks only (as vLLM's CPU offloading
connector does) rewrites identical bits, and only sim's race checker can see the missing wait.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
BS = SPEC.block_size
CONTEXT = SPEC.max_blocks_per_req * BS
NULL_SLOT = SPEC.null_block * BS
# int columns of a row: token, position, slot, seed (-1: greedy), then the block table
NCOL = 4 + SPEC.max_blocks_per_req


@dataclass
class Entry:
    """What the runner knows about a request: how far its cache reaches, where, and when seen."""

    seq_len: int
    block_ids: tuple[int, ...]
    last_step: int


class OffloadRunner:
    def __init__(self, mode: str, *, seed: int, bug: bool) -> None:
        self.mode, self.bug = mode, bug
        self.device = torch.device("cuda")
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        gen = torch.Generator().manual_seed(seed)
        self.w = {}
        for name in sorted(shapes):
            s = shapes[name]
            self.w[name] = (torch.randn(s, generator=gen) / math.sqrt(s[0])).to(self.device)
        slots = SPEC.num_blocks * BS
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        # the offload tier: a pinned host mirror of every block, slot-major like the device cache
        self.host_k = torch.zeros(slots, HEADS, HEAD_DIM, pin_memory=True)
        self.host_v = torch.zeros(slots, HEADS, HEAD_DIM, pin_memory=True)
        self.copy_stream = torch.cuda.Stream()
        self.swapped = torch.cuda.Event()
        self.uploaded = torch.cuda.Event()
        self.stored = torch.cuda.Event()
        self.entries: dict[int, Entry] = {}
        self.step_no = 0
        rows = max(SPEC.capture_sizes)
        self.staging = torch.zeros(rows, NCOL, dtype=torch.int64, pin_memory=True)
        self.staging_t = torch.ones(rows, pin_memory=True)
        self.static = torch.zeros(rows, NCOL, dtype=torch.int64, device=self.device)
        self.static_t = torch.ones(rows, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self._capture()

    # -- graphs -------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._upload([], size, [])
            torch.cuda.current_stream().wait_event(self.uploaded)
            self._forward(self.static[:size], self.static_t[:size])  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(self.static[:size], self.static_t[:size])
            self.graphs[size] = graph

    def _row(self, r: Request, i: int) -> list[int]:
        pos = r.context_len + i
        table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
        seed = -1 if r.seed is None else r.seed & 0x7FFFFFFF
        return [r.tokens[i], pos, kv_slot(r.block_ids, pos, BS), seed, *table]

    @staticmethod
    def _pad_row() -> list[int]:
        return [0, 0, NULL_SLOT, -1] + [SPEC.null_block] * SPEC.max_blocks_per_req

    def _upload(self, reqs: Sequence[Request], size: int, reloads: list[int]) -> None:
        """Stage the rows (and padding rows) in pinned memory and upload them on the copy stream.
        The swap-in copies go on the same stream; `uploaded` must be recorded after both."""
        self.uploaded.synchronize()  # the previous upload has read the staging buffer
        for i in range(size):
            if i < len(reqs):
                self.staging[i] = torch.tensor(self._row(reqs[i], 0), dtype=torch.int64)
                self.staging_t[i] = float(reqs[i].temperature)
            else:
                self.staging[i] = torch.tensor(self._pad_row(), dtype=torch.int64)
                self.staging_t[i] = 1.0
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            if not self.bug:
                self._swap_in(reloads)
            self.static[:size].copy_(self.staging[:size], non_blocking=True)
            self.static_t[:size].copy_(self.staging_t[:size], non_blocking=True)
            self.uploaded.record()
            if self.bug:
                self._swap_in(reloads)  # BUG: issued after `uploaded`, which the replay waits on

    # -- offload tier ---------------------------------------------------------------------------

    def _reloads(self, batch: Batch) -> list[int]:
        """Blocks to load back: those holding the context of each request that sat out the
        previous step, when the runner still has that request's blocks in its host store."""
        blocks: list[int] = []
        for r in batch.requests:
            e = self.entries.get(r.req_id)
            if e is None or r.context_len == 0 or e.last_step >= self.step_no - 1:
                continue
            n = -(-r.context_len // BS)
            if r.context_len > e.seq_len or tuple(r.block_ids[:n]) != e.block_ids[:n]:
                continue  # not the request the store holds: nothing of ours to reload
            blocks.extend(r.block_ids[:n])
        return blocks

    def _swap_in(self, blocks: Sequence[int]) -> None:
        """Host -> device, whole blocks, on the current (copy) stream; records `swapped`."""
        for b in blocks:
            s = slice(b * BS, (b + 1) * BS)
            self.k_cache[s].copy_(self.host_k[s], non_blocking=True)
            self.v_cache[s].copy_(self.host_v[s], non_blocking=True)
        self.swapped.record()

    def _store(self, batch: Batch) -> None:
        """Back up the blocks this step wrote (device -> pinned host) after the compute; the
        current stream waits for it, as the harness marks idle blocks on the current stream."""
        blocks = sorted(
            {r.block_ids[p // BS] for r in batch.requests for p in range(r.context_len, r.seq_len)}
        )
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            for b in blocks:
                s = slice(b * BS, (b + 1) * BS)
                self.host_k[s].copy_(self.k_cache[s], non_blocking=True)
                self.host_v[s].copy_(self.v_cache[s], non_blocking=True)
            self.stored.record()
        torch.cuda.current_stream().wait_event(self.stored)

    # -- steps ----------------------------------------------------------------------------------

    def graph_size(self, batch: Batch) -> int | None:
        if self.mode != "graph" or batch.num_reqs == 0 or batch.phase != "decode":
            return None
        if batch.query_lens[0] != 1:
            return None
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    def step(self, batch: Batch) -> StepResult:
        reloads = self._reloads(batch)
        size = self.graph_size(batch)
        n = batch.num_reqs
        if size is not None:
            self._upload(batch.requests, size, reloads)
            torch.cuda.current_stream().wait_event(self.uploaded)
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            result = StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
        else:
            self.copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.copy_stream):
                self._swap_in(reloads)
            torch.cuda.current_stream().wait_event(self.swapped)
            result = self._eager(batch)
        self._store(batch)
        for r in batch.requests:
            self.entries[r.req_id] = Entry(r.seq_len, tuple(r.block_ids), self.step_no)
        self.step_no += 1
        return result

    def _eager(self, batch: Batch) -> StepResult:
        rows, temps, last = [], [], []
        for r in batch.requests:
            for i in range(len(r.tokens)):
                rows.append(self._row(r, i))
                temps.append(float(r.temperature))
            last.append(len(rows) - 1)
        if not rows:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(
                empty,
                torch.zeros(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason="empty batch",
            )
        host = torch.tensor(rows, dtype=torch.int64).to(self.device)
        t = torch.tensor(temps).to(self.device)
        logits, tokens = self._forward(host, t)
        idx = torch.tensor(last, dtype=torch.int64, device=self.device)
        reason = "eager twin" if self.mode == "eager" else f"{batch.phase} / shape not graphed"
        return StepResult(logits[idx], tokens[idx], "eager", None, reason=reason)

    # -- model ----------------------------------------------------------------------------------

    def _forward(self, rows: Tensor, temps: Tensor) -> tuple[Tensor, Tensor]:
        w = self.w
        tok, pos, slots, seeds, tables = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4:]
        x = w["embed"][tok] + w["pos"][pos]
        q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(BS, device=self.device)
        ctx = (tables[:, :, None] * BS + offsets).flatten(1)
        keys, vals = self.k_cache[ctx], self.v_cache[ctx]
        visible = torch.arange(CONTEXT, device=self.device)[None, :] <= pos[:, None]
        zero = torch.zeros((), device=self.device)
        keys = torch.where(visible[:, :, None, None], keys, zero)
        vals = torch.where(visible[:, :, None, None], vals, zero)
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(
            HEAD_DIM
        )
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        att = torch.einsum("thc,tchd->thd", scores.softmax(-1), vals).flatten(1)
        logits = (x + att @ w["o"]) @ w["head"]
        return logits, self._sample(logits, seeds, pos, temps)

    @staticmethod
    def _sample(logits: Tensor, seeds: Tensor, pos: Tensor, temps: Tensor) -> Tensor:
        """Gumbel-max with noise hashed from (seed, position, token id); greedy where seed < 0."""
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        h = seeds[:, None] * 1000003 + pos[:, None] * 7919 + vocab[None, :] * 104729 + 12345
        h = h & 0xFFFFFFFF
        h = (h ^ (h >> 15)) * 0x2C1B3C6D & 0xFFFFFFFF
        h = (h ^ (h >> 12)) * 0x297A2D39 & 0xFFFFFFFF
        h = h ^ (h >> 15)
        u = ((h & 0xFFFFFF).to(torch.float32) + 0.5) / float(1 << 24)
        gumbel = -torch.log(-torch.log(u))
        sampled = (logits / temps[:, None] + gumbel).argmax(-1)
        return torch.where(seeds >= 0, sampled, logits.argmax(-1))

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


class OffloadTarget:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, bug: bool) -> None:
        self.spec = SPEC
        self.mode = mode
        self.runner = OffloadRunner(mode, seed=seed, bug=bug)

    def step(self, batch: Batch) -> StepResult:
        return self.runner.step(batch)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.runner.k_cache, "v": self.runner.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode != "graph":
            return {}
        return {"rows": self.runner.static, "temps": self.runner.static_t}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        raise NotImplementedError("no weight_update feature")

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OffloadTarget:
    return OffloadTarget(mode, seed=seed, bug=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OffloadTarget:
    return OffloadTarget(mode, seed=seed, bug=True)
