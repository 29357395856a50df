"""A sliding-window decoder whose block table is a ring: cyclic block reuse, driven in graph mode.

The design
----------
Mistral-style sliding-window attention (every layer attends to the last ``WINDOW`` positions) over
a paged KV cache with cyclic block reuse, as TensorRT-LLM's KV cache manager had it before it went
linear (NVIDIA/TensorRT-LLM#6768: "the KV cache for sliding window attention only holds window size
number of blocks and reuses them in a cyclic matter"; vLLM v0's decode metadata likewise kept a
sequence's last ``sliding_window // block_size`` block-table entries). Each batch row owns a ring
of ``RING = WINDOW // BLOCK + 1`` block-table columns, and the block of logical block index ``j``
lives in column ``j % RING``; a column is reused for blocks ``j, j + RING, j + 2 * RING, ...``.
Attention reads the ring whole (``RING * BLOCK`` slots per row, however long the sequence), so a
captured decode graph scans a window-sized table, not one sized for the longest request. Keys are
stored after their positional embedding, so their order in the ring does not matter; each key's
absolute position decides whether it is in the query's window.

Two arms find those positions:

* the *linear* arm, while no row of the batch has wrapped its ring (every sequence within
  ``RING * BLOCK`` positions): column ``c`` still holds logical block ``c``, so a key's position is
  ``c * BLOCK + offset``, computed once for every row;
* the *ring* arm, after a wrap: each column's position comes from the ring's own table of block
  starts (``ring_pos0``), gathered per row.

The eager path picks the arm on the host from the batch's longest sequence, step by step. A captured
graph serves every later batch, so the correct runner captures the ring arm: it is exact before the
wrap too. Decode steps (every row one query token, up to the largest capture size) replay graphs
captured at start-up, largest first, in one pool; prefill, mixed steps and larger batches run
eagerly, with a ring widened to the blocks their queries need. Sampling is Gumbel-max with noise
hashed from (seed, position, token): no generator, nothing baked at capture.

The bug
-------
``make_buggy_target`` lets the graph path decide the arm as the eager path does: on the host, from
the batch it is given. A graph is given the capture's all-padding batch, whose rings are empty, so
every graph bakes the linear arm in. Once a decoding request's ring wraps (its sequence passes
``RING * BLOCK`` = 12 positions), each replay takes its keys' positions to be ``c * BLOCK +
offset``: it masks out the keys of its window and attends to keys the arm wrongly places inside it
(empty columns, the null block). Eager steps, which re-decide every step, stay right: the
wrap-around is handled only on the eager path.

Public source (open pull requests, read in their descriptions and comments):
nntrainer/nntrainer#4313, "[cuda] An additive NVIDIA backend ... and graph decode"
(https://github.com/nntrainer/nntrainer/pull/4313): "A capture freezes the host's decisions, not
only the device's work. The kernels were taught to read the moving values (position, key count)
from the device position buffer, but the `if` that PICKED them already happened and no replay
re-asks it", among the sites "the sliding-window regime on both the dense and the split arm"; and
#4317 (https://github.com/nntrainer/nntrainer/pull/4317), whose commit "Expire a captured decode
graph when the attention window regime changes" says "the sliding-window arms decide `windowed =
local_window_s[ize ...]`" from the current KV length. There the fix retires a graph whose regime
answer has flipped; here the fix captures the arm that holds in both regimes.

What the contract could not express
-----------------------------------
The physical reuse. A real cyclic cache writes position ``p`` over the slot of ``p - RING * BLOCK``
(the scheduler hands a request ``RING`` blocks and no more); the harness's scheduler gives every
``BLOCK`` positions a block of their own and checks that each position lands in its own slot
(``kv_writes_land``) and that nothing else is written (``kv_writes_confined``). So the ring wraps in
the block table, not in the cache memory: each step fills the ring from the request's newest
``block_ids`` (the blocks that slid out of the window are simply no longer referenced, though the
harness keeps them allocated), and a token's keys go to ``kv_slot(block_ids, position)``, which is
the slot its ring column names. A physical ring also needs no window mask at capacity ``WINDOW``
(every slot it holds is in the window); this one keeps one block more than the window and masks by
position, since a column's block is replaced as a whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from pytest_graphmode import AddressView, Batch, StepResult, TargetSpec
from pytest_graphmode.contract import kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

BLOCK = 4
WINDOW = 8  # positions a query attends to, itself included; a multiple of BLOCK
RING = WINDOW // BLOCK + 1  # block-table columns per row: a window of positions spans this many
NULL_BLOCK = 0
EMPTY = -(1 << 40)  # ring_pos0 of an empty column: every key in it is masked
VOCAB, HIDDEN, HEADS, HEAD_DIM, MLP = 64, 32, 2, 16, 64

SPEC = TargetSpec(
    num_blocks=64,
    block_size=BLOCK,
    max_blocks_per_req=8,
    vocab_size=VOCAB,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
    null_block=NULL_BLOCK,
)
MAX_POS = SPEC.max_blocks_per_req * BLOCK

Mode = Literal["graph", "eager"]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """Host weights drawn from a private generator: the global one is the harness's."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    return {
        "emb": draw(VOCAB, HIDDEN, scale=1.0),
        "pos": draw(MAX_POS, HIDDEN, scale=0.5),
        "wqkv": draw(HIDDEN, 3 * HEADS * HEAD_DIM, scale=HIDDEN**-0.5),
        "wo": draw(HEADS * HEAD_DIM, HIDDEN, scale=(HEADS * HEAD_DIM) ** -0.5),
        "w1": draw(HIDDEN, MLP, scale=HIDDEN**-0.5),
        "w2": draw(MLP, HIDDEN, scale=MLP**-0.5),
        "lm": draw(HIDDEN, VOCAB, scale=HIDDEN**-0.5),
    }


