"""A decode graph runner whose paged KV cache is ONE tensor per layer in FlashInfer's layout.

The cache is `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (keys and values interleaved
per block, "NHD"), as vLLM's FlashInfer backend allocates it, not two slot-major tensors. The
model is a one-layer decoder (token + learned position embedding, paged attention over the cache
through block tables, SiLU MLP, LM head) with counter-based Gumbel-max sampling (a hash of seed,
position and token id). Keys and values are written through a slot mapping computed on the host
from the block table (slot = block * block_size + offset), translated on the device into the
row of the interleaved cache (`block * 2 * block_size + kv * block_size + offset`). Graph mode
captures one decode graph per capture size (largest first, one shared pool); everything else
(prefill, mixed, speculative decode, batches past the largest size) runs eagerly.

`state()`: the contract wants each KV tensor slot-major (`[num_slots, heads, dim]`), and no view of
this layout is: within a block the keys are one row apart, but a block's last key and the next
block's first key have the block's values between them, so the slot dimension
`num_blocks * block_size` has no single stride (and `cache[:, 0].reshape(...)` is a copy, where
the harness's marks, poison and restores would land and be lost). So the runner keeps a
slot-major IMAGE of each of K and V (contiguous `[num_slots, heads, dim]`) and `state()` returns
the images. Every `step()` first copies the images into the real cache (so the harness's marks,
poison and restores reach it) and, after the step's work is queued, copies the cache back into
the images (so the harness sees every write), both on the current stream. This is the "image
copied in before each step and back after it" design docs/own-runner.md names for layouts that
do not allow views.

Correct runner (`make_target`): `prepare()` fills the padding rows of every static buffer, the
slot mapping's with the null block's slot.

Bug (`make_buggy_target`): `prepare()` writes the slot mapping for the batch's rows only and leaves
the padding rows' entries at whatever the static buffer held (a stale slot of a departed request,
or the harness's poison), so a padded replay writes the padding row's garbage keys/values into a
block it does not own, or indexes past the cache. Padding rows not inert: what vLLM's PAD_SLOT_ID
(-1) fill of `slot_mapping[num_tokens:]` exists to prevent. Public sources: vLLM issue
https://github.com/vllm-project/vllm/issues/43810 (CUDA-graph padding's slot mapping writes
padding hidden states into a live KV slot; fix https://github.com/vllm-project/vllm/pull/43869),
and lmdeploy https://github.com/InternLM/lmdeploy/pull/4569 ("kv cache would be polluted if
block_offsets contain data from previous step": padding rows of graph inputs not reset). No code
was copied from those projects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
HIDDEN, KV_HEADS, HEAD_DIM, LAYERS = 32, 2, 16, 1
BS = SPEC.block_size
CONTEXT = SPEC.max_blocks_per_req * BS
NULL_SLOT = SPEC.null_block * BS
M32 = 0xFFFFFFFF


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] slot-major slot of each token (block * block_size + offset)
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temps: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] last token of each request (None: one token per request)


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, KV_HEADS * HEAD_DIM),
            "wk": (HIDDEN, KV_HEADS * HEAD_DIM),
            "wv": (HIDDEN, KV_HEADS * HEAD_DIM),
            "wo": (KV_HEADS * HEAD_DIM, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.device = device
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def forward(self, inp: Inputs, caches: list[Tensor]) -> Tensor:
        w = self.w
        x = w["embed"][inp.tokens] + w["pos"][inp.positions]
        for cache in caches:  # cache: [num_blocks, 2, BS, heads, dim]
            h = _rms(x)
            q = (h @ w["wq"]).view(-1, KV_HEADS, HEAD_DIM)
            k = (h @ w["wk"]).view(-1, KV_HEADS, HEAD_DIM)
            v = (h @ w["wv"]).view(-1, KV_HEADS, HEAD_DIM)
            write_kv(cache, inp.slots, k, v)
            x = x + paged_attention(q, cache, inp).flatten(1) @ w["wo"]
            x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if inp.last is not None:
            x = x[inp.last]
        return _rms(x) @ w["head"]


def write_kv(cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Store by slot into the interleaved layout (what reshape_and_cache_flash does for NHD)."""
    block = torch.div(slots, BS, rounding_mode="floor")
    offset = slots - block * BS
    key_rows = block * (2 * BS) + offset  # row of [num_blocks * 2 * BS, heads, dim]
    flat = cache.view(-1, KV_HEADS, HEAD_DIM)
    flat.index_copy_(0, key_rows, k)
    flat.index_copy_(0, key_rows + BS, v)


def paged_attention(q: Tensor, cache: Tensor, inp: Inputs) -> Tensor:
    blocks = cache[inp.tables]  # [T, MB, 2, BS, heads, dim]
    keys = blocks[:, :, 0].flatten(1, 2)  # [T, CONTEXT, heads, dim]
    values = blocks[:, :, 1].flatten(1, 2)
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inp.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = scores.softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values)


