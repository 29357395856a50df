"""A paged-KV decode runner whose block manager forks tail blocks copy-on-write.

What the runner is
------------------
A one-layer decoder (token + learned position embedding, attention over a paged KV cache read
through block tables, SiLU MLP, LM head, hash-based Gumbel sampling) with a copy-on-write step in
the style of vLLM's V0 block manager (`blocks_to_copy` -> `cache_engine.copy` -> the `copy_blocks`
kernel, vllm-project/vllm PR #32) and of TensorRT-LLM's partial-block copy on reuse.

The contract gives every block to exactly one request, so the sharing is internal: a request's
tail block that already holds tokens (``context_len % block_size != 0``) counts as published
(shared with the prefix cache) and is immutable while a step runs. Such a row appends into a
*fork*: the block manager hands the step's k-th fork the private block ``num_blocks + k`` (outside
the slot-major state the harness sees), and emits the (src, dst) pair (tail block, fork). A step
then does, on the stream its forward runs on:

  1. fork:    ``pool.index_copy_(0, dst, pool.index_select(0, src))``   (whole blocks)
  2. forward: the forked rows write their new keys/values into the fork and attend through a
              block table whose tail column names the fork;
  3. publish: ``pool.index_copy_(0, src, pool.index_select(0, dst))`` (the fork replaces the
              tail block; every slot but the new one gets back the bits it held).

Rows whose query starts a fresh block write it directly (nothing to share yet). Padding pairs are
``(null_block, null_block)``: copying the null block onto itself is the only write padding may do.

In graph mode one decode graph per capture size is captured (largest first, one pool). The pair
list is staged in a pinned host buffer of max size (``max_num_reqs`` pairs), padded, uploaded with
one ``non_blocking`` copy on the replay stream into a persistent device buffer the graph reads, and
both block copies are captured inside the graph. An event guards the pinned staging buffer against
being rewritten before its last upload ran (pipelined steps). Every other batch (prefill, mixed,
speculative, more rows than the largest graph) runs eagerly with exactly its own pairs.

The bug (``make_buggy_target``)
-------------------------------
The host side rewrites only the first ``m`` entries of the pinned pair buffer (the pairs this step
needs) and never resets the padded tail, so the tail still holds earlier steps' pairs and the
graph, which copies all ``max_num_reqs`` pairs, replays them. A stale pair whose source block is
now written by this step (a request whose fork moved to a lower index once a row before it started
a fresh block, or a freed block handed to a new request) publishes a pre-forward snapshot over the
block after the valid pair has published it: the new token's keys are lost (on a GPU, duplicate
``index_copy_`` destinations land in no defined order, so the loss is intermittent there).

Modelled on: the stale tail of a persistent index buffer that a state/block copy reads in CUDA
graph mode, TensorRT-LLM PR #13278 ("update_mamba_states scatters into the caller-supplied
state_indices ... removing the stale-tail read that corrupted parked live requests",
https://github.com/NVIDIA/TensorRT-LLM/pull/13278) and PR #9873 (mamba cache under CUDA-graph
padding, https://github.com/NVIDIA/TensorRT-LLM/pull/9873); the same padded-tail pattern for block
offsets in https://github.com/NVIDIA/TensorRT-LLM/pull/13124 ("leaves stale padded entries
unsanitized"). The block-copy mechanism itself: vLLM's copy_blocks,
https://github.com/vllm-project/vllm/pull/32.
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
BS = SPEC.block_size
NB = SPEC.num_blocks
CONTEXT = SPEC.max_blocks_per_req * BS
NULL = SPEC.null_block
NULL_SLOT = NULL * BS
MAX_PAIRS = SPEC.max_num_reqs  # at most one fork per request of a step
_MASK32 = 0xFFFFFFFF


# -- host-side block manager ------------------------------------------------------------------


def plan(requests: Sequence[Request]) -> dict[str, Any]:
    """Per-token slots and tables, and the step's (src, dst) fork pairs, in row order."""
    src: list[int] = []
    dst: list[int] = []
    tokens, positions, slots, tables, last = [], [], [], [], []
    for r in requests:
        table = list(r.block_ids) + [NULL] * (SPEC.max_blocks_per_req - len(r.block_ids))
        fork_col = -1
        if r.context_len % BS:  # the tail block holds published tokens: fork it
            fork_col = r.context_len // BS
            src.append(r.block_ids[fork_col])
            dst.append(NB + len(dst))
            table[fork_col] = dst[-1]
        for i, token in enumerate(r.tokens):
            p = r.context_len + i
            tokens.append(token)
            positions.append(p)
            slots.append(table[p // BS] * BS + p % BS)
            tables.append(table)
        last.append(len(tokens) - 1)
    return {
        "tokens": tokens,
        "positions": positions,
        "slots": slots,
        "tables": tables,
        "last": last,
        "src": src,
        "dst": dst,
    }


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & _MASK32, float(r.temperature), True


# -- model --------------------------------------------------------------------------------------


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(self.device))

    def forward(
        self, x: dict[str, Tensor], k_pool: Tensor, v_pool: Tensor, fork: bool = True
    ) -> Tensor:
        """k_pool/v_pool: [NB + MAX_PAIRS, BS, HEADS, HEAD_DIM]. No host reads."""
        src, dst = x["src"], x["dst"]
        if fork:
            fork_blocks(src, dst, k_pool, v_pool)  # 1. fork the shared tail blocks
        w = self.w
        h = w["embed"][x["tokens"]] + w["pos"][x["positions"]]
        n = _rms(h)
        q, k, v = n @ w["q"], n @ w["k"], n @ w["v"]
        k_flat, v_flat = k_pool.view(-1, HEADS, HEAD_DIM), v_pool.view(-1, HEADS, HEAD_DIM)
        k_flat.index_copy_(0, x["slots"], k.view(-1, HEADS, HEAD_DIM))  # 2. append
        v_flat.index_copy_(0, x["slots"], v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(BS, device=h.device)
        ctx = (x["tables"][:, :, None] * BS + offs).flatten(1)  # [T, CONTEXT]
        keys, vals = k_flat[ctx], v_flat[ctx]
        visible = torch.arange(CONTEXT, device=h.device)[None, :] <= x["positions"][:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = scores / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=h.device))
        att = torch.einsum("thc,tchd->thd", probs, vals).flatten(1)
        h = h + att @ w["o"]
        h = h + torch.nn.functional.silu(_rms(h) @ w["up"]) @ w["down"]
        for pool in (k_pool, v_pool):  # 3. publish the forks over their tail blocks
            pool.index_copy_(0, src, pool.index_select(0, dst))
        if "last" in x:
            h = h[x["last"]]
        return _rms(h) @ w["head"]


def fork_blocks(src: Tensor, dst: Tensor, k_pool: Tensor, v_pool: Tensor) -> None:
    for pool in (k_pool, v_pool):  # whole blocks: gather the sources, scatter to the forks
        pool.index_copy_(0, dst, pool.index_select(0, src))


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def sample(
    logits: Tensor, positions: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor
) -> Tensor:
    key = _mix(_mix(seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


# -- the target ---------------------------------------------------------------------------------


class ForkedBlocksRunner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        reset_pair_tail: bool = True,
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.reset_pair_tail = reset_pair_tail
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.device = dev
        with torch.inference_mode():
            self.model = Model(seed, dev)
            shape = (NB + MAX_PAIRS, BS, HEADS, HEAD_DIM)
            self.k_pool = torch.zeros(shape, device=dev)
            self.v_pool = torch.zeros(shape, device=dev)
            # slot-major views of the harness-visible blocks (the forks lie past them)
            self.k_state = self.k_pool.view(-1, HEADS, HEAD_DIM)[: NB * BS]
            self.v_state = self.v_pool.view(-1, HEADS, HEAD_DIM)[: NB * BS]
            self.graphs: dict[int, Any] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            if mode == "graph":
                rows, i64 = SPEC.capture_sizes[-1], torch.int64
                self.buffers = {
                    "tokens": torch.zeros(rows, dtype=i64, device=dev),
                    "positions": torch.zeros(rows, dtype=i64, device=dev),
                    "slots": torch.zeros(rows, dtype=i64, device=dev),
                    "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                    "seeds": torch.zeros(rows, dtype=i64, device=dev),
                    "temps": torch.ones(rows, device=dev),
                    "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
                    "pairs": torch.zeros(2, MAX_PAIRS, dtype=i64, device=dev),
                }
                # pinned staging of the (src, dst) pair list, uploaded whole every replay
                self.pairs_host = self.be.empty_pinned((2, MAX_PAIRS), dtype=i64)
                self.pairs_host.fill_(NULL)
                self.pairs_uploaded = self.be.Event()
                self.capture()

    # -- graph mode ---------------------------------------------------------------------------

    def graph_inputs(self, size: int) -> dict[str, Tensor]:
        b = self.buffers
        return {
            "tokens": b["tokens"][:size],
            "positions": b["positions"][:size],
            "slots": b["slots"][:size],
            "tables": b["tables"][:size],
            "src": b["pairs"][0],
            "dst": b["pairs"][1],
        }

    def run_graph_body(self, size: int) -> tuple[Tensor, Tensor]:
        b = self.buffers
        logits = self.model.forward(self.graph_inputs(size), self.k_pool, self.v_pool)
        tokens = sample(
            logits, b["positions"][:size], b["seeds"][:size], b["temps"][:size], b["sampled"][:size]
        )
        return logits, tokens

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            self.run_graph_body(size)  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self.run_graph_body(size)
            self.graphs[size] = graph

    def stage_pairs(self, src: list[int], dst: list[int]) -> None:
        self.pairs_uploaded.synchronize()  # the last upload has read the staging buffer
        m = len(src)
        host = self.pairs_host
        if m:
            host[0, :m] = torch.tensor(src, dtype=torch.int64)
            host[1, :m] = torch.tensor(dst, dtype=torch.int64)
        if self.reset_pair_tail:
            host[:, m:] = NULL  # padded pairs copy the null block onto itself
        # (buggy variant: the tail keeps the pairs earlier steps staged there)
        self.buffers["pairs"].copy_(host, non_blocking=True)  # on the replay stream
        self.pairs_uploaded.record()

    def prepare(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        p = plan(reqs)
        samp = [_sampling(r) for r in reqs]
        rows = {
            "tokens": p["tokens"],
            "positions": p["positions"],
            "slots": p["slots"],
            "tables": p["tables"],
            "seeds": [s[0] for s in samp],
            "temps": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        pad = {
            "tokens": 0,
            "positions": 0,
            "slots": NULL_SLOT,
            "tables": NULL,
            "seeds": 0,
            "temps": 1.0,
            "sampled": False,
        }
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(pad[name])
        self.stage_pairs(p["src"], p["dst"])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager --------------------------------------------------------------------------------

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        p = plan(batch.requests)
        dev = self.device

        def t(v: Any, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(v, dtype=dtype, device=dev)

        x = {
            "tokens": t(p["tokens"]),
            "positions": t(p["positions"]),
            "slots": t(p["slots"]),
            "tables": t(p["tables"]).view(-1, SPEC.max_blocks_per_req),
            "last": t(p["last"]),
            "src": t(p["src"]),
            "dst": t(p["dst"]),
        }
        logits = self.model.forward(x, self.k_pool, self.v_pool)
        samp = [_sampling(r) for r in batch.requests]
        tokens = sample(
            logits,
            x["positions"][x["last"]],
            t([s[0] for s in samp]),
            t([s[1] for s in samp], torch.float32),
            t([s[2] for s in samp], torch.bool),
        )
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length above one"
        if any(r.context_len == 0 for r in batch.requests):
            return "prefill row"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more rows than the largest graph"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    # -- contract -----------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.k_state, "v0": self.v_state}

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ForkedBlocksRunner:
    return ForkedBlocksRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> ForkedBlocksRunner:
    return ForkedBlocksRunner(mode, seed=seed, backend=backend, reset_pair_tail=False)
