"""A vLLM-V0-style decode graph runner with a ``max_seq_len_to_capture`` guard.

The runner follows vLLM's V0 ``ModelRunner``/``CUDAGraphRunner`` design: decode-only CUDA
graphs, one per batch size, captured at start-up into one shared memory pool, largest first,
with every row padding during warm-up and capture. The graphs read one set of static inputs
(token ids, positions, slot mapping and a block table) allocated once at the largest capture
size. As in vLLM, the graphs' block table (``graph_block_tables``) is only as wide as
``max_seq_len_to_capture`` needs, not as wide as the longest sequence the model serves: a
decode batch whose longest sequence exceeds ``max_seq_len_to_capture`` must run eagerly. The
attention metadata builder decides that (``use_captured_graph``) from the batch's longest decode
sequence, ``max_decode_seq_len``. Prefill and mixed batches, and batches larger than the largest
capture size, run eagerly too. Decoding is greedy only (no "sampling" feature): the next token is
the logits' argmax, computed inside the graph.

The model is one decoder layer: token and learned position embeddings, one attention head over a
slot-major paged KV cache read through block tables (masked by slot position <= token position,
masked values zeroed with ``torch.where``), a SiLU MLP and an LM head, in float32.

The bug (``make_buggy_target``): vLLM PR #9285, "Fixes a typo about 'max_decode_seq_len' which
causes crashes with cuda graph" (https://github.com/vllm-project/vllm/pull/9285): the guard
that keeps sequences longer than ``max_seq_len_to_capture`` off the graphs read the wrong
length, so "sequences that [are] longer than max_seq_len_to_capture still be treated as cuda
graph captured, causing crashes". Here the buggy guard reads the batch's longest *prefill*
sequence (zero in a decode batch) where it should read the longest decode sequence, so a
long-context decode batch is routed onto a graph whose block table cannot hold its blocks;
filling the static table then fails, as vLLM's numpy copy into ``graph_block_tables`` did.

What the contract could not express: nothing essential. ``max_seq_len_to_capture`` is the
runner's own setting (half the longest sequence of the spec); the contract has no field for it,
so the harness reaches it only by scheduling long enough decodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=64,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=64,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "weight_update"}),
)
MAX_SEQ_LEN_TO_CAPTURE = 16  # the graphs' block table is 16 / block_size columns wide
HIDDEN = 32
HEAD_DIM = 16
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size


def _weights(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    return {
        "embed": rand(SPEC.vocab_size, HIDDEN, scale=1.0),
        "pos": rand(MAX_POS, HIDDEN, scale=0.5),
        "wq": rand(HIDDEN, HEAD_DIM, scale=HIDDEN**-0.5),
        "wk": rand(HIDDEN, HEAD_DIM, scale=HIDDEN**-0.5),
        "wv": rand(HIDDEN, HEAD_DIM, scale=HIDDEN**-0.5),
        "wo": rand(HEAD_DIM, HIDDEN, scale=HEAD_DIM**-0.5),
        "w1": rand(HIDDEN, 2 * HIDDEN, scale=HIDDEN**-0.5),
        "w2": rand(2 * HIDDEN, HIDDEN, scale=(2 * HIDDEN) ** -0.5),
        "head": rand(HIDDEN, SPEC.vocab_size, scale=HIDDEN**-0.5),
    }


class LongContextRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, buggy: bool
    ) -> None:
        self.mode = mode
        self.buggy = buggy
        self.backend = get_backend(backend)
        self.device = self.backend.device
        self.spec = SPEC
        self.w = _weights(seed, self.device)
        slots = SPEC.num_blocks * SPEC.block_size
        self.k_cache = torch.zeros(slots, 1, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(slots, 1, HEAD_DIM, device=self.device)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.static: dict[str, torch.Tensor] = {}
        if mode == "graph":
            n = max(SPEC.capture_sizes)
            width = MAX_SEQ_LEN_TO_CAPTURE // SPEC.block_size
            self.static = {
                "tokens": torch.zeros(n, dtype=torch.long, device=self.device),
                "positions": torch.zeros(n, dtype=torch.long, device=self.device),
                "slots": torch.zeros(n, dtype=torch.long, device=self.device),
                "graph_block_tables": torch.zeros(n, width, dtype=torch.long, device=self.device),
            }
            self._capture()

    # --- model -------------------------------------------------------------------------------
    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of ``tables`` (the row's request's block table)."""
        w = self.w
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = x @ w["wq"], x @ w["wk"], x @ w["wv"]
        self.k_cache[slots] = k.unsqueeze(1)
        self.v_cache[slots] = v.unsqueeze(1)
        bs = SPEC.block_size
        offsets = torch.arange(bs, device=self.device)
        ctx_slots = (tables.unsqueeze(-1) * bs + offsets).flatten(1)  # [rows, width * bs]
        slot_pos = torch.arange(ctx_slots.shape[1], device=self.device)
        mask = slot_pos.unsqueeze(0) <= positions.unsqueeze(1)
        keys = torch.where(mask.unsqueeze(-1), self.k_cache[ctx_slots, 0], 0.0)
        values = torch.where(mask.unsqueeze(-1), self.v_cache[ctx_slots, 0], 0.0)
        scores = (keys @ q.unsqueeze(-1)).squeeze(-1) * HEAD_DIM**-0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        attn = (probs.unsqueeze(1) @ values).squeeze(1)
        h = x + attn @ w["wo"]
        h = h + torch.nn.functional.silu(h @ w["w1"]) @ w["w2"]
        logits = h @ w["head"]
        return logits, logits.argmax(dim=-1)

    # --- graph mode ----------------------------------------------------------------------------
    def _prepare(self, batch: Batch, size: int) -> None:
        """Write the decode batch into the static inputs, padding rows up to ``size``."""
        s = self.static
        null = SPEC.null_block
        s["tokens"][:size] = 0
        s["positions"][:size] = 0
        s["slots"][:size] = null * SPEC.block_size
        s["graph_block_tables"][:size] = null
        for i, r in enumerate(batch.requests):
            pos = r.context_len
            s["tokens"][i] = r.tokens[0]
            s["positions"][i] = pos
            s["slots"][i] = r.block_ids[pos // SPEC.block_size] * SPEC.block_size + (
                pos % SPEC.block_size
            )
            table = torch.tensor(r.block_ids, dtype=torch.long)
            s["graph_block_tables"][i, : len(r.block_ids)] = table.to(self.device)

    def _run_static(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.static
        return self._forward(
            s["tokens"][:size],
            s["positions"][:size],
            s["slots"][:size],
            s["graph_block_tables"][:size],
        )

    def _capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        with torch.no_grad():
            for size in sorted(SPEC.capture_sizes, reverse=True):
                self._prepare(Batch(()), size)
                self._run_static(size)  # warm-up outside the graph
                self.backend.synchronize()
                graph = self.backend.Graph()
                with self.backend.graph(graph, pool=pool):
                    self.outputs[size] = self._run_static(size)
                self.graphs[size] = graph
            self.backend.synchronize()

    def _use_captured_graph(self, batch: Batch) -> bool:
        decode = [r.seq_len for r in batch.requests if r.query_len == 1 and r.context_len > 0]
        prefill = [r.seq_len for r in batch.requests if r.context_len == 0]
        max_decode_seq_len = max(decode, default=0)
        max_prefill_seq_len = max(prefill, default=0)
        # the typo: the prefill length guards the graphs
        longest = max_prefill_seq_len if self.buggy else max_decode_seq_len
        return longest <= MAX_SEQ_LEN_TO_CAPTURE

    def _fallback_reason(self, batch: Batch) -> str | None:
        if not batch.requests:
            return "empty batch"
        if any(r.query_len != 1 or r.context_len == 0 for r in batch.requests):
            return "prefill or mixed batch"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "batch above the largest capture size"
        if not self._use_captured_graph(batch):
            return "sequence longer than max_seq_len_to_capture"
        return None

    # --- contract -------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        with torch.no_grad():
            reason = "eager twin" if self.mode == "eager" else self._fallback_reason(batch)
            if reason is None:
                size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
                self._prepare(batch, size)
                self.graphs[size].replay()
                logits, tokens = self.outputs[size]
                n = batch.num_reqs
                return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", size)
            return self._eager(batch, reason)

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        if not batch.requests:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.long), "eager", None, reason)
        bs = SPEC.block_size
        tokens, positions, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            row = list(r.block_ids) + [SPEC.null_block] * (
                SPEC.max_blocks_per_req - len(r.block_ids)
            )
            for j, tok in enumerate(r.tokens):
                pos = r.context_len + j
                tokens.append(tok)
                positions.append(pos)
                slots.append(r.block_ids[pos // bs] * bs + pos % bs)
                tables.append(row)
            last.append(len(tokens) - 1)

        def dev(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device)

        logits, next_tokens = self._forward(dev(tokens), dev(positions), dev(slots), dev(tables))
        idx = dev(last)
        return StepResult(logits[idx].clone(), next_tokens[idx].clone(), "eager", None, reason)

    def state(self) -> Mapping[str, torch.Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return self.static

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        new = _weights(seed + 1_000_003, self.device)
        for name, tensor in self.w.items():
            tensor.copy_(new[name])  # in place: the graphs keep reading these tensors

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> LongContextRunner:
    return LongContextRunner(mode, seed=seed, backend=backend, buggy=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> LongContextRunner:
    return LongContextRunner(mode, seed=seed, backend=backend, buggy=True)
