"""vLLM V1 FULL_AND_PIECEWISE CUDA graph dispatch on a hybrid (attention + recurrent) model.

Every step gets a `BatchDescriptor(num_tokens, uniform_decode)` padded to a capture size in
tokens. FULL graphs (attention and recurrent mixer captured) exist only for uniform-decode batches,
every request with `uniform_decode_query_len = 1 + num_speculative_tokens` query tokens; the rest
replay PIECEWISE graphs with attention and the recurrent scan run eagerly between the pieces on
fresh varlen metadata. Builders declare a `cudagraph_support` level that limits the FULL keys. The
recurrent builder is shaped like vLLM's GDN builder: a request without initial state
(`context_len == 0`) is a prefill, and its persistent FULL-graph buffers (the slot each request's
state is read from) are refreshed only for batches without prefills.

Bug (`make_buggy_target`): uniform decode judged by shape alone (`max_query_len == 1 + k` and
`num_tokens == num_reqs * max_query_len`), so a fresh prompt of exactly 1 + k tokens (here 2)
replays the FULL graph; the recurrent builder sees a prefill and skips its refresh, and the replay
seeds the prompt's recurrence from a stale (or capture-time null) slot instead of zeros. Reports:
vllm-project/vllm#53051 (https://github.com/vllm-project/vllm/issues/53051) and #49918. Fixes:
vllm-project/vllm#51865 (merged: every request must also be past its prompt), #53059, #50532
(https://github.com/vllm-project/vllm/pull/50532, model runner V2), and vllm-project/vllm-ascend#6835
(https://github.com/vllm-project/vllm-ascend/pull/6835: all requests num_computed_tokens > 0).
The correct runner also asks that every request continue a cached sequence (`context_len > 0`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

NUM_SPECULATIVE_TOKENS = 1
UNIFORM_LEN = 1 + NUM_SPECULATIVE_TOKENS  # uniform_decode_query_len
SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8, 16),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HID, HEADS, HEAD_DIM = 32, 2, 16
MAX_BLOCKS = SPEC.max_blocks_per_req
CONTEXT = MAX_BLOCKS * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
LOW32 = 0xFFFFFFFF


class CGSupport(enum.IntEnum):
    """How much of a step a metadata builder can serve from inside a FULL graph."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    uniform_decode: bool


class Dispatcher:
    """FULL keys for uniform-decode descriptors, PIECEWISE keys for every capture size."""

    def __init__(self, support: CGSupport) -> None:
        full = support >= CGSupport.UNIFORM_BATCH or (
            support == CGSupport.UNIFORM_SINGLE_TOKEN_DECODE and UNIFORM_LEN == 1
        )
        self.full = {
            BatchDescriptor(s, True)
            for s in SPEC.capture_sizes
            if full and s % UNIFORM_LEN == 0 and s // UNIFORM_LEN <= SPEC.max_num_reqs
        }

    def dispatch(self, num_tokens: int, uniform: bool) -> tuple[str, BatchDescriptor | None]:
        padded = next((s for s in SPEC.capture_sizes if s >= num_tokens), None)
        if padded is None or num_tokens == 0:
            return "eager", None
        if uniform and BatchDescriptor(padded, True) in self.full:
            return "full", BatchDescriptor(padded, True)
        return "piecewise", BatchDescriptor(padded, False)


def is_uniform_decode(batch: Batch, *, shape_only: bool) -> bool:
    lens = [len(r.tokens) for r in batch.requests]
    if not lens or max(lens) != UNIFORM_LEN or sum(lens) != UNIFORM_LEN * len(lens):
        return False
    return shape_only or all(r.context_len > 0 for r in batch.requests)


def _slot(request: Request, position: int) -> int:
    block = request.block_ids[position // SPEC.block_size]
    return block * SPEC.block_size + position % SPEC.block_size


def _table(request: Request) -> list[int]:
    return list(request.block_ids) + [SPEC.null_block] * (MAX_BLOCKS - len(request.block_ids))


@dataclass
class CommonMeta:
    """Varlen metadata of the valid tokens, built fresh every step (host values known)."""

    tok_req: Tensor  # [T] request of each token
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, MAX_BLOCKS]
    context: Tensor  # [R] context_len
    init_slot: Tensor  # [R] slot of position context_len - 1 (null when none)
    has_init: Tensor  # [R] bool


