"""A plain-torch.cuda decode-graph runner that replays on its own compute stream.

Graph mode captures one `torch.cuda.CUDAGraph` per capture size (largest first, one shared pool)
at start-up. A decode batch (one query token per request, at most the largest capture size) is
written into the static input buffers on a dedicated compute stream, the graph of the smallest
fitting size is replayed there, and the results are copied out for the caller. Everything else
(prefill, mixed, speculative decode, too many requests, the eager twin) runs eagerly on the
caller's current stream.

`make_buggy_target` hands the static outputs to the caller's stream without making that stream
wait for the compute stream (the bug: results read before the replay wrote them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=128,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
D_MODEL, N_HEADS, D_HEAD, D_FF = 48, 3, 16, 96
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
M32 = (1 << 32) - 1


# -- the model ----------------------------------------------------------------------------------


class Model:
    """One pre-norm attention layer + gated MLP over a slot-major paged KV cache."""

    SHAPES: ClassVar[dict[str, tuple[int, int]]] = {
        "tok": (SPEC.vocab_size, D_MODEL),
        "pos": (MAX_POS, D_MODEL),
        "wq": (D_MODEL, D_MODEL),
        "wk": (D_MODEL, D_MODEL),
        "wv": (D_MODEL, D_MODEL),
        "wo": (D_MODEL, D_MODEL),
        "w_gate": (D_MODEL, D_FF),
        "w_up": (D_MODEL, D_FF),
        "w_down": (D_FF, D_MODEL),
        "lm_head": (D_MODEL, SPEC.vocab_size),
    }

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.w = {k: torch.empty(s, device=device) for k, s in self.SHAPES.items()}
        self.load(seed)
        slots = SPEC.num_blocks * SPEC.block_size
        self.k_cache = torch.zeros(slots, N_HEADS, D_HEAD, device=device)
        self.v_cache = torch.zeros(slots, N_HEADS, D_HEAD, device=device)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):  # fixed order, in place: graphs keep the same tensors
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(self.device))

    @staticmethod
    def _norm(x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5)

    def forward(self, tokens, positions, slots, tables, last=None) -> Tensor:
        """tokens/positions/slots: [T]; tables: [T, max_blocks]; last: [R] or None (T == R)."""
        w = self.w
        x = w["tok"][tokens] + w["pos"][positions]
        h = self._norm(x)
        q = (h @ w["wq"]).view(-1, N_HEADS, D_HEAD)
        k = (h @ w["wk"]).view(-1, N_HEADS, D_HEAD)
        v = (h @ w["wv"]).view(-1, N_HEADS, D_HEAD)
        # store this step's keys/values first, then attend over the cache (causal by position)
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        bs = SPEC.block_size
        ctx = (tables.unsqueeze(-1) * bs + torch.arange(bs, device=x.device)).flatten(1)  # [T, C]
        keys, vals = self.k_cache[ctx], self.v_cache[ctx]  # [T, C, H, D]
        visible = torch.arange(MAX_POS, device=x.device).unsqueeze(0) <= positions.unsqueeze(1)
        scores = torch.einsum("thd,tchd->thc", q, keys) * (1.0 / math.sqrt(D_HEAD))
        scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=x.device))
        att = torch.einsum("thc,tchd->thd", scores.softmax(-1), vals).reshape(-1, D_MODEL)
        x = x + att @ w["wo"]
        h = self._norm(x)
        x = x + (torch.nn.functional.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        if last is not None:
            x = x[last]
        return self._norm(x) @ w["lm_head"]


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix on int64 tensors (values kept in [0, 2**32), products < 2**63)."""
    x = x & M32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def sample(logits: Tensor, seeds: Tensor, positions: Tensor, temps: Tensor, sampled: Tensor):
    """Gumbel-max with noise from hash(seed, position, vocab id); greedy rows take the argmax."""
    base = _hash32(_hash32(seeds) + positions * 0x632BE5AB)  # [R]
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash32(base.unsqueeze(1) ^ (ids * 0x7FEB352D & M32).unsqueeze(0))  # [R, V]
    u = (bits >> 8).to(torch.float32) * (2.0**-24) + 2.0**-25  # in (0, 1)
    gumbel = -torch.log(-torch.log(u))
    noisy = logits / temps.unsqueeze(1) + gumbel
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


