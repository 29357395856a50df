"""A llama.cpp-style graph runner: graphs reused while their recorded node properties match.

The runner follows ggml-cuda's graph reuse (``ggml_backend_cuda_graph_compute``): the step's
inputs are views into one compute buffer that an allocator (ggml's ``gallocr``) hands out and
reallocates, larger, when a step needs more than it holds (a long prefill). A decode step of
``n`` requests, padded to a capture size, keeps one CUDA graph per size, captured lazily on first
use together with the properties of the tensors it reads: their shapes and the addresses of their
data. Before each replay the runner compares the step's properties with the recorded ones and
captures the graph again where any differ (ggml-cuda updates the executable graph there); every
other step (prefill, mixed, more rows than the largest size) runs eagerly through the same
compute buffer.

The bug (``make_buggy_target``): the reuse check compares the inputs' shapes but not the address
of the memory they view. After llama.cpp PR #21472 made the properties check faster, it compared a
copy of each node (whose ``src`` are pointers to tensor structs) and no longer the sources'
``data`` pointers, so a graph was replayed after its inputs moved to a reallocated buffer
(llama.cpp issue #21622, fixed by https://github.com/ggml-org/llama.cpp/pull/21635,
"CUDA: also store node->src->data ptrs for equality check"). Here a prefill longer than the
compute buffer reallocates it; the next decode step of an already captured size replays a graph
that still reads the freed buffer.

What the contract could not express: nothing essential. ggml updates the instantiated graph in
place (``cudaGraphExecUpdate``); the facade has no update, so the runner captures the graph anew.
"""

from __future__ import annotations

import math

import torch

from pytest_graphmode.contract import Batch, StepResult, TargetSpec
from pytest_graphmode.runtime import backends

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill"}),
)
HIDDEN = 32
MAX_LEN = SPEC.max_blocks_per_req * SPEC.block_size
COLS = 3 + SPEC.max_blocks_per_req  # token, position, slot, block table


class Runner:
    def __init__(self, mode: str, seed: int, backend: str, check_addresses: bool) -> None:
        self.spec = SPEC
        self.mode = mode
        self.check_addresses = check_addresses
        self.be = backends.get(backend)
        dev = self.be.device
        gen = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / math.sqrt(shape[0])).to(dev)

        self.emb = w(SPEC.vocab_size, HIDDEN)
        self.pos = w(MAX_LEN, HIDDEN)
        self.wq, self.wk, self.wv = w(HIDDEN, HIDDEN), w(HIDDEN, HIDDEN), w(HIDDEN, HIDDEN)
        self.wout = w(HIDDEN, SPEC.vocab_size)
        slots = SPEC.num_blocks * SPEC.block_size
        self.k_cache = torch.zeros(slots, HIDDEN, device=dev)
        self.v_cache = torch.zeros(slots, HIDDEN, device=dev)
        # the compute buffer, sized for the largest graph; a longer step reallocates it
        self.arena = torch.zeros(SPEC.capture_sizes[-1], COLS, dtype=torch.int64, device=dev)
        self.pool = self.be.graph_pool_handle() if mode == "graph" else None
        # size -> (graph, outputs, properties recorded at capture)
        self.graphs: dict[int, tuple[object, tuple[torch.Tensor, torch.Tensor], tuple]] = {}

    # ---- the compute buffer ("gallocr") ----
    def reserve(self, num_tokens: int) -> None:
        cap = self.arena.shape[0]
        if num_tokens <= cap:
            return
        while cap < num_tokens:
            cap *= 2
        self.arena = torch.zeros(cap, COLS, dtype=torch.int64, device=self.be.device)

    def views(self, n: int) -> tuple[torch.Tensor, ...]:
        a = self.arena[:n]
        return a[:, 0], a[:, 1], a[:, 2], a[:, 3:]

    def properties(self, n: int) -> tuple:
        props = tuple((tuple(v.shape), tuple(v.stride())) for v in self.views(n))
        if self.check_addresses:
            props += tuple(v.data_ptr() for v in self.views(n))
        return props

    def write_inputs(self, batch: Batch, n: int) -> list[int]:
        bs, null = SPEC.block_size, SPEC.null_block
        rows, last = [], []
        for r in batch.requests:
            table = list(r.block_ids) + [null] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for i, tok in enumerate(r.tokens):
                p = r.context_len + i
                rows.append([tok, p, r.block_ids[p // bs] * bs + p % bs, *table])
            last.append(len(rows) - 1)
        pad = [0, 0, null * bs] + [null] * SPEC.max_blocks_per_req
        rows += [pad] * (n - len(rows))
        host = torch.tensor(rows, dtype=torch.int64, device=self.be.device)
        self.arena[:n].copy_(host)
        return last

    # ---- the model ----
    def forward(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, positions, slots, tables = self.views(n)
        x = self.emb[tokens] + self.pos[positions]
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        j = torch.arange(MAX_LEN, device=x.device)
        bs = SPEC.block_size
        ctx_slots = tables[:, j // bs] * bs + j % bs
        mask = j[None, :] <= positions[:, None]
        keys = torch.where(mask[..., None], self.k_cache[ctx_slots], 0.0)
        vals = torch.where(mask[..., None], self.v_cache[ctx_slots], 0.0)
        scores = (keys @ q[:, :, None]).squeeze(-1) / math.sqrt(HIDDEN)
        probs = torch.softmax(torch.where(mask, scores, -math.inf), dim=-1)
        probs = torch.where(mask, probs, 0.0)
        h = x + (probs[..., None] * vals).sum(1)
        logits = h @ self.wout
        return logits, logits.argmax(-1)

    # ---- graphs ----
    def capture(self, n: int) -> None:
        self.forward(n)  # warm-up outside the graph
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            outputs = self.forward(n)
        old = self.graphs.get(n)
        self.graphs[n] = (graph, outputs, self.properties(n))
        if old is not None:
            # Only now: torch refuses a capture into a pool whose graphs were all reset.
            old[0].reset()

    def graph_size(self, batch: Batch) -> int | None:
        if self.mode != "graph" or any(q != 1 for q in batch.query_lens):
            return None
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        if n == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.be.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        size = self.graph_size(batch)
        if size is None:
            self.reserve(batch.num_tokens)
            last = self.write_inputs(batch, batch.num_tokens)
            logits, tokens = self.forward(batch.num_tokens)
            idx = torch.tensor(last, device=self.be.device)
            reason = "eager twin" if self.mode == "eager" else "not a decode step within sizes"
            return StepResult(logits[idx].clone(), tokens[idx].clone(), "eager", None, reason)
        self.write_inputs(batch, size)
        entry = self.graphs.get(size)
        if entry is None or entry[2] != self.properties(size):
            self.capture(size)  # properties changed: the graph is made again
            self.write_inputs(batch, size)
            entry = self.graphs[size]
        graph, (logits, tokens), _ = entry
        graph.replay()
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # ---- contract side ----
    def state(self) -> dict[str, torch.Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> dict[str, torch.Tensor]:
        return {"inputs": self.arena} if self.mode == "graph" else {}

    def address_views(self) -> list:
        return []

    def update_weights(self, seed: int) -> None:
        raise NotImplementedError("feature weight_update not declared")

    def close(self) -> None:
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()


def make_target(mode: str, *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed, backend, check_addresses=True)


def make_buggy_target(mode: str, *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed, backend, check_addresses=False)
