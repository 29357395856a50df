"""A Whisper-style encoder-decoder decode runner whose graphs skip the encoder's first step.

What it models
--------------
vLLM V1 serving Whisper with `cudagraph_mode=FULL_DECODE_ONLY`. Every request carries an audio
clip (here a small feature matrix derived from its `req_id`, the stand-in for the clip the
request brings, so every twin derives the same one). The decoder is one layer: learned token and
position embeddings, causal self-attention over a slot-major paged KV cache read through block
tables, cross-attention over the request's encoder memory, a SiLU MLP and an LM head, with
counter-based Gumbel sampling (a hash of seed, position and token id).

The encoder runs once, in the request's first step (`context_len == 0`): its outputs are
projected to cross-attention keys and values and stored in a persistent cross-attention cache,
which every later step of the request only reads. In vLLM the cross-attention KV cache is a KV
cache group of its own whose blocks the scheduler allocates with the request; here it has one
entry per KV block, and a request's cross memory sits in the entry of its first block (which it
keeps for life; the null block's stays zero, for padding rows). This cache is kept outside
`state()`, a shortcut the runner owns: a host table records which request each entry was made
for, and a later step of a request that the table does not name (a twin that never ran its first
step) rebuilds it before anything runs.

Graph mode captures one full decode graph per capture size (1, 2, 4 rows), lazily, the first
time a batch needs it, with every row padding. A graph's forward takes no encoder outputs: it
reads the cross memory already stored. Static buffers (tokens, positions, slots, block tables,
cross entries) are rewritten for every row before each replay; padding rows point at the null
block and its zero cross entry. Prefill, mixed and speculative batches, and batches of more rows
than the largest graph, run eagerly.

The bug (`make_buggy_target`)
-----------------------------
Dispatch decides "uniform decode, replay a full graph" from the query lengths alone: every row has
one query token. A request whose prompt is one token (Whisper's bare `<|startoftranscript|>`)
makes its first step such a row, so a batch of such admissions, alone or beside decoding rows,
is replayed on the decode graph. The encoder outputs of that step are never stored (the graph's
forward has no input for them); the request's cross-attention reads whatever its first block's
cross entry held (another, finished request's memory, or zeros) for the rest of its life.

Where it comes from
-------------------
- vLLM PR #26892, "Fix uniform_decode=True in prefill when using CUDA Graph with single-token
  prompt": https://github.com/vllm-project/vllm/pull/26892 -- with FULL_DECODE_ONLY graphs, the
  prompt `<|startoftranscript|><|zh|><|transcribe|><|notimestamps|>` transcribed correctly while
  the prompt `<|startoftranscript|>` alone did not: its first step was classified as a uniform
  decode and ran as a full graph, which does not use the encoder outputs.
- vLLM PR #30072, "[Core] Whisper enable FULL_DECODE_ONLY CudaGraph":
  https://github.com/vllm-project/vllm/pull/30072 -- the merged support states the rule the fix
  needs: the first step of a request branches on the encoder outputs it must store, so only the
  steps after it are replayed as graphs.

The fix: a batch that still has encoder outputs to store is not a graph batch, whatever its query
lengths; it runs eagerly (vLLM's FULL_DECODE_ONLY runs such a step without a graph). The correct
runner checks `context_len == 0` of every row before it picks a graph. No engine code is copied.
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
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),  # in rows: a decode graph's rows are its requests
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_POSITIONS = SPEC.max_blocks_per_req * SPEC.block_size  # Whisper's learned decoder positions
ENCODER_LEN, AUDIO_DIM = 6, 8  # every clip is padded to the same length, as Whisper's 30 s are
NULL_SLOT = SPEC.null_block * SPEC.block_size
_MASK32 = 0xFFFFFFFF


def audio_clip(req_id: int) -> Tensor:
    """The request's audio features: what the client sent with it, the same on every twin."""
    gen = torch.Generator().manual_seed((req_id * 0x9E3779B1 + 12345) % (2**63))
    return torch.randn(ENCODER_LEN, AUDIO_DIM, generator=gen)


