"""A bfloat16 two-layer decoder with an INT8 paged KV cache, written against plain `torch.cuda`.

The KV cache is kept as TensorRT-LLM's and vLLM's int8 ("quantized KV") caches keep it: per layer
int8 codes, slot-major `[slots, heads, dim]`, beside a float32 scale per slot and head
`[slots, heads]` (symmetric per-token-head quantization: scale = amax / 127, code = round(x / scale),
clamped to [-127, 127]). Logits are upcast to float32.

Two paths, both correct implementations of the same maths:

- graph path (decode, one CUDA graph per capture size): quantizes with one fused float32
  expression (`x.float() / scale`, round, clamp) and attends by dequantizing *inside* the attention
  (the per-slot key scale folded into the scores, the value scale into the probabilities);
- eager path (prefill, mixed, speculative, oversize, and the eager twin): computes the scale and
  the division in bfloat16 (two roundings) and dequantizes the gathered cache to float32 before a
  plain float32 attention.

`make_target` and `make_buggy_target` write the cache with the eager path's quantizer on both
paths (only the order of the attention differs), as engines write it with one kernel.
`make_target_other_quantizer` quantizes on the graph path as above: the two quantizers put codes
on neighbouring values, which `states_match` accepts, and its logits differ by up to 5.1% of a
row's scale (3 of 10 seeds beyond bfloat16's 4e-2), as far as a bug moves them
(docs/own-runner.md: write the cache with the same quantizer on both paths).

Padding rows of a graph step carry vLLM's `PAD_SLOT_ID = -1` in their slot mapping; the store
redirects negative slots to the null block (vLLM's `reshape_and_cache*` kernels skip `slot < 0`).

Bug (`make_buggy_target`): the graph path's scale/code store indexes the cache with the slot
mapping as it is, so a padding row's `-1` wraps to the LAST slot of the cache (Python/PyTorch
negative indexing) and overwrites whatever request owns that block. Modelled on vLLM issue
https://github.com/vllm-project/vllm/issues/43810 (fixed by PR
https://github.com/vllm-project/vllm/pull/43869: "indexed into the KV cache using slot_mapping
without handling PADDING_SLOT_ID = -1 ... padding tokens overwrite the last valid KV cache slot").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS = 32, 2, 16, 64, 2
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS, VOCAB = 24, 4, 6, 48
CAPTURE_SIZES = (1, 2, 4)
NULL_BLOCK = 0
NULL_SLOT = NULL_BLOCK * BLOCK_SIZE
PAD_SLOT_ID = -1
CONTEXT = MAX_BLOCKS * BLOCK_SIZE
SLOTS = NUM_BLOCKS * BLOCK_SIZE
BF16 = torch.bfloat16

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
COLS = 3 + MAX_BLOCKS  # token, position, slot, block table


# -- quantizers -----------------------------------------------------------------------------------


def quant_fused(x: Tensor) -> tuple[Tensor, Tensor]:
    """One float32 expression: scale = amax / 127, code = clamp(round(x / scale))."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / 127.0).clamp_min(1e-8)
    codes = torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def quant_bf16(x: Tensor) -> tuple[Tensor, Tensor]:
    """The same maths in bfloat16: the scale and the division each rounded to bfloat16."""
    scale = (x.abs().amax(-1) / 127.0).clamp_min(1e-8)  # bfloat16
    q = x / scale[..., None]  # bfloat16
    codes = torch.round(q).clamp(-127, 127).to(torch.int8)
    return codes, scale.float()


