"""A decode runner modelled on vLLM V1's multimodal input path under async scheduling, with one real bug.

The engine mechanism: vLLM V1's `GPUModelRunner` builds, on the host, a boolean mask over the step's
tokens (`is_mm_embed`) that says which positions take a multimodal encoder embedding instead of the
token embedding (the image-placeholder tokens of a vision-language prompt). The mask lives in a
`CpuGpuBuffer`: pinned host memory, filled by the host every step and copied to its device twin with
`non_blocking=True`; the model merges the two embeddings with it before the decoder layers. With
`async_scheduling=True` the engine does not wait for a step to finish before it prepares the next,
so that copy may still be queued when the host fills the pinned mask for the next step.

Here a vision placeholder is any token id at or above `IMAGE_TOKEN_MIN` (the runner derives the mask
from the batch's tokens alone, as an engine derives it from the request's prompt); its embedding is
a vision table indexed by position, standing in for the encoder output. Decode steps of up to 8 rows
replay full CUDA graphs captured per row count (one shared pool, padding rows at the null block);
prefill, mixed and chunked-prompt steps run eagerly. Both paths stage the mask through the same
pinned buffer, as the engine does, and everything else through device copies of fresh tensors.

The bug (`single_pinned_mask=True`): vllm-project/vllm issue #31679 ("sporadic engine crashes with
--async-scheduling on Qwen3-VL under sustained multimodal load",
https://github.com/vllm-project/vllm/issues/31679), fixed by PR #31841 ("[Bugfix] Fix race
condition in async-scheduling for vlm model", https://github.com/vllm-project/vllm/pull/31841).
One pinned `is_mm_embed` buffer served every step: the host wrote step N+1's mask into it while
step N's asynchronous host-to-device copy out of it had not run yet, so step N's forward merged
its embeddings with step N+1's mask. The fix keeps two pinned masks and alternates between them
step by step, so the host never writes the buffer whose copy the step still in flight reads (one
step in flight at most, the engine's async depth). The effect shows only when two steps overlap
and their masks differ at some row, i.e. in a pipelined pair whose steps place vision tokens
differently.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),  # decode graphs, keyed by row count (one token a row)
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN = 32
MAX_LEN = SPEC.max_blocks_per_req * SPEC.block_size
IMAGE_TOKEN_MIN = 40  # token ids 40..47 are vision placeholders
VISION_ROWS = 16  # the stand-in encoder output: one embedding per position modulo this
_M32 = 0xFFFFFFFF


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "vision": (VISION_ROWS, HIDDEN),
            "pos": (MAX_LEN, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # copied in place: the captured graphs read these tensors
            w = self.t[name]
            scale = 1.0 if name in ("embed", "vision", "pos") else 1.0 / math.sqrt(w.shape[0])
            w.copy_((torch.randn(w.shape, generator=gen) * scale).to(w.device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _sample(logits: Tensor, seeds: Tensor, positions: Tensor, sampled: Tensor, temps: Tensor):
    """Gumbel-max with noise hashed from (seed, position, token id): no generator, no batch."""
    key = _hash(_hash(seeds & _M32) ^ ((positions * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class VlmAsyncRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, single_pinned_mask: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.single_pinned_mask = SPEC, mode, single_pinned_mask
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HIDDEN, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HIDDEN, device=dev)
        # the is_mm_embed CpuGpuBuffer: pinned host halves (two after the fix) and one device half
        n = SPEC.max_num_tokens
        self.mask_host = [self.be.empty_pinned(n, dtype=torch.bool) for _ in range(2)]
        self.mask_turn = 0
        self.mask_dev = torch.zeros(n, dtype=torch.bool, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buf: dict[str, Tensor] = {}
        if mode == "graph":
            rows = max(SPEC.capture_sizes)
            i64 = {"dtype": torch.int64, "device": dev}
            self.buf = {
                "tokens": torch.zeros(rows, **i64),
                "positions": torch.zeros(rows, **i64),
                "slots": torch.zeros(rows, **i64),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, **i64),
                "seeds": torch.zeros(rows, **i64),
                "temps": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
                "is_mm": self.mask_dev,  # the graph reads the device half of the mask
            }
            self.capture()

    # -- model ------------------------------------------------------------------------------------

    def forward(self, tokens, positions, slots, tables, is_mm) -> Tensor:
        w = self.w.t
        text = w["embed"][tokens]
        vision = w["vision"][positions % VISION_ROWS]
        x = torch.where(is_mm[:, None], vision, text) + w["pos"][positions.clamp(0, MAX_LEN - 1)]
        h = _norm(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        offsets = torch.arange(SPEC.block_size, device=tokens.device)
        ctx_slots = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, MAX_LEN]
        ctx_pos = torch.arange(MAX_LEN, device=tokens.device)
        visible = ctx_pos[None, :] <= positions[:, None]
        scores = torch.einsum("td,tcd->tc", q, self.k_cache[ctx_slots]) / math.sqrt(HIDDEN)
        # masked slots may hold NaN (the poisoned null block): select, never multiply
        scores = torch.where(visible, scores, torch.full((), -math.inf, device=q.device))
        vals = torch.where(visible[..., None], self.v_cache[ctx_slots], 0.0)
        x = x + torch.einsum("tc,tcd->td", scores.softmax(-1), vals) @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        return _norm(x) @ w["head"]

    # -- the mask, staged as the engine stages it ------------------------------------------------

    def stage_mask(self, tokens: Sequence[int], size: int) -> Tensor:
        """Fill a pinned mask on the host and queue its copy to the device; return the device half."""
        host = self.mask_host[self.mask_turn]
        flags = [t >= IMAGE_TOKEN_MIN for t in tokens] + [False] * (size - len(tokens))
        host[:size].copy_(torch.tensor(flags, dtype=torch.bool))  # a host write into pinned memory
        self.mask_dev[:size].copy_(host[:size], non_blocking=True)  # queued, as in async scheduling
        if not self.single_pinned_mask:
            self.mask_turn ^= 1  # PR #31841: the next step fills the other pinned buffer
        return self.mask_dev[:size]

    # -- graph mode -------------------------------------------------------------------------------

    def prepare(self, batch: Batch, size: int) -> None:
        """Write the batch into the static buffers' prefix and every padding row after it."""
        reqs, pad = batch.requests, size - batch.num_reqs
        null_slot = SPEC.null_block * SPEC.block_size
        tables = [
            list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for r in reqs
        ]
        rows = {
            "tokens": [r.tokens[0] for r in reqs] + [0] * pad,
            "positions": [r.context_len for r in reqs] + [0] * pad,
            "slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs]
            + [null_slot] * pad,
            "tables": tables + [[SPEC.null_block] * SPEC.max_blocks_per_req] * pad,
            "seeds": [(r.seed or 0) & _M32 for r in reqs] + [0] * pad,
            "temps": [r.temperature for r in reqs] + [1.0] * pad,
            "sampled": [r.seed is not None for r in reqs] + [False] * pad,
        }
        for name, values in rows.items():
            dst = self.buf[name]
            dst[:size].copy_(torch.tensor(values, dtype=dst.dtype).to(self.device))
        self.stage_mask([t for r in reqs for t in r.tokens], size)

    def run_static(self, size: int) -> tuple[Tensor, Tensor]:
        b = self.buf
        logits = self.forward(
            b["tokens"][:size],
            b["positions"][:size],
            b["slots"][:size],
            b["tables"][:size],
            b["is_mm"][:size],
        )
        tokens = _sample(
            logits, b["seeds"][:size], b["positions"][:size], b["sampled"][:size], b["temps"][:size]
        )
        return logits, tokens

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)  # every row is padding during warm-up and capture
            self.run_static(size)  # warm-up outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self.run_static(size)
            self.graphs[size] = graph

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if any(len(r.tokens) != 1 for r in batch.requests):
            return "prefill or mixed step: graphs serve one token a row"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more rows than the largest graph"
        return None

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(
                empty, torch.zeros(0, dtype=torch.int64, device=self.device), "eager", None, "empty"
            )
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self.run_eager(batch, reason)
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()  # no wait: the next step is prepared while this one runs
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        reqs, dev = batch.requests, self.device
        tok, pos, slots, tables, last = [], [], [], [], []
        for r in reqs:
            table = list(r.block_ids) + [SPEC.null_block] * (
                SPEC.max_blocks_per_req - len(r.block_ids)
            )
            for i, t in enumerate(r.tokens):
                tok.append(t)
                pos.append(r.context_len + i)
                slots.append(kv_slot(r.block_ids, r.context_len + i, SPEC.block_size))
                tables.append(table)
            last.append(len(tok) - 1)
        as_dev = lambda v: torch.tensor(v, dtype=torch.int64).to(dev)  # noqa: E731
        is_mm = self.stage_mask(tok, len(tok))
        logits = self.forward(as_dev(tok), as_dev(pos), as_dev(slots), as_dev(tables), is_mm)[
            as_dev(last)
        ]
        tokens = _sample(
            logits,
            as_dev([(r.seed or 0) & _M32 for r in reqs]),
            as_dev([r.seq_len - 1 for r in reqs]),
            torch.tensor([r.seed is not None for r in reqs]).to(dev),
            torch.tensor([r.temperature for r in reqs], dtype=torch.float32).to(dev),
        )
        return StepResult(logits, tokens, "eager", None, reason)

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buf

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> VlmAsyncRunner:
    return VlmAsyncRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> VlmAsyncRunner:
    return VlmAsyncRunner(mode, seed=seed, backend=backend, single_pinned_mask=True)
