"""A decode runner that keeps attention opaque the way vLLM does: custom operators.

Written against plain `torch.cuda` only (on sim the harness's drop-in stands in for it). The KV
cache write (`graphmode_docs_custom::reshape_and_cache`) and the paged attention (`graphmode_docs_custom::unified_attention`, which
writes into a caller-allocated `output`, like vLLM's `unified_attention_with_output`) are
registered with `torch.library.custom_op(..., mutates_args=...)`, with pure-PyTorch
implementations and `register_fake` shape functions, and are called through `torch.ops.graphmode_docs_custom.*`.
One full graph per capture size (decode batches, one token per request) in one pool from
`torch.cuda.graph_pool_handle()`: sizes 4 and 1 are captured with `torch.cuda.graph`, size 2 with a
raw `torch.cuda.CUDAGraph().capture_begin(pool=...)` / `capture_end()` on a side stream. Before
every replay the runner checks that its static inputs still have the `data_ptr()`s captured (vLLM's
debug-mode check) and that a `weakref` to the graph's logits output is still alive. Everything
else (prefill, mixed, speculative, too many rows) runs eagerly through the same custom ops.

Sampling: Gumbel-max with noise from an integer hash of (seed, position, vocab id), on the device.

Bug (`make_buggy_target`): the attention op takes the number of context blocks to scan as a plain
Python `int` argument (`num_blocks_to_scan`), which the runner computes on the host from the batch
(the longest sequence, like vLLM's `attn_metadata.max_seq_len` / FlashAttention's `max_seqlen_k`).
Eagerly that is right for every batch; but a custom op's int argument is a kernel-launch argument,
frozen into the graph at capture, where the batch is all padding (one block). Every replay then
scans one block only, whatever the requests' contexts: on a GPU the kernel silently ignores later
blocks. Engines avoid this by capturing with the longest context the model takes (FlashAttention's
host `max_seqlen_k` frozen at capture: flash-attention issue 1164). Bug class 4 (host values
frozen at capture).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NULL_BLOCK = 0

SPEC = TargetSpec(
    num_blocks=24,
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


# -- custom operators (registered once, at import) --------------------------------------------


@torch.library.custom_op(
    "graphmode_docs_custom::reshape_and_cache", mutates_args=("k_cache", "v_cache")
)
def reshape_and_cache(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    k_cache.index_copy_(0, slot_mapping, key)
    v_cache.index_copy_(0, slot_mapping, value)


@reshape_and_cache.register_fake
def _(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    return None


@torch.library.custom_op("graphmode_docs_custom::unified_attention", mutates_args=("output",))
def unified_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    positions: Tensor,
    output: Tensor,
    block_size: int,
    num_blocks_to_scan: int,
) -> None:
    """query [T, H, D]; block_table [T, max_blocks] (each token's request's table); writes
    output [T, H * D]. Scans the first `num_blocks_to_scan` columns of the table."""
    table = block_table[:, :num_blocks_to_scan]
    # (new_* rather than device=query.device: the sim cannot run a factory naming the device inside
    # a custom op's implementation; see repro_custom_op_device_factory.py)
    offsets = block_table.new_ones(block_size).cumsum(0) - 1
    context = (table[:, :, None] * block_size + offsets).flatten(1)  # [T, C]
    keys, values = k_cache[context], v_cache[context]  # [T, C, H, D]
    width = num_blocks_to_scan * block_size
    visible = (positions.new_ones(width).cumsum(0) - 1)[None, :] <= positions[:, None]
    scores = torch.einsum("thd,tchd->thc", query, keys) / math.sqrt(query.shape[-1])
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    values = torch.where(visible[:, :, None, None], values, query.new_zeros(()))
    attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values)
    output.copy_(attended.flatten(1))


@unified_attention.register_fake
def _(query, k_cache, v_cache, block_table, positions, output, block_size, num_blocks_to_scan):
    return None


@torch.library.custom_op("graphmode_docs_custom::gumbel_sample", mutates_args=())
def gumbel_sample(
    logits: Tensor, seeds: Tensor, positions: Tensor, temperatures: Tensor, sampled: Tensor
) -> Tensor:
    vocab = seeds.new_ones(logits.shape[-1]).cumsum(0) - 1
    mask = (1 << 31) - 1
    h = (seeds[:, None] * 1000003 + positions[:, None] * 7919 + vocab[None, :] * 104729) & mask
    for _ in range(3):
        h = ((h ^ (h >> 13)) * 1103515245 + 12345) & mask
    u = ((h & 0xFFFFFF).to(torch.float32) + 0.5) / float(1 << 24)
    gumbel = -torch.log(-torch.log(u))
    noisy = logits / temperatures[:, None] + gumbel
    return torch.where(sampled.bool(), noisy.argmax(-1), logits.argmax(-1))


@gumbel_sample.register_fake
def _(logits, seeds, positions, temperatures, sampled):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


# -- the runner -----------------------------------------------------------------------------


class CustomOpRunner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, frozen_scan: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.frozen_scan = frozen_scan  # the bug: scan width from the batch, a host int
        self.device = torch.device("cuda")
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "qkv": (HIDDEN, 3 * HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        slots = SPEC.num_blocks * SPEC.block_size
        rows = max(SPEC.capture_sizes)
        with torch.inference_mode():
            self.weights = {n: torch.empty(s, device=self.device) for n, s in shapes.items()}
            self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
            self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
            i64 = dict(dtype=torch.int64, device=self.device)
            self.static = {
                "tokens": torch.zeros(rows, **i64),
                "positions": torch.zeros(rows, **i64),
                "slots": torch.zeros(rows, **i64),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, **i64),
                "seeds": torch.zeros(rows, **i64),
                "sampled": torch.zeros(rows, **i64),
                "temperatures": torch.ones(rows, device=self.device),
            }
        self.load_weights(seed)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.output_refs: dict[int, weakref.ref] = {}
        self.captured_ptrs: dict[int, dict[str, int]] = {}
        self.pool = None
        if mode == "graph":
            self.capture()

    def load_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            for name in sorted(self.weights):
                w = self.weights[name]
                w.copy_((torch.randn(w.shape, generator=g) / math.sqrt(w.shape[0])).to(self.device))

    # -- model --------------------------------------------------------------------------------

    def forward(
        self, tokens, positions, slots, tables, seeds, sampled, temperatures, scan: int
    ) -> tuple[Tensor, Tensor]:
        w = self.weights
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = (x @ w["qkv"]).split(HIDDEN, dim=-1)
        torch.ops.graphmode_docs_custom.reshape_and_cache(
            k.reshape(-1, HEADS, HEAD_DIM),
            v.reshape(-1, HEADS, HEAD_DIM),
            self.k_cache,
            self.v_cache,
            slots,
        )
        attn = torch.empty(tokens.shape[0], HIDDEN, device=x.device)
        torch.ops.graphmode_docs_custom.unified_attention(
            q.reshape(-1, HEADS, HEAD_DIM),
            self.k_cache,
            self.v_cache,
            tables,
            positions,
            attn,
            SPEC.block_size,
            scan,
        )
        logits = (x + attn @ w["o"]) @ w["head"]
        next_tokens = torch.ops.graphmode_docs_custom.gumbel_sample(
            logits, seeds, positions, temperatures, sampled
        )
        return logits, next_tokens

    def scan_blocks(self, seq_lens: Sequence[int]) -> int:
        if not self.frozen_scan:
            return SPEC.max_blocks_per_req
        longest = max(seq_lens, default=1)
        return max(1, -(-longest // SPEC.block_size))

    # -- graphs -------------------------------------------------------------------------------

    def static_args(self, size: int) -> list[Tensor]:
        s = self.static
        return [
            s[n][:size]
            for n in ("tokens", "positions", "slots", "tables", "seeds", "sampled", "temperatures")
        ]

    def capture(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in sorted(SPEC.capture_sizes, reverse=True):
                self.prepare([], size)  # all padding: sequence length 1
                args = self.static_args(size)
                scan = self.scan_blocks([1] * size)
                self.forward(*args, scan)  # warm-up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                if size == 2:  # the raw API, as an engine's own capture helper does
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        graph.capture_begin(pool=self.pool)
                        out = self.forward(*args, scan)
                        graph.capture_end()
                    torch.cuda.current_stream().wait_stream(stream)
                else:
                    with torch.cuda.graph(graph, pool=self.pool):
                        out = self.forward(*args, scan)
                self.graphs[size] = graph
                self.outputs[size] = out
                self.output_refs[size] = weakref.ref(out[0])
                self.captured_ptrs[size] = {
                    n: t.data_ptr() for n, t in zip(self.static, args, strict=False)
                }

    def prepare(self, requests: Sequence[Request], size: int) -> None:
        rows = []
        for r in requests:
            pos = r.context_len
            table = list(r.block_ids) + [NULL_BLOCK] * (SPEC.max_blocks_per_req - len(r.block_ids))
            rows.append(
                (
                    r.tokens[0],
                    pos,
                    kv_slot(r.block_ids, pos, SPEC.block_size),
                    table,
                    r.seed or 0,
                    int(r.seed is not None),
                    r.temperature,
                )
            )
        pad = (
            0,
            0,
            NULL_BLOCK * SPEC.block_size,
            [NULL_BLOCK] * SPEC.max_blocks_per_req,
            0,
            0,
            1.0,
        )
        rows += [pad] * (size - len(rows))
        cols = list(zip(*rows, strict=False))
        s = self.static
        for name, values in zip(("tokens", "positions", "slots"), cols[:3], strict=False):
            s[name][:size].copy_(torch.tensor(values, dtype=torch.int64))
        s["tables"][:size].copy_(torch.tensor(cols[3], dtype=torch.int64))
        s["seeds"][:size].copy_(torch.tensor(cols[4], dtype=torch.int64))
        s["sampled"][:size].copy_(torch.tensor(cols[5], dtype=torch.int64))
        s["temperatures"][:size].copy_(torch.tensor(cols[6], dtype=torch.float32))

    def capture_size(self, n: int) -> int | None:
        return next((s for s in SPEC.capture_sizes if s >= n), None)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(len(r.tokens) != 1 or r.context_len == 0 for r in batch.requests):
            return "not a pure decode batch"
        if self.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def replay(self, batch: Batch) -> StepResult:
        size = self.capture_size(batch.num_reqs)
        with torch.inference_mode():
            self.prepare(batch.requests, size)
            for name, t in zip(self.static, self.static_args(size), strict=False):
                assert t.data_ptr() == self.captured_ptrs[size][name], f"{name} moved"
            assert self.output_refs[size]() is not None, "graph output was freed"
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            n = batch.num_reqs
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def eager(self, batch: Batch, reason: str) -> StepResult:
        cols: list[list] = [[] for _ in range(7)]
        last = []
        for r in batch.requests:
            table = list(r.block_ids) + [NULL_BLOCK] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for i, tok in enumerate(r.tokens):
                pos = r.context_len + i
                for c, v in zip(
                    cols,
                    (
                        tok,
                        pos,
                        kv_slot(r.block_ids, pos, SPEC.block_size),
                        table,
                        r.seed or 0,
                        int(r.seed is not None),
                        r.temperature,
                    ),
                    strict=False,
                ):
                    c.append(v)
            last.append(len(cols[0]) - 1)
        if not last:
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=self.device),
                torch.zeros(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason=reason,
            )
        d = self.device
        with torch.inference_mode():
            args = [torch.tensor(c, dtype=torch.int64, device=d) for c in cols[:6]]
            args.append(torch.tensor(cols[6], dtype=torch.float32, device=d))
            scan = self.scan_blocks([r.seq_len for r in batch.requests])
            logits, tokens = self.forward(*args, scan)
            index = torch.tensor(last, dtype=torch.int64, device=d)
            return StepResult(logits[index], tokens[index], "eager", None, reason=reason)

    # -- contract -----------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return dict(self.static) if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.load_weights(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> CustomOpRunner:
    return CustomOpRunner(mode, seed=seed, frozen_scan=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CustomOpRunner:
    return CustomOpRunner(mode, seed=seed, frozen_scan=True)
