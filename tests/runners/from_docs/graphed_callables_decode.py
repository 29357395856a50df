"""A decode runner whose graph mode is built with `torch.cuda.make_graphed_callables`.

What it is
----------
A one-layer paged-KV decoder written against plain `torch.cuda` (weights and cache made with
`device="cuda"`), as an outside engineer would write it from PyTorch's public documentation of
`torch.cuda.make_graphed_callables`, instead of calling `torch.cuda.graph` by hand:

* one graphed callable per capture size (1, 2, 4 rows), made at start-up, largest first, all in
  one pool (`pool=torch.cuda.graph_pool_handle()`), under `torch.inference_mode()`;
* the callable is a plain function (not an `nn.Module`: graphing a module replaces its `forward`,
  and a second capture size would replace the first one's; the eager path also needs the
  original), whose sample args are only tensors (`rows` int64 [S, 3 + max_blocks], `seeds` int64
  [S], `temps` float32 [S]); none requires grad, as none will at a call (the documented
  requirement that the sample args' `requires_grad` state match the real inputs'), and inference
  needs no backward graph, so `allow_unused_input` stays False;
* every decode step builds *fresh* device tensors of the full capture size (valid rows, then
  padding rows pointing at the null block) and calls the graphed callable with them: the graphed
  callable copies each argument whose `data_ptr()` differs from its sample arg into that sample
  arg (its static input) and replays. The sample args are therefore the graph's static inputs,
  and `static_buffers()` lists them: the harness may poison them, every call rewrites all rows;
* the graphed callable returns its *static outputs* (`o.detach()` of the tensors the capture
  produced), which its next call overwrites: the correct runner copies the rows it hands out;
* prefill, mixed, speculative and oversized batches run the original function eagerly.

Sampling is Gumbel-max with noise hashed from (seed, position, token id) inside the function,
seeds and temperatures being graph inputs, so a request samples the same token in any batch.

The bug (`make_buggy_target`)
-----------------------------
The buggy runner treats the graphed callable as the "drop-in replacement for its source
callable" the docs call it: it hands out `logits[:n]` / `tokens[:n]` of what the call returned,
assuming (as for the eager function) that these are fresh tensors. They are views of the graph's
static output buffers, which the next call of the same graphed callable overwrites, so a result
the caller kept changes under it (bug class 7, `results_stay_valid`).

Public source: the same aliasing of returned static buffers, in the backward direction, is
pytorch/pytorch#181723 ("torch.cuda.make_graphed_callables can silently corrupt parameter
gradient accumulation by returning static grad buffers", https://github.com/pytorch/pytorch/issues/181723),
fixed in TransformerEngine's copy of the API by cloning the returned grads
(NVIDIA/TransformerEngine#2937, "Fix CUDA graph parameter grad lifetime",
https://github.com/NVIDIA/TransformerEngine/pull/2937). The input side of the same contract
(arguments are copied into static inputs, so in-place writes to an argument never reach the
caller's tensor) is pytorch/pytorch#178586 / PR #184699 (closed unmerged). No engine code copied.

Extra probe (`make_buggy_target_dummy_cache`, not the module's bug): the KV caches are arguments
of the graphed callable, as engines pass `kv_caches` to their forward, and its sample args are
zero dummies of the caches' shape (as PyTorch's examples make samples) rather than the caches.
Every call then copies the live cache into the dummy (their `data_ptr()` differ), the graph
writes the step's keys into the dummy, and the live cache never gets them: the input-mutation
half of the contract above (pytorch/pytorch#178586).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NULL_BLOCK = 0
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 24, 6
VOCAB = 48
CAPTURE_SIZES = (1, 2, 4)
CONTEXT = BLOCK_SIZE * MAX_BLOCKS
WIDTH = 3 + MAX_BLOCKS  # token, position, slot, block table

SPEC = TargetSpec(
    num_blocks=NUM_BLOCKS,
    block_size=BLOCK_SIZE,
    max_blocks_per_req=MAX_BLOCKS,
    vocab_size=VOCAB,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=CAPTURE_SIZES,
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=NULL_BLOCK,
)

_MASK32 = 0xFFFFFFFF


def _hash_uniform(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """Uniform noise in (0, 1), [T, vocab], from an integer hash of (seed, position, token id)."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * 0x9E3779B1 + positions[:, None] * 0x85EBCA77 + ids[None, :] * 0xC2B2AE3D
    x = x & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK32
    x = x ^ (x >> 15)
    return ((x >> 8).to(torch.float32) + 0.5) / float(1 << 24)


