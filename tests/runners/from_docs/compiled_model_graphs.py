"""A decode runner in the style of vLLM / SGLang model runners that use `torch.compile` and capture
full CUDA graphs around the compiled model.

Plain `torch.cuda` (drop-in style, like tests/runners/plain_cuda.py): a small float32 decoder
(token + learned position embeddings, one attention layer over a slot-major paged KV cache, a SiLU
MLP, an LM head). Its forward is wrapped with `torch.compile(..., fullgraph=True, dynamic=False)`
(default Inductor backend) in the runner's constructor. At start-up the compiled forward is warmed
up (compiled) for each decode capture size outside any capture, then captured with
`torch.cuda.graph` into one graph per capture size sharing one pool from
`torch.cuda.graph_pool_handle()`, largest first. A decode step copies every per-step input (token
ids, positions, slot mapping, context lengths, block tables) into one persistent packed int64
buffer (staged in pinned memory, uploaded on the current stream), resets the padding rows to the
null block, replays and clones the results out. Prefill, mixed and speculative batches, and batches
above the largest capture size, run the uncompiled forward eagerly (with `dynamic=False` each new
prefill shape would recompile, and `fullgraph=True` makes Dynamo's recompile limit an error); the
eager twin never compiles (vLLM's `enforce_eager`).

The forward takes one Python int besides its tensors: `max_blocks`, how many block-table columns the
attention gathers (vLLM's `attn_metadata.max_seq_len` / `max_decode_seq_len`, turned into a block
count; it bounds the work of a paged-attention kernel). Dynamo specializes a Python int argument:
the compiled code has the value as a constant and a guard `L['max_blocks'] == k`
(vllm-project/vllm#8821 lists exactly such guards, `L['attn_metadata'].num_decode_tokens == 0`),
and vLLM even drops Dynamo's guard evaluation after the first compile (vllm-project/vllm#7898,
#25110), so nothing re-checks it. Under a CUDA graph the question is moot anyway: the replay runs
the kernels the capture launched, with the int the capture passed.

Correct runner: the capture passes the largest value any batch can need
(`max_blocks_per_req`), as vLLM does since "Fix FA3 full cuda graph correctness"
(https://github.com/vllm-project/vllm/pull/19106: "Make sure max_model_len is used at the graph
capture time"). The eager path passes the batch's own value.

Bug (`make_buggy_target`): the capture derives `max_blocks` from the dummy capture batch, whose
rows all have sequence length 1, so every decode graph was compiled and captured for one block:
a replay attends only to the first block of each request, whatever its context length. Modelled on
https://github.com/vllm-project/vllm/pull/33360 (Whisper cross-attention `max_seq_len` overridden
from the dummy batch, "leads to a CG capture with max_seq_len == 0 and an incorrect graph") and
https://github.com/vllm-project/vllm/pull/40961 ("the seqlen seen at cudagraph capture was 1"),
combined with Dynamo's int specialization (vllm-project/vllm#8821).

Variants (same runner, graphs captured lazily the first time a decode batch needs a size):
`make_lazy_target` (correct) and `make_buggy_lazy_target` (the capture bakes the first real
batch's longest sequence instead of the dummy's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import (
    AddressView,
    Batch,
    Request,
    StepResult,
    TargetSpec,
    kv_slot,
)

HIDDEN, HEADS, HEAD_DIM, MLP = 32, 2, 16, 64
NULL_BLOCK = 0

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=NULL_BLOCK,
)
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size

# Columns of the packed per-row input buffer; the block table follows them.
TOKEN, POSITION, SLOT, SEQ_LEN = range(4)
WIDTH = 4 + SPEC.max_blocks_per_req


@dataclass(frozen=True)
class Row:
    """One query token: id, position, the KV slot it writes, its visible length, its table."""

    token: int
    position: int
    slot: int
    seq_len: int
    table: tuple[int, ...]

    def values(self) -> list[int]:
        table = list(self.table) + [NULL_BLOCK] * (SPEC.max_blocks_per_req - len(self.table))
        return [self.token, self.position, self.slot, self.seq_len, *table]


PADDING = [0, 0, NULL_BLOCK * SPEC.block_size, 1] + [NULL_BLOCK] * SPEC.max_blocks_per_req


def blocks_for(seq_lens: Sequence[int]) -> int:
    """Block-table columns the attention must read for rows of these visible lengths."""
    return max(1, -(-max(seq_lens, default=1) // SPEC.block_size))


class TinyDecoder(torch.nn.Module):
    """One-layer decoder over a slot-major paged KV cache; no host reads in `forward`."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, MLP),
            "down": (MLP, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        for name, shape in shapes.items():
            self.register_buffer(name, torch.empty(shape, device="cuda"))
        slots = SPEC.num_blocks * SPEC.block_size
        self.register_buffer("k_cache", torch.zeros(slots, HEADS, HEAD_DIM, device="cuda"))
        self.register_buffer("v_cache", torch.zeros(slots, HEADS, HEAD_DIM, device="cuda"))
        self.load(seed)

    @torch.no_grad()
    def load(self, seed: int) -> None:
        """Fresh weights copied in place: captured graphs keep reading the same tensors."""
        generator = torch.Generator().manual_seed(seed)
        for name in ("embed", "pos", "wq", "wk", "wv", "wo", "up", "down", "head"):
            weight = getattr(self, name)
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(weight.device))

    def forward(self, rows: Tensor, max_blocks: int) -> tuple[Tensor, Tensor]:
        """`rows`: [T, WIDTH] int64 on the device. `max_blocks`: block-table columns to read."""
        tokens, positions = rows[:, TOKEN], rows[:, POSITION]
        slots, seq_lens = rows[:, SLOT], rows[:, SEQ_LEN]
        tables = rows[:, 4 : 4 + max_blocks]
        x = self.embed[tokens] + self.pos[positions]
        q = (x @ self.wq).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, (x @ self.wk).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, (x @ self.wv).view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(SPEC.block_size, device=rows.device)
        context = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, C] slots
        keys, values = self.k_cache[context], self.v_cache[context]
        span = max_blocks * SPEC.block_size
        visible = torch.arange(span, device=rows.device)[None, :] < seq_lens[:, None]
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        # Masked slots may hold NaN (the null block): zero them rather than weight them by 0.
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)
        h = x + attended @ self.wo
        h = h + torch.nn.functional.silu(h @ self.up) @ self.down
        logits = h @ self.head
        return logits, logits.argmax(-1)