class Int8KVRunner:
    def __init__(self, *, graphs: bool, seed: int, same_quant: bool, guard_pad: bool) -> None:
        self.device = torch.device("cuda")
        self.same_quant = same_quant
        self.guard_pad = guard_pad
        shapes = {"embed": (VOCAB, HIDDEN), "pos": (CONTEXT, HIDDEN), "head": (HIDDEN, VOCAB)}
        for layer in range(LAYERS):
            for n in "qkvo":
                shapes[f"{n}{layer}"] = (HIDDEN, HIDDEN)
            shapes[f"up{layer}"] = (HIDDEN, FFN)
            shapes[f"down{layer}"] = (FFN, HIDDEN)
        self.w = {n: torch.empty(s, device=self.device, dtype=BF16) for n, s in shapes.items()}
        self.load_weights(seed)
        self.cache: dict[str, Tensor] = {}
        for layer in range(LAYERS):
            for kv in "kv":
                self.cache[f"{kv}{layer}_codes"] = torch.zeros(
                    SLOTS, HEADS, HEAD_DIM, dtype=torch.int8, device=self.device
                )
                self.cache[f"{kv}{layer}_scale"] = torch.zeros(
                    SLOTS, HEADS, dtype=torch.float32, device=self.device
                )
        rows = max(CAPTURE_SIZES)
        self.staging = torch.zeros(rows, COLS, dtype=torch.int64, pin_memory=True)
        self.static = torch.zeros(rows, COLS, dtype=torch.int64, device=self.device)
        self.copy_stream = torch.cuda.Stream()
        self.uploaded = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if graphs:
            self._capture()

    def load_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            fresh = torch.randn(t.shape, generator=g)
            if name not in ("embed", "pos"):
                fresh = fresh / math.sqrt(t.shape[0])
            t.copy_(fresh.to(device=self.device, dtype=BF16))

    # -- graphs -----------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in sorted(CAPTURE_SIZES, reverse=True):
                self._upload([], size)
                self._forward(self.static[:size], fused=True)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(self.static[:size], fused=True)
                self.graphs[size] = graph

    def _upload(self, rows: Sequence[list[int]], size: int) -> None:
        self.uploaded.synchronize()
        pad = [0, 0, PAD_SLOT_ID] + [NULL_BLOCK] * MAX_BLOCKS
        for i in range(size):
            self.staging[i] = torch.tensor(rows[i] if i < len(rows) else pad, dtype=torch.int64)
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            self.static[:size].copy_(self.staging[:size], non_blocking=True)
            self.uploaded.record()
        torch.cuda.current_stream().wait_event(self.uploaded)

    def decode(self, rows: Sequence[list[int]]) -> tuple[Tensor, Tensor, int]:
        size = next(s for s in CAPTURE_SIZES if s >= len(rows))
        self._upload(rows, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = len(rows)
        return logits[:n].clone(), tokens[:n].clone(), size

    def eager(self, rows: Sequence[list[int]], last: Sequence[int]) -> tuple[Tensor, Tensor]:
        host = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), COLS)
        with torch.inference_mode():
            logits, tokens = self._forward(host.to(self.device), fused=False)
            index = torch.tensor(list(last), dtype=torch.int64, device=self.device)
            return logits[index], tokens[index]

    # -- the model --------------------------------------------------------------------------------

    def _store(self, layer: int, slots: Tensor, k: Tensor, v: Tensor, fused: bool) -> None:
        # same_quant: both paths share the fused float32 quantizer; only the attention differs.
        quant = quant_fused if fused or self.same_quant else quant_bf16
        if self.guard_pad:
            # PAD_SLOT_ID rows go to the null block (the kernels' `if (slot < 0) return;`).
            slots = torch.where(slots < 0, torch.full_like(slots, NULL_SLOT), slots)
        for name, x in (("k", k), ("v", v)):
            codes, scale = quant(x)
            self.cache[f"{name}{layer}_codes"].index_put_((slots,), codes)
            self.cache[f"{name}{layer}_scale"].index_put_((slots,), scale)

    def _attend(
        self, layer: int, q: Tensor, context: Tensor, visible: Tensor, fused: bool
    ) -> Tensor:
        kc = self.cache[f"k{layer}_codes"][context]  # [T, C, H, D] int8
        vc = self.cache[f"v{layer}_codes"][context]
        zero = torch.zeros((), device=q.device)
        ks = torch.where(visible[:, :, None], self.cache[f"k{layer}_scale"][context], zero)
        vs = torch.where(visible[:, :, None], self.cache[f"v{layer}_scale"][context], zero)
        mask = ~visible[:, None, :]
        if fused:
            # Dequantize inside the attention: scales folded into scores and probabilities.
            scores = torch.einsum("thd,tchd->thc", q.float(), kc.float())
            scores = scores * ks.permute(0, 2, 1) / math.sqrt(HEAD_DIM)
            probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
            weighted = probs * vs.permute(0, 2, 1)
            return torch.einsum("thc,tchd->thd", weighted, vc.float()).to(BF16)
        # Dequantize first, then a plain float32 attention.
        keys = kc.float() * ks[..., None]
        values = vc.float() * vs[..., None]
        scores = torch.einsum("thd,tchd->thc", q.float(), keys) / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return torch.einsum("thc,tchd->thd", probs, values).to(BF16)

    def _forward(self, rows: Tensor, *, fused: bool) -> tuple[Tensor, Tensor]:
        w = self.w
        tokens, positions, slots, tables = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:]
        offsets = torch.arange(BLOCK_SIZE, device=rows.device)
        context = (tables[:, :, None] * BLOCK_SIZE + offsets).flatten(1)
        visible = torch.arange(CONTEXT, device=rows.device)[None, :] <= positions[:, None]
        x = w["embed"][tokens] + w["pos"][positions]
        for layer in range(LAYERS):
            q, k, v = ((x @ w[f"{n}{layer}"]).view(-1, HEADS, HEAD_DIM) for n in "qkv")
            self._store(layer, slots, k, v, fused)
            attended = self._attend(layer, q, context, visible, fused).flatten(1)
            x = x + attended @ w[f"o{layer}"]
            x = x + torch.nn.functional.silu(x @ w[f"up{layer}"]) @ w[f"down{layer}"]
        logits = (x @ w["head"]).float()
        return logits, logits.argmax(-1)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def rows_of(request: Request) -> list[list[int]]:
    table = list(request.block_ids) + [NULL_BLOCK] * (MAX_BLOCKS - len(request.block_ids))
    out = []
    for i, token in enumerate(request.tokens):
        pos = request.context_len + i
        out.append([token, pos, kv_slot(request.block_ids, pos, BLOCK_SIZE), *table])
    return out