class TinyDecoder(nn.Module):
    """Embedding + learned positions, one attention layer over a slot-major paged cache, LM head."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        shapes = {
            "embed": (VOCAB, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "head": (HIDDEN, VOCAB),
        }
        for name, shape in shapes.items():
            self.register_parameter(
                name, nn.Parameter(torch.empty(shape, device=device), requires_grad=False)
            )
        slots = NUM_BLOCKS * BLOCK_SIZE
        self.register_buffer("k_cache", torch.zeros(slots, HEADS, HEAD_DIM, device=device))
        self.register_buffer("v_cache", torch.zeros(slots, HEADS, HEAD_DIM, device=device))

    def load(self, seed: int) -> None:
        """New weights in place: the captured graphs keep reading the same tensors."""
        generator = torch.Generator().manual_seed(seed)
        for _name, param in sorted(self.named_parameters()):
            fresh = torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[0])
            param.copy_(fresh.to(param.device))

    def rows_forward(
        self, rows: Tensor, seeds: Tensor, temps: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One query token per row. rows: [T, 3 + max_blocks] int64; seeds: [T] int64;
        temps: [T] float32, 0 for greedy; the caches (written in place), as engines pass their
        `kv_caches` to the forward. Returns logits [T, vocab] and next tokens [T]."""
        tokens, positions, slots, tables = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:]
        x = self.embed[tokens] + self.pos[positions]
        q = (x @ self.wq).view(-1, HEADS, HEAD_DIM)
        k_cache.index_copy_(0, slots, (x @ self.wk).view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, slots, (x @ self.wv).view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(BLOCK_SIZE, device=rows.device)
        context = (tables[:, :, None] * BLOCK_SIZE + offsets).flatten(1)  # [T, CONTEXT] slots
        keys, values = k_cache[context], v_cache[context]
        visible = torch.arange(CONTEXT, device=rows.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        # masked slots may hold NaN (the null block is poisoned): 0 * NaN would leak it
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).flatten(1)
        logits = (x + attended @ self.wo) @ self.head
        # Gumbel-max sampling; the noise depends on (seed, position, token id) only
        gumbel = -torch.log(-torch.log(_hash_uniform(seeds, positions, VOCAB)))
        sampled = (logits / temps.clamp_min(1e-6)[:, None] + gumbel).argmax(-1)
        next_tokens = torch.where(temps > 0, sampled, logits.argmax(-1))
        return logits, next_tokens


def _row(request: Request, index: int) -> list[int]:
    position = request.context_len + index
    table = list(request.block_ids) + [NULL_BLOCK] * (MAX_BLOCKS - len(request.block_ids))
    return [
        request.tokens[index],
        position,
        kv_slot(request.block_ids, position, BLOCK_SIZE),
        *table,
    ]


_PADDING_ROW = [0, 0, NULL_BLOCK * BLOCK_SIZE] + [NULL_BLOCK] * MAX_BLOCKS


def _sampling(request: Request) -> tuple[int, float]:
    if request.seed is None:
        return 0, 0.0
    return request.seed % (1 << 31), float(request.temperature)


class GraphedCallablesTarget:
    """Graph twin: decode batches of up to 4 one-token requests call the graphed callable of the
    smallest capture size that fits; everything else runs the model's function eagerly."""

    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, bug: str | None = None
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        if bug not in (None, "aliased_outputs", "dummy_cache_sample"):
            raise ValueError(f"unknown bug {bug!r}")
        self.spec = SPEC
        self.mode = mode
        self.bug = bug
        self.device = torch.device("cuda")
        # graphed callables: size -> callable; their sample args (the static inputs) by size
        self.graphed: dict[int, Callable[..., tuple[Tensor, Tensor]]] = {}
        self.sample_args: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self._dummies: dict[int, tuple[Tensor, ...]] = {}
        with torch.inference_mode():
            self.model = TinyDecoder(self.device)
            self.model.load(seed)
            if mode == "graph":
                self._make_graphed()

    # -- graphs ---------------------------------------------------------------------------------

    def _make_graphed(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(CAPTURE_SIZES, reverse=True):
            # every row is padding during warm-up and capture: the warm-up iterations run the
            # function for real (3 times) and write the null block only
            rows = torch.tensor([_PADDING_ROW] * size, dtype=torch.int64, device=self.device)
            seeds = torch.zeros(size, dtype=torch.int64, device=self.device)
            temps = torch.zeros(size, dtype=torch.float32, device=self.device)
            if self.bug == "dummy_cache_sample":
                # BUG (variant): dummy caches of the right shape as sample args, as the docs'
                # examples make samples; every call then copies the live cache into them (its
                # data_ptr differs) and the graph writes the new keys into the dummy only
                caches = tuple(torch.zeros_like(c) for c in self._caches())
            else:
                # the live caches themselves: same data_ptr at every call, so never copied, and
                # the graph's in-place writes land in them
                caches = self._caches()
            self.graphed[size] = torch.cuda.make_graphed_callables(
                self.model.rows_forward, (rows, seeds, temps, *caches), pool=pool
            )
            # kept alive as long as the graph; the harness may poison them (not the caches)
            self.sample_args[size] = (rows, seeds, temps)
            self._dummies[size] = caches if self.bug == "dummy_cache_sample" else ()

    def _caches(self) -> tuple[Tensor, Tensor]:
        return self.model.k_cache, self.model.v_cache

    def _capture_size(self, num_reqs: int) -> int | None:
        return next((s for s in CAPTURE_SIZES if s >= num_reqs), None)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.query_len != 1 for r in batch.requests):
            return "query length above one (prefill or speculative decode)"
        if self._capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    # -- steps ----------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            if reason is None:
                return self._replay(batch)
            return self._eager(batch, reason)

    def _replay(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        size = self._capture_size(n)
        assert size is not None
        rows = [_row(r, 0) for r in batch.requests] + [_PADDING_ROW] * (size - n)
        sampling = [_sampling(r) for r in batch.requests] + [(0, 0.0)] * (size - n)
        # fresh tensors every step: the graphed callable copies them into its static inputs
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        seeds_t = torch.tensor([s for s, _ in sampling], dtype=torch.int64, device=self.device)
        temps_t = torch.tensor([t for _, t in sampling], dtype=torch.float32, device=self.device)
        logits, tokens = self.graphed[size](rows_t, seeds_t, temps_t, *self._caches())
        if self.bug == "aliased_outputs":
            logits, tokens = logits[:n], tokens[:n]  # BUG: views of the graph's static outputs
        else:
            # the graphed callable returns its static outputs: its next call overwrites them
            logits, tokens = logits[:n].clone(), tokens[:n].clone()
        return StepResult(logits, tokens, "full", ("decode", size))

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        rows: list[list[int]] = []
        sampling: list[tuple[int, float]] = []
        last: list[int] = []
        for request in batch.requests:
            for i in range(request.query_len):
                rows.append(_row(request, i))
                sampling.append(_sampling(request))
            last.append(len(rows) - 1)
        if not rows:
            empty = torch.empty(0, VOCAB, device=self.device)
            return StepResult(
                empty,
                torch.empty(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason=reason,
            )
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        seeds_t = torch.tensor([s for s, _ in sampling], dtype=torch.int64, device=self.device)
        temps_t = torch.tensor([t for _, t in sampling], dtype=torch.float32, device=self.device)
        logits, tokens = self.model.rows_forward(rows_t, seeds_t, temps_t, *self._caches())
        index = torch.tensor(last, dtype=torch.int64, device=self.device)
        return StepResult(logits[index], tokens[index], "eager", None, reason=reason)

    # -- contract -------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.model.k_cache, "v": self.model.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        buffers: dict[str, Tensor] = {}
        for size, (rows, seeds, temps) in self.sample_args.items():
            buffers[f"rows{size}"] = rows
            buffers[f"seeds{size}"] = seeds
            buffers[f"temps{size}"] = temps
        return buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load(seed)

    def close(self) -> None:
        self.graphed.clear()
        self.sample_args.clear()
        self._dummies.clear()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> GraphedCallablesTarget:
    # `backend` is not the runner's business: on sim the harness's drop-in is active around it
    return GraphedCallablesTarget(mode, seed=seed)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> GraphedCallablesTarget:
    return GraphedCallablesTarget(mode, seed=seed, bug="aliased_outputs")


def make_buggy_target_dummy_cache(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> GraphedCallablesTarget:
    """Extra probe, not the module's bug: the caches are arguments of the graphed callable, and
    its sample args are zero dummies of their shape instead of the caches themselves."""
    return GraphedCallablesTarget(mode, seed=seed, bug="dummy_cache_sample")
