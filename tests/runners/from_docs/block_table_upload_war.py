"""An async-scheduling decode runner (vLLM V1 async-scheduling style), written against plain torch.cuda.

Design. Every step's inputs (token ids, positions, slot mapping, the request of each token, the
block table, sequence lengths, the row each request's logits come from, sampling seeds, greedy
flags, temperatures) are written on the host into one of two pinned staging sets (ping-pong), and
uploaded with `non_blocking` host-to-device copies on a dedicated copy stream into ONE device-side
staging area. The compute stream (the caller's current stream, as in vLLM V1, where the forward
runs on the current stream) waits for an event recorded after the copies, then *commits* the
staged inputs into the persistent input tensors the captured graphs read (device-to-device copies
in compute-stream order, after the previous replay, so the graphs' inputs are never rewritten under
a replay that still reads them), and replays the decode graph of the smallest capture size that
fits (one graph per size, one shared pool), or runs the model eagerly (prefill, mixed, speculative
and oversized batches) on the same persistent inputs. Results are cloned out on the compute stream.

In a pipelined pair the host stages step N+1 and issues its upload while step N is still queued
on the compute stream: step N's commit may not have read the device staging area yet. Two things
keep that safe in the correct runner:

- host side: a pinned set is rewritten only after the event recorded after its last copy
  completed (`copied[k].synchronize()`), so a queued copy never reads the next step's values;
- device side (write-after-read across steps): the copy stream waits for `read_done`, an event the
  compute stream records after the step's replay (or eager forward), before it overwrites the
  device staging area with the next step's inputs.

Bug (`make_buggy_target`): the copy stream does not wait for `read_done`. The pinned staging is
still protected (the half of the fix engines shipped first), but step N+1's upload can overwrite
the device-side staged block table, slot mapping, positions and sequence lengths before step N's
commit (queued behind step N-1's replay on the compute stream) has read them, so step N runs with
step N+1's block table and slots. A lockstep driver that reads each result before the next step
never sees it; only pipelined steps do.

Modelled on: sgl-project/sglang#26380 ("WAR barrier for overlap schedule buffer writes": the
overlap scheduler's schedule stream wrote shared GPU buffers, `req_to_token_pool` (SGLang's block
table) among them, while the previous forward still read them, giving flaky wrong outputs; fixed
by making the schedule stream wait for the forward stream), and sgl-project/sglang#36335 (a CUDA
graph replay reading `req_to_token` raced the scheduler's next writes because the WAR read-done
event was published too early). The double-buffering/staging alternative is vllm-project/vllm#32083
(Model Runner V2 "Remove async barrier": double-buffered CPU->GPU input state); the host-side half
is vllm-project/vllm#25279 (async scheduling CPU tensor race: reused pinned tensors copied async
while the next step modifies them). No code was copied from those engines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NULL_BLOCK = 0
SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=NULL_BLOCK,
)
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
MAX_T, MAX_R, MAX_B = SPEC.max_num_tokens, SPEC.max_num_reqs, SPEC.max_blocks_per_req

# Packed int64 layout of one staging set: (name, rows, columns); columns 0 means a vector.
INT_FIELDS = (
    ("tokens", MAX_T, 0),
    ("positions", MAX_T, 0),
    ("slots", MAX_T, 0),
    ("req_idx", MAX_T, 0),
    ("block_table", MAX_R, MAX_B),
    ("seq_lens", MAX_R, 0),
    ("logits_idx", MAX_R, 0),
    ("seeds", MAX_R, 0),
    ("greedy", MAX_R, 0),
)
OFFSETS: dict[str, tuple[int, int]] = {}
_off = 0
for _name, _rows, _cols in INT_FIELDS:
    OFFSETS[_name] = (_off, _rows * max(_cols, 1))
    _off += _rows * max(_cols, 1)
INT_LEN = _off


def _mix(h: Tensor) -> Tensor:
    """A 32-bit integer hash step on int64 tensors (values stay below 2**59: no overflow)."""
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return h ^ (h >> 16)


class AsyncDecodeRunner:
    def __init__(self, mode: str, *, seed: int, wait_for_reads: bool) -> None:
        self.mode = mode
        self.wait_for_reads = wait_for_reads
        self.device = torch.device("cuda")
        with torch.inference_mode():
            shapes = {
                "embed": (SPEC.vocab_size, HIDDEN),
                "pos": (CONTEXT, HIDDEN),
                "q": (HIDDEN, HIDDEN),
                "k": (HIDDEN, HIDDEN),
                "v": (HIDDEN, HIDDEN),
                "o": (HIDDEN, HIDDEN),
                "head": (HIDDEN, SPEC.vocab_size),
            }
            self.weights = {n: torch.empty(s, device=self.device) for n, s in shapes.items()}
            self._load(seed)
            slots = SPEC.num_slots
            self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
            self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
            # Two pinned staging sets (host writes one while the other's copy may be queued).
            self.pinned_int = [
                torch.zeros(INT_LEN, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
            self.pinned_temp = [
                torch.ones(MAX_R, dtype=torch.float32, pin_memory=True) for _ in range(2)
            ]
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]
            self.flip = 0
            # One device-side staging area, written by the copy stream, read by the commit.
            self.dev_int = torch.zeros(INT_LEN, dtype=torch.int64, device=self.device)
            self.dev_temp = torch.ones(MAX_R, dtype=torch.float32, device=self.device)
            self.copy_stream = torch.cuda.Stream()
            # The staging area was zero-filled on the current stream: order that once.
            self.copy_stream.wait_stream(torch.cuda.current_stream())
            self.read_done = torch.cuda.Event()
            # Persistent inputs the graphs read (committed in compute-stream order).
            self.inputs: dict[str, Tensor] = {}
            for name, rows, cols in INT_FIELDS:
                shape = (rows, cols) if cols else (rows,)
                self.inputs[name] = torch.zeros(shape, dtype=torch.int64, device=self.device)
            self.inputs["temperatures"] = torch.ones(MAX_R, dtype=torch.float32, device=self.device)
            self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            if mode == "graph":
                self._capture()

    # -- weights --------------------------------------------------------------------------------

    def _load(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            w = self.weights[name]
            fresh = torch.randn(w.shape, generator=generator) / math.sqrt(w.shape[0])
            w.copy_(fresh.to(self.device))

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self._load(seed)

    # -- staging, upload, commit ----------------------------------------------------------------

    def _host_values(self, batch: Batch, size: int) -> tuple[list[int], list[float]]:
        """Every row of every field: the batch first, padding rows (null block) after."""
        bs = SPEC.block_size
        tok, pos, slot, ridx = [], [], [], []
        table, seq_lens, lidx, seeds, greedy, temps = [], [], [], [], [], []
        for r, req in enumerate(batch.requests):
            for i, t in enumerate(req.tokens):
                p = req.context_len + i
                tok.append(t)
                pos.append(p)
                slot.append(kv_slot(req.block_ids, p, bs))
                ridx.append(r)
            lidx.append(len(tok) - 1)
            table.extend(list(req.block_ids) + [NULL_BLOCK] * (MAX_B - len(req.block_ids)))
            seq_lens.append(req.seq_len)
            seeds.append(0 if req.seed is None else req.seed)
            greedy.append(1 if req.seed is None else 0)
            temps.append(float(req.temperature))
        for t in range(len(tok), MAX_T):  # padding tokens: the null block, their own padding row
            tok.append(0)
            pos.append(0)
            slot.append(NULL_BLOCK * bs)
            ridx.append(min(t, MAX_R - 1))
        for r in range(batch.num_reqs, MAX_R):  # padding requests: greedy, null table
            lidx.append(min(r, MAX_T - 1))
            table.extend([NULL_BLOCK] * MAX_B)
            seq_lens.append(1)
            seeds.append(0)
            greedy.append(1)
            temps.append(1.0)
        ints = tok + pos + slot + ridx + table + seq_lens + lidx + seeds + greedy
        assert len(ints) == INT_LEN
        return ints, temps

    def _upload_and_commit(self, batch: Batch, size: int) -> None:
        k = self.flip
        self.flip ^= 1
        self.copied[k].synchronize()  # set k's previous copy has read it: safe to rewrite
        ints, temps = self._host_values(batch, size)
        self.pinned_int[k].copy_(torch.tensor(ints, dtype=torch.int64))
        self.pinned_temp[k].copy_(torch.tensor(temps, dtype=torch.float32))
        with torch.cuda.stream(self.copy_stream):
            if self.wait_for_reads:
                # The previous step's commit (queued on the compute stream) is done reading the
                # device staging area before this upload overwrites it.
                self.copy_stream.wait_event(self.read_done)
            self.dev_int.copy_(self.pinned_int[k], non_blocking=True)
            self.dev_temp.copy_(self.pinned_temp[k], non_blocking=True)
            self.copied[k].record()
        compute = torch.cuda.current_stream()
        compute.wait_event(self.copied[k])
        for name, _rows, _cols in INT_FIELDS:  # commit, in compute-stream order
            off, n = OFFSETS[name]
            self.inputs[name].copy_(self.dev_int[off : off + n].view(self.inputs[name].shape))
        self.inputs["temperatures"].copy_(self.dev_temp)

    # -- the model ------------------------------------------------------------------------------

    def _forward(self, t: int, r: int) -> tuple[Tensor, Tensor]:
        w, b = self.weights, self.inputs
        tokens, positions, slots, ridx = (
            b[n][:t] for n in ("tokens", "positions", "slots", "req_idx")
        )
        tables, seq_lens, lidx = b["block_table"][:r], b["seq_lens"][:r], b["logits_idx"][:r]
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = (x @ w[n] for n in "qkv")
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        offsets = torch.arange(bs, device=self.device)
        context = (tables[ridx][:, :, None] * bs + offsets).flatten(1)  # [t, CONTEXT]
        keys, values = self.k_cache[context], self.v_cache[context]
        j = torch.arange(CONTEXT, device=self.device)[None, :]
        visible = (j <= positions[:, None]) & (j < seq_lens[ridx][:, None])
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=self.device))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)
        hidden = x + attended @ w["o"]
        logits = hidden[lidx] @ w["head"]  # [r, vocab]
        return logits, self._sample(logits, positions[lidx], r)

    def _sample(self, logits: Tensor, positions: Tensor, r: int) -> Tensor:
        """Gumbel-max with noise hashed from (seed, position, token id): no generator, no host value."""
        b = self.inputs
        seeds = b["seeds"][:r]
        vocab = torch.arange(SPEC.vocab_size, device=self.device)[None, :]
        h = _mix(_mix(seeds & 0xFFFFFFFF) ^ ((seeds >> 32) & 0xFFFFFFFF))
        h = _mix(h ^ (positions & 0xFFFFFFFF))[:, None]
        h = _mix(h ^ vocab)
        u = ((h & 0xFFFFFF).to(torch.float32) + 0.5) / float(1 << 24)
        gumbel = -torch.log(-torch.log(u))
        sampled = (logits / b["temperatures"][:r, None] + gumbel).argmax(-1)
        return torch.where(b["greedy"][:r] != 0, logits.argmax(-1), sampled)

    # -- graphs ---------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._upload_and_commit(Batch(()), size)  # every row is padding
            self._forward(size, size)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size, size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if any(q != 1 for q in batch.query_lens):
            return "query length above one (prefill chunk or speculative decode)"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            n = batch.num_reqs
            reason = self.fallback_reason(batch)
            if reason is None:
                size = next(s for s in SPEC.capture_sizes if s >= n)
                self._upload_and_commit(batch, size)
                self.graphs[size].replay()
                self.read_done.record()  # after the replay: the staging area is free again
                logits, tokens = self.outputs[size]
                return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
            self._upload_and_commit(batch, 0)
            logits, tokens = self._forward(batch.num_tokens, n)
            self.read_done.record()
            return StepResult(logits, tokens, "eager", None, reason=reason)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


class Target:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, wait_for_reads: bool) -> None:
        self.spec = SPEC
        self.mode = mode
        self.runner = AsyncDecodeRunner(mode, seed=seed, wait_for_reads=wait_for_reads)

    def step(self, batch: Batch) -> StepResult:
        return self.runner.step(batch)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.runner.k_cache, "v": self.runner.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return dict(self.runner.inputs) if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.update_weights(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Target:
    return Target(mode, seed=seed, wait_for_reads=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Target:
    return Target(mode, seed=seed, wait_for_reads=False)