class Int8Target:
    def __init__(self, mode: str, *, seed: int, same_quant: bool = False, guard_pad: bool = True):
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.runner = Int8KVRunner(
            graphs=mode == "graph", seed=seed, same_quant=same_quant, guard_pad=guard_pad
        )

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.context_len == 0 or r.query_len != 1 for r in batch.requests):
            return "not a pure one-token decode"
        if batch.num_reqs > max(CAPTURE_SIZES):
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            logits, tokens, size = self.runner.decode([rows_of(r)[0] for r in batch.requests])
            return StepResult(logits, tokens, "full", ("decode", size))
        rows: list[list[int]] = []
        last: list[int] = []
        for r in batch.requests:
            rows.extend(rows_of(r))
            last.append(len(rows) - 1)
        if not rows:
            empty = torch.zeros(0, VOCAB, device=self.runner.device)
            return StepResult(
                empty,
                torch.zeros(0, dtype=torch.int64, device=self.runner.device),
                "eager",
                None,
                reason=reason,
            )
        logits, tokens = self.runner.eager(rows, last)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return self.runner.cache

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {"rows": self.runner.static} if self.runner.graphs else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.load_weights(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Int8Target:
    return Int8Target(mode, seed=seed, same_quant=True)


def make_target_other_quantizer(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> Int8Target:
    return Int8Target(mode, seed=seed)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Int8Target:
    return Int8Target(mode, seed=seed, same_quant=True, guard_pad=False)