class CompiledGraphRunner:
    """`graphs=True`: compiled forward, decode graphs captured at start-up. `graphs=False`: the
    uncompiled forward for every step (the eager twin)."""

    def __init__(
        self, *, graphs: bool, seed: int, lazy: bool = False, bake_batch_max: bool = False
    ) -> None:
        self.model = TinyDecoder(seed)
        self.lazy = lazy
        self.bake_batch_max = bake_batch_max
        rows = max(SPEC.capture_sizes)
        self.staging = torch.zeros(rows, WIDTH, dtype=torch.int64, pin_memory=True)
        self.static = torch.zeros(rows, WIDTH, dtype=torch.int64, device="cuda")
        self.uploaded = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        # Compiled for the decode graphs only: with `dynamic=False` every new prefill shape or
        # block count would recompile, and `fullgraph=True` turns Dynamo's recompile limit (8)
        # into a hard error, so the eager path calls the uncompiled forward on both twins.
        self.compiled = None
        self.pool = None
        if graphs:
            self.compiled = torch.compile(self.model.forward, fullgraph=True, dynamic=False)
            self.pool = torch.cuda.graph_pool_handle()
            if not lazy:
                for size in sorted(SPEC.capture_sizes, reverse=True):
                    self._upload([], size)  # dummy batch: every row is padding
                    self._capture(size, [PADDING[SEQ_LEN]] * size)

    # -- graphs ---------------------------------------------------------------------------------

    def _capture(self, size: int, seq_lens: Sequence[int]) -> None:
        """Compile and capture the graph of `size` rows over the inputs uploaded already, whose
        rows have the visible lengths `seq_lens` (the dummy batch's, or the first real batch's
        when capturing lazily)."""
        # Correct: the longest any request can get. BUG (bake_batch_max): the capture batch's
        # longest sequence picks the block count; Dynamo specializes the int and the capture
        # records it, so every replay reads that many blocks.
        max_blocks = blocks_for(seq_lens) if self.bake_batch_max else SPEC.max_blocks_per_req
        inputs = self.static[:size]
        for _ in range(2):  # compile (and autotune) for this size outside the capture
            self.compiled(inputs, max_blocks)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self.compiled(inputs, max_blocks)
        self.graphs[size] = graph

    def capture_size(self, rows: int) -> int | None:
        return next((s for s in SPEC.capture_sizes if s >= rows), None)

    def _upload(self, rows: Sequence[Row], size: int) -> None:
        """Stage the rows and padding rows up to `size` in pinned memory, copy them into the
        persistent buffer on the current stream."""
        self.uploaded.synchronize()  # the previous copy has read the staging buffer
        host = [r.values() for r in rows] + [PADDING] * (size - len(rows))
        self.staging[:size].copy_(torch.tensor(host, dtype=torch.int64))
        self.static[:size].copy_(self.staging[:size], non_blocking=True)
        self.uploaded.record()

    def decode(self, rows: Sequence[Row]) -> tuple[Tensor, Tensor, int]:
        size = self.capture_size(len(rows))
        if size is None or (size not in self.graphs and not self.lazy):
            raise ValueError(f"no decode graph for {len(rows)} rows")
        self._upload(rows, size)
        if size not in self.graphs:  # lazy: captured the first time a batch needs it
            self._capture(size, [r.seq_len for r in rows] + [PADDING[SEQ_LEN]] * (size - len(rows)))
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = len(rows)
        return logits[:n].clone(), tokens[:n].clone(), size

    # -- eager ----------------------------------------------------------------------------------

    def eager(self, rows: Sequence[Row], last: Sequence[int]) -> tuple[Tensor, Tensor]:
        host = torch.tensor([r.values() for r in rows], dtype=torch.int64).reshape(-1, WIDTH)
        max_blocks = blocks_for([r.seq_len for r in rows])
        logits, tokens = self.model(host.to("cuda"), max_blocks)
        index = torch.tensor(list(last), dtype=torch.int64, device="cuda")
        return logits[index], tokens[index]

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def rows_of(request: Request) -> list[Row]:
    return [
        Row(
            token,
            request.context_len + i,
            kv_slot(request.block_ids, request.context_len + i, SPEC.block_size),
            request.context_len + i + 1,
            request.block_ids,
        )
        for i, token in enumerate(request.tokens)
    ]