WEIGHT_SHAPES = {
    "embed": (SPEC.vocab_size, HIDDEN),
    "positions": (MAX_POSITIONS, HIDDEN),
    "wq": (HIDDEN, HIDDEN),
    "wk": (HIDDEN, HIDDEN),
    "wv": (HIDDEN, HIDDEN),
    "wo": (HIDDEN, HIDDEN),
    "cross_q": (HIDDEN, HIDDEN),
    "cross_k": (HIDDEN, HIDDEN),
    "cross_v": (HIDDEN, HIDDEN),
    "cross_o": (HIDDEN, HIDDEN),
    "up": (HIDDEN, 2 * HIDDEN),
    "down": (2 * HIDDEN, HIDDEN),
    "head": (HIDDEN, SPEC.vocab_size),
    "enc_in": (AUDIO_DIM, HIDDEN),
    "enc_positions": (ENCODER_LEN, HIDDEN),
    "enc_mlp": (HIDDEN, HIDDEN),
}


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        self.t = {name: torch.empty(shape, device=device) for name, shape in WEIGHT_SHAPES.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: the captured graphs read these tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def sample(logits: Tensor, reqs: Sequence[Request]) -> Tensor:
    """Gumbel-max from a hash of (seed, position, token id): the same draw in any batch."""
    dev = logits.device
    seeds = [0 if r.seed is None else (r.seed ^ (r.seed >> 32)) & _MASK32 for r in reqs]
    key = _hash32(
        torch.tensor(seeds, dtype=torch.int64, device=dev)
        ^ _hash32(torch.tensor([r.seq_len - 1 for r in reqs], dtype=torch.int64, device=dev))
    )
    ids = torch.arange(logits.shape[-1], dtype=torch.int64, device=dev)
    bits = _hash32(key[:, None] ^ ((ids * 0x9E3779B1) & _MASK32)[None, :])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    sampled = torch.tensor([r.seed is not None for r in reqs], dtype=torch.bool, device=dev)
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class WhisperDecodeRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, graph_by_query_len: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        # The bug's switch: pick the decode graph from the query lengths alone, as if a one-token
        # row were always a decode row, also when it is a request's first step.
        self.graph_by_query_len = graph_by_query_len
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        # The cross-attention cache: one entry per KV block, a request's in its first block's.
        # Not in state(): the harness takes only slot-major state. It is a shortcut the runner
        # owns, checked against the batch before it is trusted (`cross_owner`, below).
        self.cross_k = torch.zeros(SPEC.num_blocks, ENCODER_LEN, HEADS, HEAD_DIM, device=dev)
        self.cross_v = torch.zeros(SPEC.num_blocks, ENCODER_LEN, HEADS, HEAD_DIM, device=dev)
        # Which request's encoder input each entry was consumed for: the scheduler's record,
        # set in a request's first step whichever path runs it (vLLM's scheduler, too, counts the
        # encoder input as done once it is scheduled).
        self.cross_owner: list[int | None] = [None] * SPEC.num_blocks
        self.graphs: dict[int, Any] = {}
        self.graph_logits: dict[int, Tensor] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=torch.int64, device=dev),
                "positions": torch.zeros(rows, dtype=torch.int64, device=dev),
                "slots": torch.zeros(rows, dtype=torch.int64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=torch.int64, device=dev),
                "cross_rows": torch.zeros(rows, dtype=torch.int64, device=dev),
            }

    # -- the model --------------------------------------------------------------------------------

    def encode_and_store(self, reqs: Sequence[Request]) -> None:
        """The encoder, run eagerly in a request's first step; its cross K/V go to the cache."""
        w = self.w.t
        clips = torch.stack([audio_clip(r.req_id) for r in reqs]).to(self.device)
        x = clips @ w["enc_in"] + w["enc_positions"]
        x = _norm(x + torch.nn.functional.silu(_norm(x) @ w["enc_mlp"]))
        shape = (len(reqs), ENCODER_LEN, HEADS, HEAD_DIM)
        rows = torch.tensor([r.block_ids[0] for r in reqs], dtype=torch.int64, device=self.device)
        self.cross_k.index_copy_(0, rows, (x @ w["cross_k"]).view(shape))
        self.cross_v.index_copy_(0, rows, (x @ w["cross_v"]).view(shape))
        for r in reqs:
            self.cross_owner[r.block_ids[0]] = r.req_id

    def forward(self, tokens, positions, slots, tables, cross_rows) -> Tensor:
        """Logits at every token; every argument has one entry (or table row) per token."""
        w = self.w.t
        n = tokens.shape[0]
        x = w["embed"][tokens] + w["positions"][positions]
        h = _norm(x)
        q = (h @ w["wq"]).view(n, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, (h @ w["wk"]).view(n, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, (h @ w["wv"]).view(n, HEADS, HEAD_DIM))
        offsets = torch.arange(SPEC.block_size, device=tokens.device)
        context = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [n, positions]
        visible = (
            torch.arange(context.shape[1], device=tokens.device)[None, :] <= positions[:, None]
        )
        # masked slots may hold NaN (the null block) or a mark: replace, never multiply by zero
        scores = torch.einsum("nhd,nchd->nhc", q, self.k_cache[context]) / math.sqrt(HEAD_DIM)
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), -math.inf, device=q.device)
        )
        values = torch.where(
            visible[:, :, None, None], self.v_cache[context], torch.zeros((), device=q.device)
        )
        x = x + torch.einsum("nhc,nchd->nhd", scores.softmax(-1), values).flatten(1) @ w["wo"]
        # cross-attention reads only what the request's first step stored
        cq = (_norm(x) @ w["cross_q"]).view(n, HEADS, HEAD_DIM)
        cross = torch.einsum("nhd,nehd->nhe", cq, self.cross_k[cross_rows]) / math.sqrt(HEAD_DIM)
        mixed = torch.einsum("nhe,nehd->nhd", cross.softmax(-1), self.cross_v[cross_rows])
        x = x + mixed.flatten(1) @ w["cross_o"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        return _norm(x) @ w["head"]

    # -- dispatch ---------------------------------------------------------------------------------

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if any(q != 1 for q in batch.query_lens):
            return "not a uniform decode (prefill, mixed or speculative rows)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more rows than the largest graph"
        if not self.graph_by_query_len and any(r.context_len == 0 for r in batch.requests):
            # A first step stores encoder outputs, which the decode graph has no input for.
            return "encoder outputs to store (a request's first step)"
        return None

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        # A later step of a request whose first step this twin did not run (a twin that runs
        # some requests only) finds no memory of its own: rebuild it before any path runs.
        strangers = [
            r
            for r in batch.requests
            if r.context_len > 0 and self.cross_owner[r.block_ids[0]] != r.req_id
        ]
        if strangers:
            self.encode_and_store(strangers)
        for r in batch.requests:
            if r.context_len == 0:
                self.cross_owner[r.block_ids[0]] = r.req_id
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self.run_eager(batch, reason)
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        return self.replay(batch, size)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        reqs = batch.requests
        first_steps = [r for r in reqs if r.context_len == 0]
        if first_steps:
            self.encode_and_store(first_steps)  # what only the eager forward does
        tokens, positions, slots, tables, cross_rows, last = [], [], [], [], [], []
        for r in reqs:
            table = list(r.block_ids) + [SPEC.null_block] * (
                SPEC.max_blocks_per_req - len(r.block_ids)
            )
            for i, token in enumerate(r.tokens):
                tokens.append(token)
                positions.append(r.context_len + i)
                slots.append(kv_slot(r.block_ids, r.context_len + i, SPEC.block_size))
                tables.append(table)
                cross_rows.append(r.block_ids[0])
            last.append(len(tokens) - 1)
        dev = self.device

        def as_tensor(values: list) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=dev)

        logits = self.forward(
            as_tensor(tokens),
            as_tensor(positions),
            as_tensor(slots),
            as_tensor(tables),
            as_tensor(cross_rows),
        )[as_tensor(last)]
        return StepResult(logits, sample(logits, reqs), "eager", None, reason)

    # -- graphs -----------------------------------------------------------------------------------

    def prepare(self, reqs: Sequence[Request]) -> None:
        """Rewrite every row of every static buffer: valid rows first, then padding sentinels."""
        rows = SPEC.capture_sizes[-1]
        pad = rows - len(reqs)
        tables = [
            list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for r in reqs
        ] + [[SPEC.null_block] * SPEC.max_blocks_per_req] * pad
        values = {
            "tokens": [r.tokens[0] for r in reqs] + [0] * pad,
            "positions": [r.context_len for r in reqs] + [0] * pad,
            "slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs]
            + [NULL_SLOT] * pad,
            "tables": tables,
            "cross_rows": [r.block_ids[0] for r in reqs] + [SPEC.null_block] * pad,
        }
        for name, value in values.items():
            self.buffers[name].copy_(torch.tensor(value, dtype=torch.int64, device=self.device))

    def graph_forward(self, size: int) -> Tensor:
        b = self.buffers
        return self.forward(
            b["tokens"][:size],
            b["positions"][:size],
            b["slots"][:size],
            b["tables"][:size],
            b["cross_rows"][:size],
        )

    def capture(self, size: int) -> None:
        """Captured on an all-padding batch: it writes the null block only, and no encoder runs."""
        self.prepare(())
        self.graph_forward(size)  # warm-up outside the graph
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph):
            self.graph_logits[size] = self.graph_forward(size)
        self.graphs[size] = graph

    def replay(self, batch: Batch, size: int) -> StepResult:
        if size not in self.graphs:
            self.capture(size)
        # With the bug, a first step lands here: its encoder outputs are dropped, as the full
        # graph's forward takes none, and its cross entry keeps what it held.
        self.prepare(batch.requests)
        self.graphs[size].replay()
        logits = self.graph_logits[size][: batch.num_reqs].clone()
        return StepResult(
            logits, sample(logits, batch.requests), "full", ("decode", size), "uniform decode"
        )

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        # Stored cross memory keeps the weights it was made with on every twin, as an engine's
        # cross-attention cache does for the requests it already holds.
        self.w.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_logits.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return WhisperDecodeRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return WhisperDecodeRunner(mode, seed=seed, backend=backend, graph_by_query_len=True)
