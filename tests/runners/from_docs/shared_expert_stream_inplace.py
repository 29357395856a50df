"""A vLLM-style MoE decoder runner whose shared expert overlaps the routed experts on a side stream.

Design (after vLLM's ``FusedMoE`` with ``shared_experts_stream``): one attention layer over a
slot-major paged KV cache, then a MoE block with a top-2 router (float32) over four routed
experts and one always-on shared expert. The routed experts run as vLLM's ``fused_experts`` with
``inplace=True``: their combined output is written back into the MoE input ``hidden_states``. The
shared expert runs on one auxiliary stream, forked from the current stream
(``aux.wait_stream(current)``) and joined before the sum (``current.wait_stream(aux)``), on the
eager path and inside the captured graphs alike. Uniform one-token decode steps replay FULL graphs
captured at start-up for padded request counts (largest first, one shared pool); everything else
(prefill, mixed batches, batches past the largest graph) runs eagerly.

The bug (``make_buggy_target``): the shared expert on the auxiliary stream reads ``hidden_states``
itself, while the routed experts on the main stream overwrite the same tensor in place. Nothing
orders the side stream's read before the in-place write, so the shared expert may read the routed
output instead of its input. The fix clones ``hidden_states`` on the main stream before the fork
and hands the clone (``record_stream``-ed on the side stream) to the shared expert.
Source: vLLM PR https://github.com/vllm-project/vllm/pull/28430 ("[Bugfix] Fix Stream Sync for
Shared Expert Overlap": "clone the hidden states before stream to avoid race condition", "use
record_stream to avoid gc issues"), carried over from https://github.com/vllm-project/vllm/pull/28419
(found while investigating issue #28220); the same in-place mutation is behind
https://github.com/vllm-project/vllm/pull/28939.

The race shows in the eager steps, in the capture warm-up and, since the sim judges a graph's
branches at capture (2026-12-06, late), inside the captured graphs too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill"}),
)
HIDDEN = 32
EXPERTS = 4
TOP_K = 2
FFN = 48


class SharedExpertMoERunner:
    def __init__(self, mode: str, *, seed: int, backend: str, clone_input: bool) -> None:
        self.spec = SPEC
        self.mode = mode
        self.clone_input = clone_input
        self.be = get_backend(backend)
        dev = self.be.device
        self.device = dev
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int, scale: float = 0.3) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dev)

        d, v = HIDDEN, SPEC.vocab_size
        self.max_pos = SPEC.max_blocks_per_req * SPEC.block_size
        self.w = {
            "emb": w(v, d, scale=1.0),
            "pos": w(self.max_pos, d, scale=1.0),
            "wq": w(d, d),
            "wk": w(d, d),
            "wv": w(d, d),
            "wo": w(d, d),
            "router": w(d, EXPERTS),
            "w1": w(EXPERTS, d, FFN),
            "w2": w(EXPERTS, FFN, d),
            "s1": w(d, FFN),
            "s2": w(FFN, d),
            "head": w(d, v),
        }
        slots = SPEC.num_blocks * SPEC.block_size
        with torch.inference_mode():
            self.k_cache = torch.zeros(slots, d, device=dev)
            self.v_cache = torch.zeros(slots, d, device=dev)
        self.aux = self.be.Stream()  # one auxiliary stream for every layer, as vLLM keeps
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bufs: dict[str, torch.Tensor] = {}
        if mode == "graph":
            self._capture()

    # ---- model -------------------------------------------------------------------------------
    def _moe(self, h: torch.Tensor) -> torch.Tensor:
        cur = self.be.current_stream()
        shared_in = h.clone() if self.clone_input else h
        self.aux.wait_stream(cur)
        with self.be.stream(self.aux):
            shared_out = self._shared_expert(shared_in)
        if self.clone_input and not self.be.is_current_stream_capturing():
            shared_in.record_stream(self.aux)
        # routed experts, fused_experts(..., inplace=True): the result lands in h itself
        h.copy_(self._routed(h))
        cur.wait_stream(self.aux)
        if not self.be.is_current_stream_capturing():
            shared_out.record_stream(cur)
        return h + shared_out

    def _shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x @ self.w["s1"]) @ self.w["s2"]

    def _routed(self, h: torch.Tensor) -> torch.Tensor:
        """The routed experts' combined output for `h`: top-2 of a float32 router."""
        probs = torch.softmax(h.float() @ self.w["router"], dim=-1)
        top_w, top_i = probs.topk(TOP_K, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter_(1, top_i, top_w)
        inner = F.silu(torch.einsum("td,edf->tef", h, self.w["w1"]))
        expert_out = torch.einsum("tef,efd->ted", inner, self.w["w2"])
        return (gates.unsqueeze(-1) * expert_out).sum(1)

    def _forward(
        self,
        tokens: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        slots: torch.Tensor,  # [T]
        tables: torch.Tensor,  # [T, max_blocks] the block table of each token's request
    ) -> torch.Tensor:
        bs = SPEC.block_size
        x = self.w["emb"][tokens] + self.w["pos"][positions.clamp(0, self.max_pos - 1)]
        q, k, v = x @ self.w["wq"], x @ self.w["wk"], x @ self.w["wv"]
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        offs = torch.arange(bs, device=self.device)
        ctx_slots = (tables.unsqueeze(-1) * bs + offs).reshape(tables.shape[0], -1)
        ctx_pos = torch.arange(ctx_slots.shape[1], device=self.device)
        mask = ctx_pos.unsqueeze(0) <= positions.unsqueeze(1)
        keys = torch.where(mask.unsqueeze(-1), self.k_cache[ctx_slots], 0.0)
        vals = torch.where(mask.unsqueeze(-1), self.v_cache[ctx_slots], 0.0)
        scores = torch.einsum("td,tsd->ts", q, keys) / HIDDEN**0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = torch.einsum("ts,tsd->td", torch.softmax(scores, -1), vals)
        h = x + attn @ self.w["wo"]
        moe_in = F.layer_norm(h, (HIDDEN,))  # a fresh tensor the routed experts overwrite
        h = h + self._moe(moe_in)
        return h @ self.w["head"]

    # ---- graph mode ----------------------------------------------------------------------------
    def _capture(self) -> None:
        n, mb = SPEC.max_num_reqs, SPEC.max_blocks_per_req
        dev = self.device
        with torch.inference_mode():
            self.bufs = {
                "tokens": torch.zeros(n, dtype=torch.long, device=dev),
                "positions": torch.zeros(n, dtype=torch.long, device=dev),
                "slots": torch.zeros(n, dtype=torch.long, device=dev),
                "tables": torch.zeros(n, mb, dtype=torch.long, device=dev),
            }
            pool = self.be.graph_pool_handle()
            for size in sorted(SPEC.capture_sizes, reverse=True):
                self._prepare(Batch(()), size)
                self._graph_forward(size)  # warm-up outside the graph
                self.be.synchronize()
                graph = self.be.Graph()
                with self.be.graph(graph, pool=pool):
                    self.outputs[size] = self._graph_forward(size)
                self.graphs[size] = graph
            self.be.synchronize()

    def _graph_forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.bufs
        logits = self._forward(
            b["tokens"][:size], b["positions"][:size], b["slots"][:size], b["tables"][:size]
        )
        return logits, logits.argmax(-1)

    def _prepare(self, batch: Batch, size: int) -> None:
        mb = SPEC.max_blocks_per_req
        bs, null = SPEC.block_size, SPEC.null_block
        tok, pos, slot = [0] * size, [0] * size, [null * bs] * size
        tab = [[null] * mb for _ in range(size)]
        for i, r in enumerate(batch.requests):
            p = r.context_len
            tok[i], pos[i] = r.tokens[0], p
            slot[i] = r.block_ids[p // bs] * bs + p % bs
            tab[i][: len(r.block_ids)] = list(r.block_ids)
        b = self.bufs
        b["tokens"][:size].copy_(torch.tensor(tok))
        b["positions"][:size].copy_(torch.tensor(pos))
        b["slots"][:size].copy_(torch.tensor(slot))
        b["tables"][:size].copy_(torch.tensor(tab))

    # ---- contract ------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            n = batch.num_reqs
            decode = n > 0 and all(len(r.tokens) == 1 for r in batch.requests)
            size = next((s for s in SPEC.capture_sizes if s >= n), None)
            if self.mode == "graph" and decode and size is not None:
                self._prepare(batch, size)
                self.graphs[size].replay()
                logits, toks = self.outputs[size]
                return StepResult(
                    logits[:n].clone(), toks[:n].clone(), "full", ("decode", size), "uniform decode"
                )
            reason = "eager twin" if self.mode == "eager" else "not a decode step within a graph"
            return self._eager(batch, reason)

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        bs, mb, null = SPEC.block_size, SPEC.max_blocks_per_req, SPEC.null_block
        tok, pos, slot, tab, last = [], [], [], [], []
        for r in batch.requests:
            row = list(r.block_ids) + [null] * (mb - len(r.block_ids))
            for j, t in enumerate(r.tokens):
                p = r.context_len + j
                tok.append(t)
                pos.append(p)
                slot.append(r.block_ids[p // bs] * bs + p % bs)
                tab.append(row)
            last.append(len(tok) - 1)
        if not tok:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, empty.argmax(-1), "eager", None, reason)
        dev = self.device
        logits = self._forward(
            torch.tensor(tok, device=dev),
            torch.tensor(pos, device=dev),
            torch.tensor(slot, device=dev),
            torch.tensor(tab, device=dev),
        )[torch.tensor(last, device=dev)]
        return StepResult(logits, logits.argmax(-1), "eager", None, reason)

    def state(self) -> Mapping[str, torch.Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return dict(self.bufs) if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        raise NotImplementedError("no weight_update feature")

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SharedExpertMoERunner:
    return SharedExpertMoERunner(mode, seed=seed, backend=backend, clone_input=True)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SharedExpertMoERunner:
    return SharedExpertMoERunner(mode, seed=seed, backend=backend, clone_input=False)