# -- host-side row building ---------------------------------------------------------------------


def _slot(req: Request, pos: int) -> int:
    return req.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(req: Request) -> list[int]:
    return list(req.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(req.block_ids))


def _sampling(req: Request) -> tuple[int, float, bool]:
    if req.seed is None:
        return 0, 1.0, False
    return req.seed & M32, float(req.temperature), True


PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": SPEC.null_block * SPEC.block_size,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
}


class Runner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, bug: bool = False) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"bad mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.bug = bug
        self.device = torch.device("cuda")
        self.model = Model(seed, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.bufs: dict[str, Tensor] = {}
        if mode == "graph":
            rows, dev, i64 = SPEC.capture_sizes[-1], self.device, torch.int64
            self.bufs = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.zeros(rows, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(rows, dtype=i64, device=dev),
                "temps": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
            }
            self.compute_stream = torch.cuda.Stream()
            self._capture()

    # -- graphs -------------------------------------------------------------------------------

    def _run_static(self, size: int) -> tuple[Tensor, Tensor]:
        b = {k: v[:size] for k, v in self.bufs.items()}
        logits = self.model.forward(b["tokens"], b["positions"], b["slots"], b["tables"])
        return logits, sample(logits, b["seeds"], b["positions"], b["temps"], b["sampled"])

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._prepare([], size)  # all padding during warm-up and capture
            self._run_static(size)  # warm-up
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[size] = self._run_static(size)
            self.graphs[size] = g
        torch.cuda.synchronize()

    def _prepare(self, reqs: Sequence[Request], size: int) -> None:
        """Write the batch into the static buffers' prefix and reset rows n..size to padding."""
        n = len(reqs)
        samp = [_sampling(r) for r in reqs]
        values = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temps": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        for name, buf in self.bufs.items():
            if n:
                buf[:n].copy_(torch.tensor(values[name], dtype=buf.dtype))
            buf[n:size].fill_(PAD[name])

    def _size_for(self, n: int) -> int | None:
        return next((s for s in SPEC.capture_sizes if s >= n), None)

    def _replay(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        size = self._size_for(n)
        current = torch.cuda.current_stream()
        # the compute stream starts after everything the caller queued (eager KV writes,
        # weight copies, the last step's result copies out of the static outputs)
        self.compute_stream.wait_stream(current)
        with torch.cuda.stream(self.compute_stream):
            self._prepare(batch.requests, size)
            self.graphs[size].replay()
        if not self.bug:
            current.wait_stream(self.compute_stream)  # results ready for the caller's stream
        logits, tokens = self.outputs[size]
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager --------------------------------------------------------------------------------

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        tokens, positions, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                tokens.append(t)
                positions.append(r.context_len + i)
                slots.append(_slot(r, r.context_len + i))
                tables.append(_table(r))
            last.append(len(tokens) - 1)
        samp = [_sampling(r) for r in batch.requests]
        dev = self.device

        def t(v, dtype=torch.int64):
            return torch.tensor(v, dtype=dtype, device=dev)

        pos_t, last_t = t(positions), t(last)
        logits = self.model.forward(
            t(tokens), pos_t, t(slots), t(tables).view(-1, SPEC.max_blocks_per_req), last_t
        )
        nxt = sample(
            logits,
            t([s[0] for s in samp]),
            pos_t[last_t],
            t([s[1] for s in samp], torch.float32),
            t([s[2] for s in samp], torch.bool),
        )
        return StepResult(logits, nxt, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if self._size_for(batch.num_reqs) is None:
            return "batch larger than the largest capture size"
        return None

    # -- contract -----------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self._replay(batch) if reason is None else self._eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.model.k_cache, "v": self.model.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.bufs

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        if self.graphs:
            torch.cuda.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, bug=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, bug=True)
