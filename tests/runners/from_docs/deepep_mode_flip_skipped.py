"""A MoE decode runner on one expert-parallel communication buffer shared by two dispatch modes.

The engine mechanism (SGLang's DeepEP MoE with `--deepep-mode auto`): one DeepEP buffer serves
two all-to-all implementations. "Normal" dispatch (prefill and mixed batches, run eagerly) uses
the buffer's memory as plain staging for the tokens it sends. "Low-latency" dispatch (decode
batches, captured in CUDA graphs) keeps per-expert signal words at the start of that same memory:
the sender adds `-(count + 1)` to the receiver's word, the receiver decodes the count it was
sent as `-word - 1`, and that count becomes the masked grouped GEMM's number of rows for the
expert. The scheme assumes the words are zero before a call. Low-latency calls keep two
signal areas and each one zeroes the other (dispatch uses area 0 and clears area 1, combine the
reverse), so back-to-back low-latency calls stay clean, two calls a forward keeping the parity
the graphs were captured with. A normal-mode step writes its staged rows over both areas, so
the host switches modes through `set_dispatch_mode`: going from normal to low-latency first runs
`clean_low_latency_buffer` (here: zero both signal areas). SGLang resolves the mode from the
batch's forward mode inside the Python forward, before each dispatch.

Here, on one rank: the model is one decoder layer (paged-KV attention, then a top-2 of 4 expert
MoE, routed in float32). Rank-local "dispatch" is the per-expert receive buffer with its signal
words; "combine" gathers each token's expert rows back, weighted. Padding rows of a graph are
masked out of the routing (SGLang's `num_token_non_padded` masking), so they dispatch nothing.

The bug (`flip_on_replay=False`): sgl-project/sglang PR #11666 ("Manually flip deepep_mode for
cuda_graph", https://github.com/sgl-project/sglang/pull/11666). A decode step that replays a
CUDA graph never runs the Python forward, so the mode switch that lives there never happens: the
dispatcher still believes it is in normal mode and the cleanup is skipped. The first replay
after an eager prefill or mixed step then adds its counts onto signal words that still hold the
prefill's staged activations: an expert whose stale word is positive receives fewer rows than
were sent, and its last tokens get no expert output; a negative one runs rows nobody sent. The
replay's own combine clears the area again, so the next replay is right. In SGLang this showed
as illegal memory accesses in DeepEP or the following DeepGEMM kernel (a garbage count sizes
the GEMM); here the counts stay in range and the damage is silent: wrong logits, for some
experts, in the first decode step after a prefill. The fix records each graph's dispatch mode
at capture and sets it (cleaning when it flips from normal) on the host before every replay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=10,  # above the largest graph: 9 or 10 decodes run low-latency, eagerly
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 32
NUM_EXPERTS, TOP_K = 4, 2
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
TABLE_SLOTS = MAX_POS  # one block table row covers every position a request may reach
# Each expert receives at most one row per token: the receive buffer's capacity, plus one trash
# row where masked (padding) pairs are sent.
RECV_CAP = SPEC.max_num_tokens
# The shared communication buffer: normal mode stages every (token, expert) row from its start;
# low-latency mode keeps its two signal areas (NUM_EXPERTS words each) in the same first words.
COMM_WORDS = max(2 * NUM_EXPERTS, SPEC.max_num_tokens * TOP_K * HIDDEN)
NORMAL, LOW_LATENCY = "normal", "low_latency"
_M32 = 0xFFFFFFFF


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_POS, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "router": (HIDDEN, NUM_EXPERTS),
            "w_in": (NUM_EXPERTS, HIDDEN, FFN),
            "w_out": (NUM_EXPERTS, FFN, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # copied in place: the captured graphs read these tensors
            w = self.t[name]
            fan_in = w.shape[-2] if w.dim() == 3 else w.shape[0]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(fan_in)).to(w.device))


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def sample(logits: Tensor, reqs: Sequence[Request]) -> Tensor:
    """Gumbel-max from a hash of (seed, position, token id): the same in any batch or padding."""
    dev = logits.device
    seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], dtype=torch.int64, device=dev)
    pos = torch.tensor([r.seq_len - 1 for r in reqs], dtype=torch.int64, device=dev)
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    sampled = torch.tensor([r.seed is not None for r in reqs], dtype=torch.bool, device=dev)
    ids = torch.arange(logits.shape[-1], dtype=torch.int64, device=dev)
    key = _hash(_hash(seeds) ^ (pos * 0x61C88647 & _M32))
    bits = _hash(key[:, None] ^ (ids[None, :] * 0x7FEB352D & _M32))
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class DeepEPAutoModeRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, flip_on_replay: bool = True):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.flip_on_replay = SPEC, mode, flip_on_replay
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        # DeepEP's buffer and the low-latency receive buffer: kernel scratch, not graph inputs
        self.comm = torch.zeros(COMM_WORDS, device=dev)
        self.recv = torch.zeros(NUM_EXPERTS, RECV_CAP + 1, HIDDEN, device=dev)
        self.dispatch_mode: str | None = None  # DeepEPBuffer._dispatch_mode, host state
        self.graphs: dict[int, Any] = {}
        self.graph_logits: dict[int, Tensor] = {}
        self.graph_dispatch_mode: dict[int, str] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            n = max(SPEC.capture_sizes)
            self.buffers = {
                "tokens": torch.zeros(n, dtype=torch.int64, device=dev),
                "positions": torch.zeros(n, dtype=torch.int64, device=dev),
                "slots": torch.zeros(n, dtype=torch.int64, device=dev),
                "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=torch.int64, device=dev),
                "valid": torch.zeros(n, dtype=torch.bool, device=dev),  # num_token_non_padded
            }
            self.capture()

    # -- DeepEP buffer modes ------------------------------------------------------------------

    def set_dispatch_mode(self, mode: str) -> None:
        if mode == LOW_LATENCY and self.dispatch_mode == NORMAL:
            self.comm[: 2 * NUM_EXPERTS].zero_()  # clean_low_latency_buffer
        self.dispatch_mode = mode

    @staticmethod
    def resolve_mode(batch: Batch) -> str:
        """auto: low-latency for pure decode batches, normal for anything that extends."""
        decode = all(r.context_len > 0 and len(r.tokens) == 1 for r in batch.requests)
        return LOW_LATENCY if decode else NORMAL

    # -- the model ----------------------------------------------------------------------------

    def forward(self, tokens, positions, slots, tables, valid, moe_mode: str) -> Tensor:
        w = self.w.t
        x = w["embed"][tokens] + w["pos"][positions]
        h = _rms(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        k = (h @ w["wk"]).view(-1, HEADS, HEAD_DIM)
        v = (h @ w["wv"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, k)  # store before reading: this step's own keys
        self.v_cache.index_copy_(0, slots, v)
        offsets = torch.arange(SPEC.block_size, device=tables.device)
        table_slots = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, S]
        seen = torch.arange(TABLE_SLOTS, device=tables.device)[None, :] <= positions[:, None]
        keys, vals = self.k_cache[table_slots], self.v_cache[table_slots]  # [T, S, H, D]
        zero = torch.zeros((), device=x.device)
        keys = torch.where(seen[:, :, None, None], keys, zero)  # unseen slots may hold NaN
        vals = torch.where(seen[:, :, None, None], vals, zero)
        scores = torch.einsum("thd,tshd->ths", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(seen[:, None, :], scores, torch.full((), -math.inf, device=x.device))
        attn = torch.einsum("ths,tshd->thd", scores.softmax(-1), vals).flatten(1)
        x = x + attn @ w["wo"]
        h = _rms(x)
        top_logits, top_ids = (h @ w["router"]).topk(TOP_K, dim=-1)  # float32 routing
        top_w = top_logits.softmax(-1)
        if moe_mode == LOW_LATENCY:
            x = x + self.moe_low_latency(h, top_ids, top_w, valid)
        else:
            x = x + self.moe_normal(h, top_ids, top_w)
        return _rms(x) @ w["lm_head"]

    def experts(self, rows: Tensor, expert: Tensor | int) -> Tensor:
        w = self.w.t
        return torch.nn.functional.silu(rows @ w["w_in"][expert]) @ w["w_out"][expert]

    def moe_low_latency(self, h: Tensor, ids: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
        """Device-only dispatch, masked grouped GEMM and combine: capturable."""
        dev, T, E = h.device, h.shape[0], NUM_EXPERTS
        pair_valid = valid[:, None].expand(T, TOP_K).reshape(-1)
        pair_expert = ids.reshape(-1)
        pair_token = torch.arange(T, device=dev).repeat_interleave(TOP_K)
        sent = ((pair_expert[:, None] == torch.arange(E, device=dev)) & pair_valid[:, None]).long()
        rank = ((sent.cumsum(0) - sent) * sent).sum(1)  # row within its expert's receive area
        # dispatch: signal area 0 receives -(count + 1) per expert; area 1 is cleared for combine
        signal = self.comm[:E]
        signal.sub_(sent.sum(0).to(signal.dtype) + 1)
        received = -signal - 1  # the count each expert believes it was sent
        self.comm[E : 2 * E].zero_()
        dest_expert = torch.where(pair_valid, pair_expert, torch.zeros_like(pair_expert))
        dest_row = torch.where(pair_valid, rank, torch.full_like(rank, RECV_CAP))  # trash row
        self.recv[dest_expert, dest_row] = h[pair_token]
        # masked grouped GEMM: each expert runs the rows its received count says
        rows = torch.arange(RECV_CAP + 1, device=dev, dtype=signal.dtype)
        live = rows[None, :] < received.clamp(0, RECV_CAP)[:, None]
        out = torch.bmm(
            torch.nn.functional.silu(torch.bmm(self.recv, self.w.t["w_in"])), self.w.t["w_out"]
        )
        out = torch.where(live[:, :, None], out, torch.zeros((), device=dev))
        # combine: each token gathers its rows back; its completion flag goes to area 1 and
        # area 0 is cleared for the next dispatch
        picked = out[dest_expert, dest_row] * weights.reshape(-1)[:, None]
        picked = torch.where(pair_valid[:, None], picked, torch.zeros((), device=dev))
        self.comm[E : 2 * E].add_(1.0)
        self.comm[:E].zero_()
        return picked.view(T, TOP_K, HIDDEN).sum(1)

    def moe_normal(self, h: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """Eager dispatch that stages its rows, sorted by expert, from the buffer's start."""
        T = h.shape[0]
        pair_expert = ids.reshape(-1)
        order = torch.argsort(pair_expert, stable=True)
        pair_token = torch.arange(T, device=h.device).repeat_interleave(TOP_K)[order]
        pair_weight = weights.reshape(-1)[order]
        staged = self.comm[: T * TOP_K * HIDDEN].view(T * TOP_K, HIDDEN)
        staged.copy_(h[pair_token])  # overwrites the low-latency signal words too
        counts = torch.bincount(pair_expert, minlength=NUM_EXPERTS).tolist()  # eager: host read
        out_rows = torch.empty_like(staged)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = staged[start : start + count]
                out_rows[start : start + count] = self.experts(rows, expert)
            start += count
        out = torch.zeros(T, HIDDEN, device=h.device)
        return out.index_add_(0, pair_token, out_rows * pair_weight[:, None])

    # -- graphs -------------------------------------------------------------------------------

    def prepare(self, batch: Batch, size: int) -> None:
        """Write the batch into the static buffers' prefix and reset every padding row."""
        buf, n = self.buffers, batch.num_reqs
        reqs = batch.requests
        table = [
            list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for r in reqs
        ]
        rows = {
            "tokens": [r.tokens[0] for r in reqs] + [0] * (size - n),
            "positions": [r.context_len for r in reqs] + [0] * (size - n),
            "slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs]
            + [SPEC.null_block * SPEC.block_size] * (size - n),
            "tables": table + [[SPEC.null_block] * SPEC.max_blocks_per_req] * (size - n),
            "valid": [True] * n + [False] * (size - n),
        }
        for name, values in rows.items():
            t = buf[name]
            t[:size].copy_(torch.tensor(values, dtype=t.dtype).to(self.device))

    def graph_inputs(self, size: int) -> tuple[Tensor, ...]:
        b = self.buffers
        return tuple(b[k][:size] for k in ("tokens", "positions", "slots", "tables", "valid"))

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.set_dispatch_mode(LOW_LATENCY)  # the Python forward resolves it for decode
            self.prepare(Batch(()), size)
            self.forward(*self.graph_inputs(size), LOW_LATENCY)  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.graph_logits[size] = self.forward(*self.graph_inputs(size), LOW_LATENCY)
            self.graphs[size] = graph
            self.graph_dispatch_mode[size] = LOW_LATENCY

    # -- steps --------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        moe_mode = self.resolve_mode(batch)
        size = next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)
        if self.mode == "graph" and moe_mode == LOW_LATENCY and size is not None:
            return self.replay(batch, size)
        if self.mode == "eager":
            reason = "eager twin"
        elif moe_mode == NORMAL:
            reason = "extend batch: DeepEP normal mode is not graphed"
        else:
            reason = "more decode requests than the largest graph"
        return self.run_eager(batch, moe_mode, reason)

    def replay(self, batch: Batch, size: int) -> StepResult:
        if self.flip_on_replay:  # PR #11666: restore the mode the graph was captured in
            self.set_dispatch_mode(self.graph_dispatch_mode[size])
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits = self.graph_logits[size][: batch.num_reqs].clone()
        return StepResult(logits, sample(logits, batch.requests), "full", ("decode", size))

    def run_eager(self, batch: Batch, moe_mode: str, reason: str) -> StepResult:
        self.set_dispatch_mode(moe_mode)  # the Python forward runs, so the flip happens
        reqs, dev = batch.requests, self.device
        positions = [r.context_len + i for r in reqs for i in range(len(r.tokens))]
        tables = []
        for r in reqs:
            row = list(r.block_ids) + [SPEC.null_block] * (
                SPEC.max_blocks_per_req - len(r.block_ids)
            )
            tables += [row] * len(r.tokens)
        slots = [
            kv_slot(r.block_ids, p, SPEC.block_size)
            for r in reqs
            for p in range(r.context_len, r.seq_len)
        ]
        last = torch.tensor(batch_last_rows(reqs), dtype=torch.int64, device=dev)
        logits = self.forward(
            torch.tensor([t for r in reqs for t in r.tokens], dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            torch.tensor(slots, dtype=torch.int64, device=dev),
            torch.tensor(tables, dtype=torch.int64, device=dev),
            torch.ones(len(positions), dtype=torch.bool, device=dev),
            moe_mode,
        )[last]
        return StepResult(logits, sample(logits, reqs), "eager", None, reason)

    # -- contract -----------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_logits.clear()


def batch_last_rows(reqs: Sequence[Request]) -> list[int]:
    """Row of each request's last query token in the flattened token order."""
    rows, n = [], 0
    for r in reqs:
        n += len(r.tokens)
        rows.append(n - 1)
    return rows


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return DeepEPAutoModeRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return DeepEPAutoModeRunner(mode, seed=seed, backend=backend, flip_on_replay=False)
