"""A bfloat16-autocast decode runner whose attention is `F.scaled_dot_product_attention` over
gathered paged KV, written against plain `torch.cuda` (runs on sim through the drop-in).

The model: token + learned position embeddings, one grouped-query attention layer (4 query heads
sharing 2 KV heads, `enable_gqa=True`) over a slot-major paged bfloat16 KV cache, an output
projection with a residual, an LM head. The weights are float32 `nn.Parameter`s (requires_grad
left at its default, as a Hugging Face `nn.Linear` has them); every forward, eager or captured,
runs under `torch.autocast("cuda", dtype=torch.bfloat16)`, so the projections compute in bfloat16
and the K/V written to the cache are bfloat16. Attention gathers each token's context through its
request's block table (`[T, HKV, S, D]`), masks it with an explicit boolean mask
`slot position <= token position` of the query's rank (`[T, 1, 1, S]`), and zeroes masked keys
and values (the null block holds NaN: a masked NaN key still makes a NaN score). Kernels are
chosen as engines do: `torch.backends.cuda.matmul.allow_tf32` set at start-up and
`torch.nn.attention.sdpa_kernel([EFFICIENT_ATTENTION, MATH])` around every attention call
(flash is left out: it takes no `attn_mask`).

Graph mode: one `torch.cuda.CUDAGraph` per decode capture size (1, 2, 4, 8), captured at start-up
largest first into one pool, each after an eager warm-up, under autocast. Prefill, mixed,
speculative and oversized batches run eagerly (same forward). Padding rows point at the null block.

`make_target`: the capture runs under `torch.autocast(..., cache_enabled=False)`, as
`torch.cuda.make_graphed_callables` demands (pytorch PR #84289). With autocast's weight-cast
cache on, a float32 parameter that requires grad is cast to bfloat16 once per autocast region and
the cast is reused: the warm-up's cast (ordinary memory, outside the graph pool) is what the
capture reads, no cast is recorded, and the cache is cleared (the casts freed) when the region
ends.

`make_buggy_target` (the one bug): warm-up and capture share one `torch.autocast("cuda",
dtype=torch.bfloat16)` region with the default `cache_enabled=True`. The graphs read bfloat16
copies of the weights that are freed after capture (silently reused memory on a GPU, a use after
free) and never see a weight update (the cast is not part of the graph). Modelled on
pytorch/pytorch#71631 ("Wrapping make_graphed_callables with autocast issue": AMP + CUDA graphs
give different results when capture runs inside autocast) and the fixes
pytorch/pytorch#81558 / #84289 (clear / disable the autocast cache around graph capture); the
same applies to any engine that captures a `torch.cuda.graph` inside an autocast region over
requires-grad float32 weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

HIDDEN, HQ, HKV, HEAD_DIM = 64, 4, 2, 16
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 24, 4, 6
CONTEXT = BLOCK_SIZE * MAX_BLOCKS
VOCAB = 64
NULL_BLOCK = 0
CAPTURE_SIZES = (1, 2, 4, 8)
DTYPE = torch.bfloat16
SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

SPEC = TargetSpec(
    num_blocks=NUM_BLOCKS,
    block_size=BLOCK_SIZE,
    max_blocks_per_req=MAX_BLOCKS,
    vocab_size=VOCAB,
    max_num_reqs=10,
    max_num_tokens=16,
    capture_sizes=CAPTURE_SIZES,
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=NULL_BLOCK,
)

_COLS = 3  # token, position, slot; then the block table


class TinyGQAModel(nn.Module):
    """Float32 parameters; the runner computes under bfloat16 autocast."""

    def __init__(self) -> None:
        super().__init__()
        shapes = {
            "embed": (VOCAB, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HQ * HEAD_DIM, HIDDEN),
            "wk": (HKV * HEAD_DIM, HIDDEN),
            "wv": (HKV * HEAD_DIM, HIDDEN),
            "wo": (HIDDEN, HQ * HEAD_DIM),
            "head": (VOCAB, HIDDEN),
        }
        for name, shape in shapes.items():
            # requires_grad left at nn.Parameter's default, as nn.Linear's weights are
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))

    @torch.no_grad()
    def load(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name, param in sorted(self.named_parameters()):
            fresh = torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
            if name in ("embed", "pos"):
                fresh = fresh * 2.0
            param.copy_(fresh.to(param.device))


class SdpaAutocastRunner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, cache_casts_in_capture: bool):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.mode = mode
        self.spec = SPEC
        self.cache_casts_in_capture = cache_casts_in_capture
        self.device = torch.device("cuda", torch.cuda.current_device())
        # engine-style kernel selection (same on both twins)
        torch.backends.cuda.matmul.allow_tf32 = True
        self.model = TinyGQAModel().to(device=self.device)
        with torch.no_grad():
            self.model.load(seed)
            slots = NUM_BLOCKS * BLOCK_SIZE
            self.k_cache = torch.zeros(slots, HKV, HEAD_DIM, device=self.device, dtype=DTYPE)
            self.v_cache = torch.zeros(slots, HKV, HEAD_DIM, device=self.device, dtype=DTYPE)
            rows = max(CAPTURE_SIZES)
            self.static = torch.zeros(
                rows, _COLS + MAX_BLOCKS, dtype=torch.int64, device=self.device
            )
            self.offsets = torch.arange(BLOCK_SIZE, device=self.device)
            self.slot_pos = torch.arange(CONTEXT, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self._capture()

    # -- autocast -------------------------------------------------------------------------------

    def _autocast(self, *, cache_enabled: bool = True) -> torch.autocast:
        return torch.autocast("cuda", dtype=DTYPE, cache_enabled=cache_enabled)

    # -- graphs ---------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # The correct runner captures with autocast's cast cache off; the buggy one leaves it on,
        # so the warm-up's bfloat16 weight casts are what its graphs read.
        with torch.no_grad(), self._autocast(cache_enabled=self.cache_casts_in_capture):
            for size in sorted(CAPTURE_SIZES, reverse=True):
                self._write_rows([], size)
                self._forward(self.static[:size])  # warm-up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(self.static[:size])
                self.graphs[size] = graph

    def capture_size(self, rows: int) -> int | None:
        return next((s for s in CAPTURE_SIZES if s >= rows), None)

    def _row(self, token: int, position: int, slot: int, table: Sequence[int]) -> list[int]:
        return [token, position, slot, *table, *([NULL_BLOCK] * (MAX_BLOCKS - len(table)))]

    def _padding_row(self) -> list[int]:
        return self._row(0, 0, NULL_BLOCK * BLOCK_SIZE, ())

    def _write_rows(self, rows: Sequence[list[int]], size: int) -> None:
        """Every row the graph reads, valid or padding, is rewritten before each replay."""
        values = list(rows) + [self._padding_row() for _ in range(size - len(rows))]
        host = torch.tensor(values, dtype=torch.int64)
        self.static[:size].copy_(host.to(self.device))

    # -- the model ------------------------------------------------------------------------------

    def _forward(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        m = self.model
        tokens, positions, slots, tables = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, _COLS:]
        t = rows.shape[0]
        x = m.embed[tokens] + m.pos[positions]  # float32 (embedding lookups are not autocast)
        q = F.linear(x, m.wq).view(t, HQ, 1, HEAD_DIM)
        k = F.linear(x, m.wk).view(t, HKV, HEAD_DIM)
        v = F.linear(x, m.wv).view(t, HKV, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, k.to(DTYPE))
        self.v_cache.index_copy_(0, slots, v.to(DTYPE))
        context = (tables[:, :, None] * BLOCK_SIZE + self.offsets).flatten(1)  # [T, S]
        visible = self.slot_pos[None, :] <= positions[:, None]  # [T, S]
        zero = torch.zeros((), dtype=DTYPE, device=rows.device)
        keep = visible[:, :, None, None]
        keys = torch.where(keep, self.k_cache[context], zero).transpose(1, 2)  # [T, HKV, S, D]
        values = torch.where(keep, self.v_cache[context], zero).transpose(1, 2)
        mask = visible[:, None, None, :]  # [T, 1, 1, S], the query's rank
        with sdpa_kernel(SDPA_BACKENDS):
            attended = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=True
            )  # [T, HQ, 1, D]
        h = x + F.linear(attended.reshape(t, HQ * HEAD_DIM), m.wo)
        logits = F.linear(h, m.head).float()
        return logits, logits.argmax(-1)

    # -- steps ----------------------------------------------------------------------------------

    def decode(self, rows: Sequence[list[int]]) -> tuple[Tensor, Tensor, int]:
        size = self.capture_size(len(rows))
        assert size is not None and size in self.graphs
        with torch.no_grad():
            self._write_rows(rows, size)
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            n = len(rows)
            return logits[:n].clone(), tokens[:n].clone(), size

    def eager(self, rows: Sequence[list[int]], last: Sequence[int]) -> tuple[Tensor, Tensor]:
        with torch.no_grad(), self._autocast():
            host = torch.tensor(list(rows), dtype=torch.int64)
            logits, tokens = self._forward(host.to(self.device))
            index = torch.tensor(list(last), dtype=torch.int64).to(self.device)
            return logits[index], tokens[index]

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def _rows_of(request: Request) -> list[list[int]]:
    out = []
    for i, token in enumerate(request.tokens):
        pos = request.context_len + i
        out.append(
            [
                token,
                pos,
                kv_slot(request.block_ids, pos, BLOCK_SIZE),
                *request.block_ids,
                *([NULL_BLOCK] * (MAX_BLOCKS - len(request.block_ids))),
            ]
        )
    return out


class SdpaAutocastTarget:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, buggy: bool) -> None:
        self.spec = SPEC
        self.mode = mode
        self.runner = SdpaAutocastRunner(mode, seed=seed, cache_casts_in_capture=buggy)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length > 1 (prefill, mixed or speculative)"
        if self.runner.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            rows = [_rows_of(r)[0] for r in batch.requests]
            logits, tokens, size = self.runner.decode(rows)
            return StepResult(logits, tokens, "full", ("decode", size))
        rows, last = [], []
        for request in batch.requests:
            rows.extend(_rows_of(request))
            last.append(len(rows) - 1)
        if not rows:
            empty = torch.empty(0, VOCAB, device=self.runner.device)
            return StepResult(
                empty,
                torch.empty(0, dtype=torch.int64, device=self.runner.device),
                "eager",
                None,
                reason=reason,
            )
        logits, tokens = self.runner.eager(rows, last)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.runner.k_cache, "v": self.runner.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {"rows": self.runner.static} if self.runner.graphs else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.no_grad():
            self.runner.model.load(seed)  # in place: the graphs read the same parameters

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SdpaAutocastTarget:
    return SdpaAutocastTarget(mode, seed=seed, buggy=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SdpaAutocastTarget:
    return SdpaAutocastTarget(mode, seed=seed, buggy=True)