def common_meta(batch: Batch, device: torch.device) -> CommonMeta:
    tok_req, positions, slots, tables = [], [], [], []
    for i, r in enumerate(batch.requests):
        for j in range(len(r.tokens)):
            tok_req.append(i)
            positions.append(r.context_len + j)
            slots.append(_slot(r, r.context_len + j))
            tables.append(_table(r))
    ctx = [r.context_len for r in batch.requests]
    init = [_slot(r, r.context_len - 1) if r.context_len else NULL_SLOT for r in batch.requests]

    ints = [tok_req, positions, slots, tables, ctx, init]
    made = [torch.tensor(values, dtype=torch.int64, device=device) for values in ints]
    made[3] = made[3].view(-1, MAX_BLOCKS)
    return CommonMeta(*made, torch.tensor([c > 0 for c in ctx], device=device))


class AttentionBuilder:
    """FlashAttention-like: decodes are rows with query_len <= UNIFORM_LEN; persistent buffers."""

    cudagraph_support = CGSupport.UNIFORM_BATCH

    def __init__(self, device: torch.device) -> None:
        self.seq_lens = torch.zeros(SPEC.max_num_reqs, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(
            SPEC.max_num_reqs, MAX_BLOCKS, dtype=torch.int64, device=device
        )

    def build_full(self, batch: Batch, rows: int) -> None:
        n = batch.num_reqs
        if all(len(r.tokens) <= UNIFORM_LEN for r in batch.requests) and n:
            self.seq_lens[:n].copy_(
                torch.tensor([r.context_len + len(r.tokens) for r in batch.requests])
            )
            self.block_table[:n].copy_(torch.tensor([_table(r) for r in batch.requests]))
        self.seq_lens[n:rows].fill_(UNIFORM_LEN)
        self.block_table[n:rows].fill_(SPEC.null_block)


class RecurrentBuilder:
    """GDN-like: a request without initial state is a prefill; persistent buffers only for
    batches without prefills (a prefill batch gets varlen metadata, `CommonMeta`)."""

    cudagraph_support = CGSupport.UNIFORM_BATCH

    def __init__(self, device: torch.device) -> None:
        self.state_src = torch.zeros(SPEC.max_num_reqs, dtype=torch.int64, device=device)

    def build_full(self, batch: Batch, rows: int) -> None:
        n = batch.num_reqs
        if sum(r.context_len == 0 for r in batch.requests):
            return  # prefill metadata only: the persistent buffers stay as they were
        if n:
            src = [_slot(r, r.context_len - 1) for r in batch.requests]
            self.state_src[:n].copy_(torch.tensor(src))
        self.state_src[n:rows].fill_(NULL_SLOT)


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class HybridModel:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (SPEC.vocab_size, HID),
            "pos": (CONTEXT, HID),
            "head": (HID, SPEC.vocab_size),
            "up": (HID, 2 * HID),
            "down": (2 * HID, HID),
            "decay": (HID,),
            **{name: (HID, HID) for name in ("wq", "wk", "wv", "wu", "wo", "wr")},
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            weight = self.w[name]
            weight.copy_(torch.randn(weight.shape, generator=gen) / math.sqrt(weight.shape[0]))

    def pre(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        w = self.w
        x = w["embed"][tokens] + w["pos"][positions]
        h = _rms(x)
        return x, h @ w["wq"], h @ w["wk"], h @ w["wv"], h @ w["wu"]

    def post(self, x: Tensor, attn: Tensor, rec: Tensor) -> Tensor:
        w = self.w
        x = x + attn @ w["wo"] + rec @ w["wr"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        return _rms(x)

    def log_decay(self) -> Tensor:
        return torch.nn.functional.logsigmoid(self.w["decay"] + 2.0)


def attend(q: Tensor, kc: Tensor, vc: Tensor, positions: Tensor, tables: Tensor) -> Tensor:
    offsets = torch.arange(SPEC.block_size, device=q.device)
    ctx = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT]
    keys, values = kc[ctx], vc[ctx]
    seen = torch.arange(CONTEXT, device=q.device)[None, :] <= positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(seen[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & LOW32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & LOW32
    return x ^ (x >> 15)


def sample(logits: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor, pos: Tensor) -> Tensor:
    key = _hash(_hash(seeds) ^ ((pos * 0x61C88647) & LOW32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x7FEB352D) & LOW32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class HybridRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, buggy: bool = False) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec, self.mode, self.buggy = SPEC, mode, buggy
        self.be: Any = get_backend(backend)
        dev = self.dev = self.be.device
        self.model = HybridModel(seed, dev)
        n = SPEC.num_blocks * SPEC.block_size
        self.k = torch.zeros(n, HEADS, HEAD_DIM, device=dev)
        self.v = torch.zeros(n, HEADS, HEAD_DIM, device=dev)
        self.ssm = torch.zeros(n, HID, device=dev)
        self.attn_b, self.rec_b = AttentionBuilder(dev), RecurrentBuilder(dev)
        support = min(b.cudagraph_support for b in (self.attn_b, self.rec_b))
        self.dispatcher = Dispatcher(CGSupport(support))
        self.graphs: dict[Any, Any] = {}
        self.outs: dict[Any, Any] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            t, i64 = SPEC.max_num_tokens, torch.int64
            self.buffers = {
                "input_ids": torch.zeros(t, dtype=i64, device=dev),
                "positions": torch.zeros(t, dtype=i64, device=dev),
                "slot_mapping": torch.zeros(t, dtype=i64, device=dev),
                "attn_out": torch.zeros(t, HID, device=dev),
                "rec_out": torch.zeros(t, HID, device=dev),
                "attn_seq_lens": self.attn_b.seq_lens,
                "attn_block_table": self.attn_b.block_table,
                "rec_state_src": self.rec_b.state_src,
            }
            self.capture()

    # -- kernels ----------------------------------------------------------------------------------

    def mixers_varlen(self, m: CommonMeta, q: Tensor, k: Tensor, v: Tensor, u: Tensor):
        """Attention and the recurrent scan on varlen metadata (run eagerly)."""
        self.k.index_copy_(0, m.slots, k.view(-1, HEADS, HEAD_DIM))
        self.v.index_copy_(0, m.slots, v.view(-1, HEADS, HEAD_DIM))
        attn = attend(q, self.k, self.v, m.positions, m.tables)
        log_a = self.model.log_decay()
        same = m.tok_req[:, None] == m.tok_req[None, :]
        dpos = m.positions[:, None] - m.positions[None, :]
        weight = torch.exp(dpos.clamp(min=0)[:, :, None].to(u.dtype) * log_a)
        weight = torch.where(
            (same & (dpos >= 0))[:, :, None], weight, torch.zeros((), device=u.device)
        )
        rec = torch.einsum("tsd,sd->td", weight, u)
        h0 = torch.where(
            m.has_init[:, None], self.ssm[m.init_slot], torch.zeros((), device=u.device)
        )
        steps = (m.positions - m.context[m.tok_req] + 1).to(u.dtype)
        rec = rec + torch.exp(steps[:, None] * log_a) * h0[m.tok_req]
        self.ssm.index_copy_(0, m.slots, rec)
        return attn, rec

    def forward_full(self, size: int) -> Tensor:
        """Uniform decode: size // UNIFORM_LEN rows of UNIFORM_LEN tokens, persistent metadata."""
        rows, b = size // UNIFORM_LEN, self.buffers
        slots = b["slot_mapping"][:size]
        x, q, k, v, u = self.model.pre(b["input_ids"][:size], b["positions"][:size])
        self.k.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        step = torch.arange(UNIFORM_LEN, device=self.dev)
        pos = (self.attn_b.seq_lens[:rows, None] - UNIFORM_LEN + step).reshape(size)
        tables = self.attn_b.block_table[:rows, None, :].expand(rows, UNIFORM_LEN, MAX_BLOCKS)
        attn = attend(q, self.k, self.v, pos, tables.reshape(size, MAX_BLOCKS))
        a = torch.exp(self.model.log_decay())
        h, hs, u = self.ssm[self.rec_b.state_src[:rows]], [], u.view(rows, UNIFORM_LEN, HID)
        for j in range(UNIFORM_LEN):
            h = a * h + u[:, j]
            hs.append(h)
        rec = torch.stack(hs, 1).reshape(size, HID)
        self.ssm.index_copy_(0, slots, rec)
        return self.model.post(x, attn, rec)

    # -- graph mode -------------------------------------------------------------------------------

    def fill_inputs(self, batch: Batch, meta: CommonMeta | None, size: int) -> None:
        b, n = self.buffers, batch.num_tokens
        if meta is not None and n:
            b["input_ids"][:n].copy_(torch.tensor([t for r in batch.requests for t in r.tokens]))
            b["positions"][:n].copy_(meta.positions)
            b["slot_mapping"][:n].copy_(meta.slots)
        b["input_ids"][n:size].fill_(0)
        b["positions"][n:size].fill_(0)
        b["slot_mapping"][n:size].fill_(NULL_SLOT)

    def _capture(self, key: tuple[str, int], fn: Any, *args: Any) -> None:
        fn(*args)  # warm-up outside the graph
        self.be.synchronize()
        graph = self.graphs[key] = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            self.outs[key] = fn(*args)

    def capture(self) -> None:
        """Largest size first, every graph in one pool; all rows padding while capturing."""
        self.pool, empty, b = self.be.graph_pool_handle(), Batch(()), self.buffers
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.fill_inputs(empty, None, size)
            if BatchDescriptor(size, True) in self.dispatcher.full:
                self.attn_b.build_full(empty, size // UNIFORM_LEN)
                self.rec_b.build_full(empty, size // UNIFORM_LEN)
                self._capture(("full", size), self.forward_full, size)
            self._capture(
                ("pre", size), self.model.pre, b["input_ids"][:size], b["positions"][:size]
            )
            x = self.outs[("pre", size)][0]
            self._capture(
                ("post", size), self.model.post, x, b["attn_out"][:size], b["rec_out"][:size]
            )

    def run_full(self, batch: Batch, meta: CommonMeta, size: int) -> Tensor:
        self.fill_inputs(batch, meta, size)
        self.attn_b.build_full(batch, size // UNIFORM_LEN)
        self.rec_b.build_full(batch, size // UNIFORM_LEN)
        self.graphs[("full", size)].replay()
        return self.outs[("full", size)]

    def run_piecewise(self, batch: Batch, meta: CommonMeta, size: int) -> Tensor:
        n, b = batch.num_tokens, self.buffers
        self.fill_inputs(batch, meta, size)
        self.graphs[("pre", size)].replay()
        _, q, k, v, u = self.outs[("pre", size)]
        attn, rec = self.mixers_varlen(meta, q[:n], k[:n], v[:n], u[:n])
        for name, out in (("attn_out", attn), ("rec_out", rec)):
            b[name][:n].copy_(out)
            b[name][n:size].zero_()
        self.graphs[("post", size)].replay()
        return self.outs[("post", size)]

    def run_eager(self, batch: Batch, meta: CommonMeta) -> Tensor:
        tokens = torch.tensor([t for r in batch.requests for t in r.tokens], device=self.dev)
        x, q, k, v, u = self.model.pre(tokens, meta.positions)
        attn, rec = self.mixers_varlen(meta, q, k, v, u)
        return self.model.post(x, attn, rec)

    # -- contract ---------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        dev = self.dev
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=dev)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64, device=dev), "eager", None)
        meta = common_meta(batch, dev)
        uniform = is_uniform_decode(batch, shape_only=self.buggy)
        path, key = self.dispatcher.dispatch(batch.num_tokens, uniform)
        reason = None
        if self.mode == "eager" or key is None:
            path, key = "eager", None
            reason = "eager twin" if self.mode == "eager" else "above the largest capture size"
            hidden = self.run_eager(batch, meta)
        elif path == "full":
            hidden = self.run_full(batch, meta, key.num_tokens)
        else:
            hidden = self.run_piecewise(batch, meta, key.num_tokens)
        lens = [len(r.tokens) for r in batch.requests]
        last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))], device=dev)
        logits = hidden[last] @ self.model.w["head"]
        greedy = [r.seed is None for r in batch.requests]
        rows = [
            ((r.seed or 0) & LOW32, 1.0 if g else r.temperature, r.context_len + len(r.tokens) - 1)
            for r, g in zip(batch.requests, greedy, strict=True)
        ]
        seeds, pos = (torch.tensor([row[i] for row in rows], device=dev) for i in (0, 2))
        temps = torch.tensor([row[1] for row in rows], device=dev)
        sampled = ~torch.tensor(greedy, device=dev)
        tokens = sample(logits, seeds, temps, sampled, pos)
        return StepResult(logits, tokens, path, key, reason)  # type: ignore[arg-type]

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k, "v": self.v, "ssm": self.ssm}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridRunner:
    return HybridRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridRunner:
    return HybridRunner(mode, seed=seed, backend=backend, buggy=True)