def _gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise hashed from (seed, position, token id): the same in any batch or replay."""
    mask = 0xFFFFFFFF
    h = (seeds[:, None] * 0x9E3779B1 + positions[:, None] * 0x7FEB352D + vocab_ids) & mask
    for mul in (0x2C1B3C6D, 0x297A2D39):
        h = ((h ^ (h >> 15)) * mul) & mask
    h = h ^ (h >> 16)
    u = ((h & 0xFFFFFF).to(torch.float32) + 0.5) / float(1 << 24)
    return -torch.log(-torch.log(u))


class CyclicBlockTableRunner:
    """One sliding-window layer over a paged cache whose per-row block table is a ring."""

    def __init__(self, mode: Mode, *, seed: int, backend: str, bug: bool = False) -> None:
        self.mode = mode
        self.bug = bug
        self.spec = SPEC
        self.be = get_backend(backend)
        dev = self.be.device
        self.device = dev
        with torch.inference_mode():
            self.params = {k: v.to(dev) for k, v in _weights(seed).items()}
            slots = SPEC.num_blocks * BLOCK
            self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=dev)
            self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=dev)
            self.offsets = torch.arange(BLOCK, device=dev)
            self.vocab_ids = torch.arange(VOCAB, device=dev)
            self.rows = torch.arange(SPEC.max_num_reqs, device=dev)
            # linear arm: column c holds logical block c
            self.linear_pos = {}
            for width in range(RING, SPEC.max_blocks_per_req + 1):
                cols = torch.arange(width, device=dev)[:, None] * BLOCK + self.offsets
                self.linear_pos[width] = cols.reshape(1, width * BLOCK)
            self.graphs: dict[int, object] = {}
            self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            self.buffers: dict[str, torch.Tensor] = {}
            if mode == "graph":
                self._make_buffers()
                self._capture()

    # ------------------------------------------------------------------ the model
    def _forward(
        self,
        tokens: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        rows: torch.Tensor,  # [T] the batch row of each token
        slots: torch.Tensor,  # [T] where each token's keys go
        ring_blocks: torch.Tensor,  # [N, W] the ring: a block per column
        ring_pos0: torch.Tensor,  # [N, W] the first position of each column's block
        last_idx: torch.Tensor,  # [N] each row's last query token
        seeds: torch.Tensor,  # [N]
        temps: torch.Tensor,  # [N]
        sampled: torch.Tensor,  # [N] bool
        *,
        wrapped: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.params
        n_tok = tokens.shape[0]
        width = ring_blocks.shape[1]
        x = p["emb"][tokens] + p["pos"][positions]
        qkv = (x @ p["wqkv"]).view(n_tok, 3, HEADS, HEAD_DIM)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        # store first: a step's own keys are read back from the cache
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)

        ring_slots = (ring_blocks[:, :, None] * BLOCK + self.offsets).reshape(-1, width * BLOCK)
        key_slots = ring_slots[rows]  # [T, L]
        if wrapped:  # ring arm: each column's block start from the ring's table
            key_pos = (ring_pos0[:, :, None] + self.offsets).reshape(-1, width * BLOCK)[rows]
        else:  # linear arm: column c is still logical block c
            key_pos = self.linear_pos[width]
        qpos = positions[:, None]
        mask = (key_pos <= qpos) & (key_pos > qpos - WINDOW) & (key_pos >= 0)  # [T, L]
        keys = torch.where(mask[:, :, None, None], self.k_cache[key_slots], 0.0)
        values = torch.where(mask[:, :, None, None], self.v_cache[key_slots], 0.0)
        scores = torch.einsum("thd,tlhd->thl", q, keys) * HEAD_DIM**-0.5
        scores = torch.where(mask[:, None, :], scores, -1e30)
        probs = torch.where(mask[:, None, :], torch.softmax(scores, dim=-1), 0.0)
        attn = torch.einsum("thl,tlhd->thd", probs, values).reshape(n_tok, HEADS * HEAD_DIM)
        h = x + attn @ p["wo"]
        h = h + torch.nn.functional.silu(h @ p["w1"]) @ p["w2"]
        logits = h[last_idx] @ p["lm"]
        noise = _gumbel(seeds, positions[last_idx], self.vocab_ids)
        scaled = logits / temps[:, None] + noise
        next_tokens = torch.where(sampled, scaled.argmax(-1), logits.argmax(-1))
        return logits, next_tokens

    # ------------------------------------------------------------------ host-side inputs
    @staticmethod
    def _ring_span(req_context: int, req_seq: int) -> tuple[int, int]:
        """The logical blocks a request's queries read this step: from the first query's window
        start to its last token."""
        first = max(0, req_context - WINDOW + 1) // BLOCK
        last = (req_seq - 1) // BLOCK
        return first, last

    def _ring_width(self, batch: Batch) -> int:
        spans = [self._ring_span(r.context_len, r.seq_len) for r in batch.requests]
        return max([RING] + [last - first + 1 for first, last in spans])

    def _host_inputs(self, batch: Batch, rows: int, width: int) -> dict[str, torch.Tensor]:
        """Every input of a step on the host, `rows` batch rows (the batch's, then padding)."""
        tokens, positions, token_rows, slots, last_idx = [], [], [], [], []
        ring_blocks = torch.full((rows, width), NULL_BLOCK, dtype=torch.long)
        ring_pos0 = torch.full((rows, width), EMPTY, dtype=torch.long)
        seeds = torch.zeros(rows, dtype=torch.long)
        temps = torch.ones(rows, dtype=torch.float32)
        sampled = torch.zeros(rows, dtype=torch.bool)
        null_slot = NULL_BLOCK * BLOCK
        for i in range(rows):
            if i < batch.num_reqs:
                r = batch.requests[i]
                for j, tok in enumerate(r.tokens):
                    pos = r.context_len + j
                    tokens.append(tok)
                    positions.append(pos)
                    token_rows.append(i)
                    slots.append(kv_slot(r.block_ids, pos, BLOCK))
                first, last = self._ring_span(r.context_len, r.seq_len)
                for blk in range(first, last + 1):  # the ring: block j in column j % width
                    ring_blocks[i, blk % width] = r.block_ids[blk]
                    ring_pos0[i, blk % width] = blk * BLOCK
                if r.seed is not None:
                    seeds[i] = r.seed
                    temps[i] = r.temperature
                    sampled[i] = True
            else:  # padding: one token at position 0, writing and reading the null block
                tokens.append(0)
                positions.append(0)
                token_rows.append(i)
                slots.append(null_slot)
            last_idx.append(len(tokens) - 1)
        return {
            "tokens": torch.tensor(tokens, dtype=torch.long),
            "positions": torch.tensor(positions, dtype=torch.long),
            "rows": torch.tensor(token_rows, dtype=torch.long),
            "slots": torch.tensor(slots, dtype=torch.long),
            "ring_blocks": ring_blocks,
            "ring_pos0": ring_pos0,
            "last_idx": torch.tensor(last_idx, dtype=torch.long),
            "seeds": seeds,
            "temps": temps,
            "sampled": sampled,
        }

    @staticmethod
    def _host_wrapped(batch: Batch, width: int) -> bool:
        """Whether some row's ring has wrapped: the eager path's choice of arm."""
        return max((r.seq_len for r in batch.requests), default=0) > width * BLOCK

    def _graph_wrapped(self, batch: Batch) -> bool:
        """The arm a captured graph takes, for every batch it will ever replay."""
        if self.bug:
            return self._host_wrapped(batch, RING)  # decided from the capture's batch
        return True  # the ring arm is exact before the wrap too

    # ------------------------------------------------------------------ graph mode
    _STATIC = (
        "tokens",
        "positions",
        "slots",
        "ring_blocks",
        "ring_pos0",
        "seeds",
        "temps",
        "sampled",
    )

    def _make_buffers(self) -> None:
        n = max(SPEC.capture_sizes)
        dev = self.device
        self.buffers = {
            "tokens": torch.zeros(n, dtype=torch.long, device=dev),
            "positions": torch.zeros(n, dtype=torch.long, device=dev),
            "slots": torch.zeros(n, dtype=torch.long, device=dev),
            "ring_blocks": torch.zeros(n, RING, dtype=torch.long, device=dev),
            "ring_pos0": torch.zeros(n, RING, dtype=torch.long, device=dev),
            "seeds": torch.zeros(n, dtype=torch.long, device=dev),
            "temps": torch.ones(n, dtype=torch.float32, device=dev),
            "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
        }

    def _stage(self, batch: Batch, size: int) -> None:
        """Write the batch into the buffers' first `size` rows, padding rows included."""
        host = self._host_inputs(batch, size, RING)
        for name in self._STATIC:
            self.buffers[name][:size].copy_(host[name])

    def _graph_inputs(self, size: int) -> dict[str, torch.Tensor]:
        b = {name: self.buffers[name][:size] for name in self._STATIC}
        b["rows"] = self.rows[:size]
        b["last_idx"] = self.rows[:size]
        return b

    def _capture(self) -> None:
        pool = self.be.graph_pool_handle()
        empty = Batch(())
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._stage(empty, size)  # every row padding during warm-up and capture
            inputs = self._graph_inputs(size)
            wrapped = self._graph_wrapped(empty)
            self._forward(**inputs, wrapped=wrapped)  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self._forward(**inputs, wrapped=wrapped)
            self.graphs[size] = graph

    def _fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.query_len != 1 for r in batch.requests):
            return "query longer than one token (prefill or mixed)"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more rows than the largest graph"
        return None

    # ------------------------------------------------------------------ the contract
    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self._fallback_reason(batch)
            if reason is None:
                size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
                self._stage(batch, size)
                self.graphs[size].replay()
                logits, tokens = self.outputs[size]
                n = batch.num_reqs
                return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
            if batch.num_reqs == 0:
                empty = torch.zeros(0, VOCAB, device=self.device)
                none = torch.zeros(0, dtype=torch.long, device=self.device)
                return StepResult(empty, none, "eager", None, reason)
            width = self._ring_width(batch)
            host = self._host_inputs(batch, batch.num_reqs, width)
            inputs = {k: v.to(self.device) for k, v in host.items()}
            logits, tokens = self._forward(**inputs, wrapped=self._host_wrapped(batch, width))
            return StepResult(logits, tokens, "eager", None, reason)

    def state(self) -> Mapping[str, torch.Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return dict(self.buffers) if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            for name, value in _weights(seed).items():
                self.params[name].copy_(value)  # in place: the graphs read these addresses

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Mode, *, seed: int, backend: str) -> CyclicBlockTableRunner:
    return CyclicBlockTableRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Mode, *, seed: int, backend: str) -> CyclicBlockTableRunner:
    return CyclicBlockTableRunner(mode, seed=seed, backend=backend, bug=True)
