"""A plain-torch.cuda decode runner whose sampler runs on a second CUDA stream ("sampler stream").

Graph mode captures one `torch.cuda.CUDAGraph` per capture size (largest first, one shared pool)
with `torch.cuda.graph`; decode batches that fit a capture size replay it, everything else runs
eagerly. Inside the forward the logits are computed on the current stream, then the sampler
(exponential-race sampling from a hash of each row's seed and position) runs on `self.side`,
forked from and joined back into the current stream.

`make_target` is correct. `make_buggy_target` forgets the fork (`side.wait_stream(current)`):
during capture the side stream then never joins the capture, so its work would run eagerly,
outside the graph. In practice the capture fails: the side stream's allocation during a global-mode
capture, or (relaxed mode) the join on an event recorded outside the capture, invalidates it, on
the sim and on a real GPU alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """32-bit integer mix on int64 tensors holding values in [0, 2**32); products stay < 2**63."""
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def _seed32(seed: int) -> int:
    return (seed ^ (seed >> 32) ^ (seed >> 61)) & M32


class SideStreamSamplerRunner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, buggy: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.buggy = buggy
        self.device = torch.device("cuda")
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {n: torch.empty(s, device=self.device) for n, s in shapes.items()}
        self.update_weights(seed)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=self.device)
        self.side = torch.cuda.Stream()  # the sampler stream
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            i64 = torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=self.device),
                "positions": torch.zeros(rows, dtype=i64, device=self.device),
                "slots": torch.zeros(rows, dtype=i64, device=self.device),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=self.device),
                "seeds": torch.zeros(rows, dtype=i64, device=self.device),
                "temperatures": torch.ones(rows, device=self.device),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=self.device),
            }
            self._capture()

    # -- model ------------------------------------------------------------------------------------

    def _forward(self, inp: Mapping[str, Tensor], last: Tensor | None) -> tuple[Tensor, Tensor]:
        w = self.weights
        tokens, positions, slots, tables = (
            inp[n] for n in ("tokens", "positions", "slots", "tables")
        )
        x = w["embed"][tokens] + w["pos"][positions]
        h = _rms(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        ctx = (tables[:, :, None] * bs + torch.arange(bs, device=x.device)).flatten(1)
        keys, values = self.k_cache[ctx], self.v_cache[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(
            HEAD_DIM
        )
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", probs, values).flatten(1) @ w["wo"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if last is not None:
            x = x[last]
            positions = positions[last]
        logits = _rms(x) @ w["head"]
        next_tokens = self._sample_on_side_stream(
            logits, positions, inp["seeds"], inp["temperatures"], inp["sampled"]
        )
        return logits, next_tokens

    def _sample_on_side_stream(
        self, logits: Tensor, positions: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor
    ) -> Tensor:
        current = torch.cuda.current_stream()
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if not self.buggy:
            self.side.wait_stream(current)  # fork: the sampler sees the logits
        with torch.cuda.stream(self.side):
            key = _hash32(_hash32(seeds) ^ ((positions * 0x9E3779B1) & M32))
            ids = torch.arange(logits.shape[-1], device=logits.device)
            bits = _hash32(key[:, None] ^ ((ids * 0x7FEB352D) & M32)[None, :])
            uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24  # in (0, 1)
            exp_noise = -torch.log(uniform)  # Exp(1): argmax p / E is a sample of p
            scored = logits / temps[:, None] - torch.log(exp_noise)
            out.copy_(torch.where(sampled, scored.argmax(-1), logits.argmax(-1)))
        current.wait_stream(self.side)  # join: results ready on the current stream
        return out

    # -- graph mode -------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._prepare(Batch(()), size)
            inputs = {n: b[:size] for n, b in self.buffers.items()}
            self._forward(inputs, None)  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(inputs, None)
            self.graphs[size] = graph

    def _prepare(self, batch: Batch, size: int) -> None:
        rows = _rows(batch.requests, decode=True)
        n = batch.num_reqs
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[n:size].fill_(_PADDING[name])

    def _fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode (query length > 1)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self._fallback_reason(batch)
        n = batch.num_reqs
        if reason is None:
            size = next(s for s in SPEC.capture_sizes if s >= n)
            self._prepare(batch, size)
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
        rows = _rows(batch.requests, decode=False)
        last = torch.tensor(rows.pop("last"), dtype=torch.int64, device=self.device)
        inputs = {
            name: torch.tensor(vals, dtype=_DTYPES[name], device=self.device)
            for name, vals in rows.items()
        }
        inputs["tables"] = inputs["tables"].view(-1, SPEC.max_blocks_per_req)
        logits, tokens = self._forward(inputs, last)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            wt = self.weights[name]
            wt.copy_(
                (torch.randn(wt.shape, generator=gen) / math.sqrt(wt.shape[0])).to(self.device)
            )

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


_PADDING: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}
_DTYPES = {
    "tokens": torch.int64,
    "positions": torch.int64,
    "slots": torch.int64,
    "tables": torch.int64,
    "seeds": torch.int64,
    "temperatures": torch.float32,
    "sampled": torch.bool,
}


def _rows(requests: Sequence[Request], *, decode: bool) -> dict[str, list[Any]]:
    """Host values: one row per token (decode: per request), per-request sampling columns."""
    out: dict[str, list[Any]] = {n: [] for n in (*_PADDING, "last")}
    for r in requests:
        table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
        toks = r.tokens[:1] if decode else r.tokens
        for i, t in enumerate(toks):
            pos = r.context_len + i
            out["tokens"].append(t)
            out["positions"].append(pos)
            out["slots"].append(kv_slot(r.block_ids, pos, SPEC.block_size))
            out["tables"].append(table)
        out["last"].append(len(out["tokens"]) - 1)
        out["seeds"].append(0 if r.seed is None else _seed32(r.seed))
        out["temperatures"].append(1.0 if r.seed is None else float(r.temperature))
        out["sampled"].append(r.seed is not None)
    if decode:
        del out["last"]
    return out


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SideStreamSamplerRunner:
    return SideStreamSamplerRunner(mode, seed=seed, buggy=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SideStreamSamplerRunner:
    return SideStreamSamplerRunner(mode, seed=seed, buggy=True)
