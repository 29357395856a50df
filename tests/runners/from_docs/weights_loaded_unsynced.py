"""A plain torch.cuda decode-graph runner whose update_weights loads new weights
asynchronously (pinned staging, non_blocking copies on a dedicated weight-loading stream), as
RL-serving engines' weight-sync code does.

make_target: the loading stream waits for earlier compute, the staging buffer is reused only after
its copies ran, and the compute stream waits for the load before the next step reads the weights.
make_buggy_target: the same code with those waits left out (ORDERED=False).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
SHAPES = {
    "embed": (SPEC.vocab_size, HIDDEN),
    "pos": (CONTEXT, HIDDEN),
    "wq": (HIDDEN, HIDDEN),
    "wk": (HIDDEN, HIDDEN),
    "wv": (HIDDEN, HIDDEN),
    "wo": (HIDDEN, HIDDEN),
    "up": (HIDDEN, 2 * HIDDEN),
    "down": (2 * HIDDEN, HIDDEN),
    "lm_head": (HIDDEN, SPEC.vocab_size),
}


def host_weights(seed: int) -> dict[str, Tensor]:
    """The weights of `seed`, made on the host in a fixed order: same seed, same values."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(SHAPES[name], generator=gen) / math.sqrt(SHAPES[name][0])
        for name in sorted(SHAPES)
    }


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _slot(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


class Runner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, ordered: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.ordered = ordered
        dev = torch.device("cuda")
        self.device = dev
        # Start-up load: synchronous, like an engine's initial checkpoint load.
        self.weights = {n: w.to(dev) for n, w in host_weights(seed).items()}
        # Weight sync path: one pinned staging buffer, a dedicated loading stream, an event.
        total = sum(math.prod(s) for s in SHAPES.values())
        self.weight_staging = torch.empty(total, dtype=torch.float32, pin_memory=True)
        self.staging_views: dict[str, Tensor] = {}
        off = 0
        for name in sorted(SHAPES):
            n = math.prod(SHAPES[name])
            self.staging_views[name] = self.weight_staging[off : off + n].view(SHAPES[name])
            off += n
        self.load_stream = torch.cuda.Stream()
        self.loaded = torch.cuda.Event()
        slots = SPEC.num_blocks * SPEC.block_size
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            i64 = torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.zeros(rows, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
            }
            self._capture()

    # -- model ------------------------------------------------------------------------------------

    def _forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, tables: Tensor) -> Tensor:
        w = self.weights
        x = w["embed"][tokens] + w["pos"][positions]
        h = _rms(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=self.device)
        ctx = (tables[:, :, None] * SPEC.block_size + offs).flatten(1)  # [T, CONTEXT]
        keys, vals = self.k_cache[ctx], self.v_cache[ctx]
        visible = torch.arange(CONTEXT, device=self.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = scores / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=self.device))
        att = torch.einsum("thc,tchd->thd", probs, vals).flatten(1)
        x = x + att @ w["wo"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        return _rms(x) @ w["lm_head"]

    # -- graphs -----------------------------------------------------------------------------------

    def _run_static(self, size: int) -> tuple[Tensor, Tensor]:
        b = self.buffers
        logits = self._forward(
            b["tokens"][:size], b["positions"][:size], b["slots"][:size], b["tables"][:size]
        )
        return logits, logits.argmax(-1)

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._prepare([], size)
            self._run_static(size)  # warm-up
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[size] = self._run_static(size)
            self.graphs[size] = g

    def _prepare(self, reqs: Sequence[Request], size: int) -> None:
        n = len(reqs)
        rows = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
        }
        pad = {"tokens": 0, "positions": 0, "slots": NULL_SLOT, "tables": SPEC.null_block}
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[n:size].fill_(pad[name])

    def _fallback(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "query length > 1"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self._fallback(batch)
        if reason is None:
            n = batch.num_reqs
            size = next(s for s in SPEC.capture_sizes if s >= n)
            self._prepare(batch.requests, size)
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
        tokens, positions, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                tokens.append(t)
                positions.append(r.context_len + i)
                slots.append(_slot(r, r.context_len + i))
                tables.append(_table(r))
            last.append(len(tokens) - 1)

        def dev(v: list) -> Tensor:
            return torch.tensor(v, dtype=torch.int64, device=self.device)

        logits = self._forward(
            dev(tokens), dev(positions), dev(slots), dev(tables).view(-1, SPEC.max_blocks_per_req)
        )[dev(last)]
        return StepResult(logits, logits.argmax(-1), "eager", None, reason=reason)

    # -- weight sync --------------------------------------------------------------------------------

    def update_weights(self, seed: int) -> None:
        """Make the new weights on the host, stage them in pinned memory and upload them in place
        on the loading stream, overlapping whatever else runs."""
        fresh = host_weights(seed)
        if self.ordered:
            self.loaded.synchronize()  # the last load's copies have read the staging buffer
        for name, view in self.staging_views.items():
            view.copy_(fresh[name])
        if self.ordered:
            self.load_stream.wait_stream(torch.cuda.current_stream())  # steps done with old ones
        with torch.cuda.stream(self.load_stream):
            for name in sorted(SHAPES):
                self.weights[name].copy_(self.staging_views[name], non_blocking=True)
            if self.ordered:
                self.loaded.record()
        if self.ordered:
            torch.cuda.current_stream().wait_event(self.loaded)  # next step reads loaded weights

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, ordered=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, ordered=False)
