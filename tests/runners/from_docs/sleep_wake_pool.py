"""Paged-KV decode runner with vLLM-style sleep mode, written against plain `torch.cuda`.

Weights and the KV cache live in a `torch.cuda.memory.MemPool` (allocated under
`torch.cuda.memory.use_mem_pool(pool)`), decode graphs are captured per batch bucket (1, 2, 4
rows) in a graph pool of their own. The contract has no sleep call, so `update_weights` does
what an RLHF engine does around a weight sync:

  sleep: offload the weights to pinned host memory, back the KV cache up to pinned host memory
         (the harness's live requests keep their cache across an update, docs/contract.md), free
         every tensor of the sleep region (the tensor objects and their storages stay, the memory is
         dropped with `untyped_storage().resize_(0)`, FSDP's idiom; the sim's ledger does not
         count that free, a GPU does), and check with `torch.cuda.memory_allocated()` that the allocated bytes
         fell by at least the region's size (logged in MEMORY_LOG with `mem_get_info()`, and
         warned about once if not, as vLLM logs what sleep freed);
  wake:  re-allocate every region tensor inside the pool, refill it from host memory (weights,
         KV), load the new weights in place, and re-capture every graph (the storages moved, so
         the old graphs' addresses are dead; vLLM keeps addresses through cuMem remapping,
         plain torch cannot, so this runner recaptures, as vLLM PR #45648 does).

The graph path reads two init-once device tables (`offsets` = arange(block_size) and `ctx` =
arange(context)) that the replay never rewrites, like SGLang's `cu_seqlens_q = arange` graph
buffers; the eager path makes them with `torch.arange` at every step.

BUG (`make_buggy_target`): the init-once graph tables are allocated inside the sleep region in
"discard" mode (no host backup), to give the trainer a little more memory. On wake they come back
as fresh zeroed memory and are never refilled; the graphs are re-captured over them, so every
replay after the first weight update reads zeros for both (every context column maps to the
first slot of its block, and every column counts as visible) and attends to the wrong keys. The eager path makes its
tables per step and is unaffected. Modelled on SGLang's torch_memory_saver release/resume:
https://github.com/sgl-project/sglang/pull/30474 (init-once graph buffers kept out of the
released `cuda_graph` region because "resume hands back zero pages, which would silently corrupt
them") and https://github.com/sgl-project/sglang/pull/32718 (capture-time-initialized graph state
that replays read but never rewrite came back undefined after resume).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NULL_BLOCK = 0
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 24, 4, 6
VOCAB = 48
CAPTURE_SIZES = (1, 2, 4)
CONTEXT = MAX_BLOCKS * BLOCK_SIZE

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

WEIGHT_SHAPES = {
    "embed": (VOCAB, HIDDEN),
    "pos": (CONTEXT, HIDDEN),
    "q": (HIDDEN, HIDDEN),
    "k": (HIDDEN, HIDDEN),
    "v": (HIDDEN, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "head": (HIDDEN, VOCAB),
}

MEMORY_LOG: list[tuple[str, int, int]] = []  # (event, memory_allocated, mem_get_info free)
_WARNED: list[str] = []


def _warn_once(message: str) -> None:
    if not _WARNED:
        _WARNED.append(message)
        warnings.warn(message, stacklevel=3)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class SleepRegion:
    """Tensors allocated in one MemPool that sleep together. Each entry is offloaded (its contents
    copied to pinned host memory and back) or discarded (its memory handed back as zeros)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.memory.MemPool()
        self.tensors: dict[str, Tensor] = {}
        self.offload: dict[str, bool] = {}
        self.host: dict[str, Tensor] = {}
        self.asleep = False

    def empty(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, *, offload: bool
    ) -> Tensor:
        with torch.cuda.memory.use_mem_pool(self.pool):
            t = torch.zeros(shape, dtype=dtype, device="cuda")
        self.tensors[name] = t
        self.offload[name] = offload
        return t

    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors.values())

    def sleep(self) -> None:
        assert not self.asleep
        for name, t in self.tensors.items():
            if self.offload[name]:
                if name not in self.host:
                    self.host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self.host[name].copy_(t, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the downloads landed before the memory goes
        for t in self.tensors.values():
            # Free the storage in place (FSDP's idiom): the tensor objects, and every view of them
            # that someone else holds (the harness's views of `state()`), keep the same StorageImpl
            # and see the memory it gets back on wake.
            t.untyped_storage().resize_(0)
        self.asleep = True

    def wake(self) -> None:
        assert self.asleep
        for name, t in self.tensors.items():
            with torch.cuda.memory.use_mem_pool(self.pool):
                t.untyped_storage().resize_(_nbytes(t))  # new memory, most likely a new address
            if self.offload[name]:
                t.copy_(self.host[name], non_blocking=True)  # ordered on the current stream
            else:
                t.zero_()  # discarded: handed back as zero pages, as torch_memory_saver does
        self.asleep = False


class SleepWakeRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, tables_in_region: bool
    ) -> None:
        with torch.inference_mode():
            self._build(mode, seed, tables_in_region)

    def _build(self, mode: str, seed: int, tables_in_region: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        torch.cuda.memory_allocated()  # start-up snapshot (starts the counts)
        self.region = SleepRegion()
        self.w = {
            n: self.region.empty(n, s, torch.float32, offload=True)
            for n, s in WEIGHT_SHAPES.items()
        }
        slots = NUM_BLOCKS * BLOCK_SIZE
        self.k_cache = self.region.empty(
            "k_cache", (slots, HEADS, HEAD_DIM), torch.float32, offload=True
        )
        self.v_cache = self.region.empty(
            "v_cache", (slots, HEADS, HEAD_DIM), torch.float32, offload=True
        )
        self._load(seed)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        rows = max(CAPTURE_SIZES)
        self.static = torch.zeros(rows, 3 + MAX_BLOCKS, dtype=torch.int64, device="cuda")
        # init-once tables the graph path reads and no replay rewrites
        if tables_in_region:  # BUG: discarded on sleep, handed back as zeros on wake
            self.offsets = self.region.empty("offsets", (BLOCK_SIZE,), torch.int64, offload=False)
            self.ctx = self.region.empty("ctx", (CONTEXT,), torch.int64, offload=False)
        else:
            self.offsets = torch.zeros(BLOCK_SIZE, dtype=torch.int64, device="cuda")
            self.ctx = torch.zeros(CONTEXT, dtype=torch.int64, device="cuda")
        self.offsets.copy_(torch.arange(BLOCK_SIZE, device="cuda"))
        self.ctx.copy_(torch.arange(CONTEXT, device="cuda"))
        if mode == "graph":
            self._capture()

    # -- weights --------------------------------------------------------------------------------

    def _load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            fresh = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])
            t.copy_(fresh.to("cuda"))

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            before = torch.cuda.memory_allocated()
            free_before = torch.cuda.mem_get_info()[0]
            self._release_graphs()  # the graphs read the region: they go first
            self.region.sleep()
            asleep = torch.cuda.memory_allocated()
            MEMORY_LOG.append(("awake", before, free_before))
            MEMORY_LOG.append(("asleep", asleep, torch.cuda.mem_get_info()[0]))
            torch.cuda.empty_cache()
            MEMORY_LOG.append(
                ("asleep+empty_cache", torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0])
            )
            if before - asleep < self.region.nbytes() and not _WARNED:
                # vLLM logs what sleep freed rather than failing; so does this runner (once).
                _warn_once(f"sleep freed {before - asleep} bytes of {self.region.nbytes()}")
            # ... the trainer would use the device here ...
            self.region.wake()
            MEMORY_LOG.append(
                ("woken", torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0])
            )
            self._load(seed)
            if self.mode == "graph":
                self._capture()

    # -- graphs ---------------------------------------------------------------------------------

    def _release_graphs(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(CAPTURE_SIZES, reverse=True):
            self._prepare([], size)
            self._forward_graph(self.static[:size])
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[size] = self._forward_graph(self.static[:size])
            self.graphs[size] = g

    def _prepare(self, rows: Sequence[list[int]], size: int) -> None:
        pad = [0, 0, NULL_BLOCK * BLOCK_SIZE] + [NULL_BLOCK] * MAX_BLOCKS
        host = torch.tensor(
            [list(rows[i]) if i < len(rows) else pad for i in range(size)], dtype=torch.int64
        )
        self.static[:size].copy_(host)

    # -- the model ------------------------------------------------------------------------------

    def _forward_graph(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        return self._forward(rows, self.offsets, self.ctx)

    def _forward_eager(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        offsets = torch.arange(BLOCK_SIZE, device="cuda")
        ctx = torch.arange(CONTEXT, device="cuda")
        return self._forward(rows, offsets, ctx)

    def _forward(self, rows: Tensor, offsets: Tensor, ctx: Tensor) -> tuple[Tensor, Tensor]:
        w = self.w
        tokens, positions, slots, tables = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:]
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        context = (tables[:, :, None] * BLOCK_SIZE + offsets).flatten(1)  # [T, CONTEXT]
        keys, values = self.k_cache[context], self.v_cache[context]
        visible = ctx[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(
            HEAD_DIM
        )
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)
        logits = (x + attended @ w["o"]) @ w["head"]
        return logits, logits.argmax(-1)

    # -- contract -------------------------------------------------------------------------------

    def _rows(self, batch: Batch) -> tuple[list[list[int]], list[int]]:
        rows, last = [], []
        for r in batch.requests:
            table = list(r.block_ids) + [NULL_BLOCK] * (MAX_BLOCKS - len(r.block_ids))
            for i, tok in enumerate(r.tokens):
                pos = r.context_len + i
                rows.append([tok, pos, kv_slot(r.block_ids, pos, BLOCK_SIZE), *table])
            last.append(len(rows) - 1)
        return rows, last

    def _bucket(self, n: int) -> int | None:
        return next((s for s in CAPTURE_SIZES if s >= n), None)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length above one"
        if self._bucket(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            rows, last = self._rows(batch)
            reason = self.fallback_reason(batch)
            if reason is None:
                size = self._bucket(batch.num_reqs)
                assert size is not None
                self._prepare(rows, size)
                self.graphs[size].replay()
                logits, tokens = self.outputs[size]
                n = batch.num_reqs
                return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
            if not rows:
                return StepResult(
                    torch.zeros(0, VOCAB, device="cuda"),
                    torch.zeros(0, dtype=torch.int64, device="cuda"),
                    "eager",
                    None,
                    reason=reason,
                )
            host = torch.tensor(rows, dtype=torch.int64)
            logits, tokens = self._forward_eager(host.to("cuda"))
            index = torch.tensor(last, dtype=torch.int64, device="cuda")
            return StepResult(logits[index], tokens[index], "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {"rows": self.static} if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def close(self) -> None:
        self._release_graphs()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SleepWakeRunner:
    return SleepWakeRunner(mode, seed=seed, tables_in_region=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SleepWakeRunner:
    return SleepWakeRunner(mode, seed=seed, tables_in_region=True)
