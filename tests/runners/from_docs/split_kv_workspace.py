"""Split-KV ("flash-decoding") decode runner with a persistent partials workspace.

What the runner is
------------------
A one-layer decoder (token embedding + learned positions, attention over a slot-major paged KV
cache, SiLU MLP, LM head, counter-hash Gumbel sampling) whose attention is split-KV: each query
token's context is cut into fixed chunks of SPLIT positions; a "split kernel" computes, for every
chunk the token reaches, a partial output and its log-sum-exp, and writes them into a workspace of
shape [rows, MAX_SPLITS, heads, (dim)]; a "combine kernel" merges the splits with the usual
LSE-weighted sum. As in real split-KV kernels (FlashInfer's split-k decode, FlashAttention's
splitkv path, vLLM/SGLang MLA decode), the split kernel is launched over all MAX_SPLITS chunks
and a chunk past the request's context exits without writing its slot.

Graph mode keeps ONE workspace for all decode graphs, allocated once at construction (as engines
do: a CUDA graph needs fixed addresses), LSE filled with -inf. The number of valid splits per row
(`num_splits`, like FlashInfer's planned metadata) is a static graph input rewritten every step.
The eager path allocates a fresh workspace per step (as a non-graph call to such a kernel does).

Correct runner: the combine masks splits >= num_splits[row] (their LSE treated as -inf and their
partial output as 0, with `torch.where`, so whatever the workspace holds there is inert).

Bug (make_buggy_target)
-----------------------
The combine trusts the workspace: it merges all MAX_SPLITS slots of a row and relies on unused
slots still holding -inf LSE. That holds only until the row is first used by a longer request:
the -inf was written once, at allocation, and the capture/warm-up (all padding rows, one split)
never rewrites slots 1..MAX_SPLITS-1. After a request with k splits leaves a row, a shorter
request replayed in that row merges the stale partial outputs (with their finite LSEs) of the
earlier request's chunks: its attention silently mixes in another request's context. Eager is
unaffected (fresh -inf workspace every step), so this is a graph-only bug.

Public sources this is modelled on (no code copied):
- ROCm/aiter#4420, "mla: guard NaN / empty splits in mla_reduce_v1 (persistent MLA split-KV
  decode)" https://github.com/ROCm/aiter/pull/4420 : the persistent split-KV reduce trusted every
  per-split partial in its workspace; poisoned/empty splits leaked into the merged output under
  SGLang (the non-persistent path "already skips invalid splits"); gsm8k 0.79 -> 0.95 with the fix.
- flashinfer-ai/flashinfer#4002 / PR #5176 https://github.com/flashinfer-ai/flashinfer/issues/4002
  https://github.com/flashinfer-ai/flashinfer/pull/5176 : under CUDA graphs padded CTAs read
  workspace entries this plan never wrote; "If the workspace still holds an earlier plan" the
  result is wrong/out of bounds, while a fresh workspace "happens to be correct".
- ROCm/aiter#3641 https://github.com/ROCm/aiter/pull/3641 : MLA decode reduce must give an empty
  KV split (-inf LSE) zero weight.

static_buffers(): the graph inputs prepare() rewrites every step (tokens, positions, slots,
tables, seeds, temperatures, sampled, num_splits). The split workspace is not declared: it is
kernel scratch, written by the split kernel inside the graph, not an input the runner rewrites
(the contract asks for "the graph inputs the runner rewrites every step").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size  # 24 positions
SPLIT = 4  # positions per KV split (one block)
MAX_SPLITS = CONTEXT // SPLIT  # 6
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


# -- model -----------------------------------------------------------------------------------------


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "tok": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "lm": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):
            w = self.t[name]
            w.copy_(
                (torch.randn(w.shape, generator=gen) * (1.5 / math.sqrt(w.shape[0]))).to(w.device)
            )


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def split_kernel(
    q: Tensor,
    kc: Tensor,
    vc: Tensor,
    tables: Tensor,
    positions: Tensor,
    num_splits: Tensor,
    ws_out: Tensor,
    ws_lse: Tensor,
) -> None:
    """Per (token, split): partial attention over the split's positions <= the token's position.
    Writes ws_out[t, s] / ws_lse[t, s] only for s < num_splits[t] (an exited CTA writes nothing)."""
    T = q.shape[0]
    offs = torch.arange(SPEC.block_size, device=q.device)
    ctx = (tables[:, :, None] * SPEC.block_size + offs).reshape(T, CONTEXT)
    keys = kc[ctx].view(T, MAX_SPLITS, SPLIT, HEADS, HEAD_DIM)
    vals = vc[ctx].view(T, MAX_SPLITS, SPLIT, HEADS, HEAD_DIM)
    idx = torch.arange(CONTEXT, device=q.device).view(1, MAX_SPLITS, SPLIT)
    visible = idx <= positions.view(T, 1, 1)  # [T, S, C]
    scores = torch.einsum("thd,tschd->tshc", q.view(T, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    m = scores.amax(-1, keepdim=True)  # [T, S, H, 1]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros((), device=q.device))
    p = torch.exp(scores - m_safe)  # masked -> 0
    denom = p.sum(-1, keepdim=True)
    vals = torch.where(visible[:, :, :, None, None], vals, torch.zeros((), device=q.device))
    part = torch.einsum("tshc,tschd->tshd", p, vals) / torch.where(
        denom > 0, denom, torch.ones((), device=q.device)
    )
    lse = (m_safe + torch.log(denom)).squeeze(-1)  # [T, S, H], -inf for an empty split
    run = torch.arange(MAX_SPLITS, device=q.device)[None, :] < num_splits[:, None]  # [T, S]
    ws_out.copy_(torch.where(run[:, :, None, None], part, ws_out))
    ws_lse.copy_(torch.where(run[:, :, None], lse, ws_lse))


def combine_kernel(ws_out: Tensor, ws_lse: Tensor, num_splits: Tensor, mask_splits: bool) -> Tensor:
    """LSE-weighted merge of the splits of each row -> [T, HEADS * HEAD_DIM]."""
    out, lse = ws_out, ws_lse
    if mask_splits:  # correct: splits this row does not have are -inf / 0, whatever is stored
        valid = torch.arange(MAX_SPLITS, device=lse.device)[None, :] < num_splits[:, None]
        lse = torch.where(valid[:, :, None], lse, torch.full((), float("-inf"), device=lse.device))
        out = torch.where(valid[:, :, None, None], out, torch.zeros((), device=out.device))
    # (buggy: relies on unused slots still holding the -inf written at allocation)
    top = lse.amax(1, keepdim=True)  # split 0 is always valid: finite
    w = torch.exp(lse - top)  # [T, S, H]
    merged = (w[..., None] * out).sum(1) / w.sum(1)[..., None]
    return merged.reshape(out.shape[0], HEADS * HEAD_DIM)


def forward(
    w: dict[str, Tensor],
    kv: tuple[Tensor, Tensor],
    inp: dict[str, Tensor],
    ws: tuple[Tensor, Tensor],
    mask_splits: bool,
) -> tuple[Tensor, Tensor]:
    kc, vc = kv
    x = w["tok"][inp["tokens"]] + w["pos"][inp["positions"]]
    h = _norm(x)
    q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
    kc.index_copy_(0, inp["slots"], k.view(-1, HEADS, HEAD_DIM))
    vc.index_copy_(0, inp["slots"], v.view(-1, HEADS, HEAD_DIM))
    split_kernel(q, kc, vc, inp["tables"], inp["positions"], inp["num_splits"], *ws)
    x = x + combine_kernel(*ws, inp["num_splits"], mask_splits) @ w["wo"]
    x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
    last = inp.get("last")
    if last is not None:
        x = x[last]
    logits = _norm(x) @ w["lm"]
    return logits, _sample(logits, inp)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 15) ^ x) * 0x2C1B3C6D) & M32
    x = (((x >> 12) ^ x) * 0x297A2D39) & M32
    return (x >> 15) ^ x


def _sample(logits: Tensor, inp: dict[str, Tensor]) -> Tensor:
    pos = inp["positions"] if inp.get("last") is None else inp["positions"][inp["last"]]
    key = _hash(_hash(inp["seeds"]) ^ ((pos * 0x632BE5AB) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x1B873593) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25  # in (0, 1)
    noisy = logits / inp["temperatures"][:, None] - torch.log(-torch.log(u))
    return torch.where(inp["sampled"], noisy.argmax(-1), logits.argmax(-1))


# -- host-side batch translation -------------------------------------------------------------------


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _samp(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


def _rows(batch: Batch, decode_only: bool) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {
        k: [] for k in ("tokens", "positions", "slots", "tables", "num_splits", "last")
    }
    for r in batch.requests:
        toks = r.tokens[:1] if decode_only else r.tokens
        for i, tok in enumerate(toks):
            pos = r.context_len + i
            cols["tokens"].append(tok)
            cols["positions"].append(pos)
            cols["slots"].append(_slot(r, pos))
            cols["tables"].append(_table(r))
            cols["num_splits"].append(pos // SPLIT + 1)
        cols["last"].append(len(cols["tokens"]) - 1)
    s = [_samp(r) for r in batch.requests]
    cols["seeds"], cols["temperatures"], cols["sampled"] = (
        [x[0] for x in s],
        [x[1] for x in s],
        [x[2] for x in s],
    )
    return cols


PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "num_splits": 1,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}
DTYPES = {"temperatures": torch.float32, "sampled": torch.bool}


# -- the target ------------------------------------------------------------------------------------


class SplitKVRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, mask_splits: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec, self.mode, self.mask_splits = SPEC, mode, mask_splits
        self.be: Any = get_backend(backend)
        dev = self.dev = self.be.device
        with torch.inference_mode():
            self.w = Weights(seed, dev)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.kv = (torch.zeros(shape, device=dev), torch.zeros(shape, device=dev))
            self.graphs: dict[int, Any] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            self.ws: tuple[Tensor, Tensor] | None = None
            if mode == "graph":
                rows = SPEC.capture_sizes[-1]
                self.buffers = {
                    name: torch.full(
                        (rows, SPEC.max_blocks_per_req) if name == "tables" else (rows,),
                        PAD[name],
                        dtype=DTYPES.get(name, torch.int64),
                        device=dev,
                    )
                    for name in PAD
                }
                # the persistent split workspace, allocated once; LSE -inf written only here
                self.ws = (
                    torch.zeros(rows, MAX_SPLITS, HEADS, HEAD_DIM, device=dev),
                    torch.full((rows, MAX_SPLITS, HEADS), float("-inf"), device=dev),
                )
                self.capture()

    def _static(self, size: int) -> tuple[dict[str, Tensor], tuple[Tensor, Tensor]]:
        assert self.ws is not None
        return (
            {k: b[:size] for k, b in self.buffers.items()},
            (self.ws[0][:size], self.ws[1][:size]),
        )

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inp, ws = self._static(size)
            forward(self.w.t, self.kv, inp, ws, self.mask_splits)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[size] = forward(self.w.t, self.kv, inp, ws, self.mask_splits)
            self.graphs[size] = g

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        cols = _rows(batch, decode_only=True) if n else {}
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(cols[name], dtype=buf.dtype).view(buf[:n].shape))
            buf[n:size].fill_(PAD[name])

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
            reason = self.fallback_reason(batch)
            if reason is None:
                size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
                self.prepare(batch, size)
                self.graphs[size].replay()
                logits, toks = self.outputs[size]
                n = batch.num_reqs
                return StepResult(logits[:n].clone(), toks[:n].clone(), "full", ("decode", size))
            if batch.num_reqs == 0:
                return StepResult(
                    torch.zeros(0, SPEC.vocab_size, device=self.dev),
                    torch.zeros(0, dtype=torch.int64, device=self.dev),
                    "eager",
                    None,
                    reason,
                )
            cols = _rows(batch, decode_only=False)
            inp = {
                k: torch.tensor(v, dtype=DTYPES.get(k, torch.int64), device=self.dev)
                for k, v in cols.items()
            }
            T = inp["tokens"].shape[0]
            # eager: a fresh workspace per call (-inf everywhere), as a non-graph kernel call has
            ws = (
                torch.zeros(T, MAX_SPLITS, HEADS, HEAD_DIM, device=self.dev),
                torch.full((T, MAX_SPLITS, HEADS), float("-inf"), device=self.dev),
            )
            logits, toks = forward(self.w.t, self.kv, inp, ws, self.mask_splits)
            return StepResult(logits, toks, "eager", None, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.kv[0], "v0": self.kv[1]}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode == "eager":
            return {}
        return dict(self.buffers)

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.w.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SplitKVRunner:
    return SplitKVRunner(mode, seed=seed, backend=backend, mask_splits=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SplitKVRunner:
    return SplitKVRunner(mode, seed=seed, backend=backend, mask_splits=False)