def sample(logits: Tensor, inp: Inputs) -> Tensor:
    pos = inp.positions if inp.last is None else inp.positions[inp.last]
    key = _hash(_hash(inp.seeds) ^ ((pos * 0x27D4EB2F) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x165667B1) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / inp.temps[:, None] - torch.log(-torch.log(u))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // BS] * BS + pos % BS


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
}


class FlashInferLayoutRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, stale_pad_slots: bool
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.be: Any = get_backend(backend)
        self.stale_pad_slots = stale_pad_slots
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_blocks, 2, BS, KV_HEADS, HEAD_DIM)
        self.caches = [torch.zeros(shape, device=dev) for _ in range(LAYERS)]
        # slot-major images of K and V, the tensors state() hands the harness
        self.images = [
            (
                torch.zeros(SPEC.num_slots, KV_HEADS, HEAD_DIM, device=dev),
                torch.zeros(SPEC.num_slots, KV_HEADS, HEAD_DIM, device=dev),
            )
            for _ in range(LAYERS)
        ]
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            n, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(n, dtype=i64, device=dev),
                "positions": torch.zeros(n, dtype=i64, device=dev),
                "slots": torch.full((n,), NULL_SLOT, dtype=i64, device=dev),
                "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(n, dtype=i64, device=dev),
                "temps": torch.ones(n, device=dev),
                "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
            }
            self.capture()

    # -- image <-> cache ---------------------------------------------------------------------

    def _image_views(self, i: int) -> tuple[Tensor, Tensor]:
        k_img, v_img = self.images[i]
        return (
            k_img.view(SPEC.num_blocks, BS, KV_HEADS, HEAD_DIM),
            v_img.view(SPEC.num_blocks, BS, KV_HEADS, HEAD_DIM),
        )

    def load_images(self) -> None:
        for i, cache in enumerate(self.caches):
            k4, v4 = self._image_views(i)
            cache[:, 0].copy_(k4)
            cache[:, 1].copy_(v4)

    def store_images(self) -> None:
        for i, cache in enumerate(self.caches):
            k4, v4 = self._image_views(i)
            k4.copy_(cache[:, 0])
            v4.copy_(cache[:, 1])

    # -- graph mode --------------------------------------------------------------------------

    def static_inputs(self, size: int) -> Inputs:
        return Inputs(**{k: b[:size] for k, b in self.buffers.items()})

    def capture(self) -> None:
        with torch.inference_mode():
            self._capture()

    def _capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inp = self.static_inputs(size)
            self.run_model(inp)
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[size] = self.run_model(inp)
            self.graphs[size] = g

    def prepare(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        samp = [_sampling(r) for r in reqs]
        rows = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temps": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        for name, vals in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(vals, dtype=buf.dtype))
            if name == "slots" and self.stale_pad_slots and n:
                continue  # BUG: padding rows keep whatever slot the buffer held
            buf[n:size].fill_(PAD[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes --------------------------------------------------------------------------

    def run_model(self, inp: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, self.caches)
        return logits, sample(logits, inp)

    def eager_inputs(self, batch: Batch) -> Inputs:
        tok, pos, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for j, token in enumerate(r.tokens):
                p = r.context_len + j
                tok.append(token)
                pos.append(p)
                slots.append(_slot(r, p))
                tables.append(_table(r))
            last.append(len(tok) - 1)
        samp = [_sampling(r) for r in batch.requests]
        dev = self.be.device

        def t(vals: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(vals, dtype=dtype, device=dev)

        return Inputs(
            t(tok),
            t(pos),
            t(slots),
            t(tables).view(-1, SPEC.max_blocks_per_req),
            t([s[0] for s in samp]),
            t([s[1] for s in samp], torch.float32),
            t([s[2] for s in samp], torch.bool),
            t(last),
        )

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length > 1 (prefill, mixed or speculative)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            self.load_images()
            reason = self.fallback_reason(batch)
            if reason is None:
                result = self.replay(batch)
            else:
                logits, tokens = self.run_model(self.eager_inputs(batch))
                result = StepResult(logits, tokens, "eager", None, reason=reason)
            self.store_images()
            return result

    def state(self) -> Mapping[str, Tensor]:
        out: dict[str, Tensor] = {}
        for i, (k_img, v_img) in enumerate(self.images):
            out[f"k{i}"], out[f"v{i}"] = k_img, v_img
        return out

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> FlashInferLayoutRunner:
    return FlashInferLayoutRunner(mode, seed=seed, backend=backend, stale_pad_slots=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> FlashInferLayoutRunner:
    return FlashInferLayoutRunner(mode, seed=seed, backend=backend, stale_pad_slots=True)