class CompiledGraphTarget:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, bug: bool = False, lazy: bool = False
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.runner = CompiledGraphRunner(
            graphs=mode == "graph", seed=seed, lazy=lazy, bake_batch_max=bug
        )

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(len(r.tokens) != 1 for r in batch.requests):
            return f"{batch.phase} batch with query length above 1"
        if self.runner.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            rows = [rows_of(r)[0] for r in batch.requests]
            logits, tokens, size = self.runner.decode(rows)
            return StepResult(logits, tokens, "full", ("decode", size))
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device="cuda")
            return StepResult(
                empty,
                torch.zeros(0, dtype=torch.int64, device="cuda"),
                "eager",
                None,
                reason=reason,
            )
        rows, last = [], []
        for request in batch.requests:
            rows.extend(rows_of(request))
            last.append(len(rows) - 1)
        logits, tokens = self.runner.eager(rows, last)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.runner.model.k_cache, "v": self.runner.model.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {"rows": self.runner.static} if self.runner.compiled is not None else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.model.load(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> CompiledGraphTarget:
    # `backend` is not the runner's business: on sim the harness's drop-in is active around it.
    return CompiledGraphTarget(mode, seed=seed)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CompiledGraphTarget:
    return CompiledGraphTarget(mode, seed=seed, bug=True)


# Variant: graphs captured lazily, the first time a decode batch needs a size (a choice
# docs/own-runner.md allows); the buggy one bakes that first real batch's longest sequence.
def make_lazy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CompiledGraphTarget:
    return CompiledGraphTarget(mode, seed=seed, lazy=True)


def make_buggy_lazy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CompiledGraphTarget:
    return CompiledGraphTarget(mode, seed=seed, bug=True, lazy=True)
