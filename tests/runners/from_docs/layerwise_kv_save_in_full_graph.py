"""A decode-graph runner with a layer-wise KV connector that saves each step's new KV to a store.

What it models
--------------
A two-layer paged-attention decoder (token + position embedding; per layer attention over a
slot-major KV cache read through block tables and a SiLU MLP; an LM head; Gumbel-max sampling
hashed from (seed, position, token id)) behind a KV connector in the style of vLLM's layer-wise
connectors (LMCache with ``use_layerwise``, pegaflow, MoRIIO): every token's keys and values are
*saved* into a second tier (``store_k`` / ``store_v``, one slot-major tensor per layer, a stand-in
for the connector's staging/CPU store), and a request that comes back after sitting out a step is
treated as swapped out and *loaded back* from that tier into its blocks before its step (the
scheduler-side connector tracks how much of each request it has stored, ``Entry.stored_len``).

Graph mode captures one FULL decode graph per capture size at start-up (largest first, one pool),
keyed by the padded row count; a batch whose every request has one query token and that fits a
graph replays it, everything else (prefill chunks, mixed batches, more rows than the largest
graph) runs eagerly. The save hook is Python: it reads the step's connector metadata (the slots
the step writes) on the host and issues the copies.

    make_target:        the save runs outside the captured region, after the forward or replay,
                        every step, with this step's slots: what vLLM's fix arranges by running
                        layer-wise connectors in PIECEWISE mode, where Python runs between graph
                        pieces.
    make_buggy_target:  the save hook is called inside the forward, after each layer's attention,
                        as the layer-wise decorator places it. Eager steps run it every time; in a
                        FULL graph it ran once, while capturing a batch made of padding rows only,
                        found nothing to save and recorded nothing. Every replay skips it, while
                        the scheduler-side bookkeeping still counts the tokens as stored. A
                        request that decoded on a graph, sat out a step and comes back is loaded
                        back with whatever the store held at the positions graph replays wrote
                        (zeros, or a finished request's keys), over its correct cache. A one-token
                        prompt replays a decode graph too, so its first position is lost as well.

Sources
-------
vLLM PR #31057, "[KVConnector] Auto-downgrade to PIECEWISE cudagraph mode for layerwise async ops"
(https://github.com/vllm-project/vllm/pull/31057): ``wait_for_layer_load`` and ``save_kv_layer``
run in a Python decorator around attention, which a FULL CUDA graph replay skips entirely; the fix
downgrades FULL to PIECEWISE for connectors that declare layer-wise operations
(``requires_piecewise_for_cudagraph``). The save side is spelled out in pegaflow issue #124
(https://github.com/novitalabs/pegaflow/issues/124: in FULL mode "save_kv_layer() is skipped -> KV
never saved") and in vllm-ascend PR #11917 (https://github.com/vllm-project/vllm-ascend/pull/11917:
a layer-wise save callback in a traced ``forward()`` "is not reliably invoked for each runtime
execution"; FULL graph replay left out of scope). The load side of the same PR (issue #29608, an
unawaited load) is a stream-ordering race, modelled in ``kv_swap_in_race``; this runner's loads are
ordered and its bug is a host hook recorded once at capture. No code was copied.

Contract notes
--------------
The harness allocates blocks and keeps a request's blocks while it sits out, so the load-back
rewrites bits the cache already holds whenever the store is complete: the correct runner's loads
are invisible. The load covers only positions the runner stored itself, from the request's first
token on (``stored_len``), since the harness restores and copies ``state()`` behind the runner's
back (kept twins, company twins) and a store entry is trusted only for the life that wrote it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime import backends

SPEC = TargetSpec(
    num_blocks=28,
    block_size=4,
    max_blocks_per_req=5,
    vocab_size=56,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling"}),
    null_block=0,
)
LAYERS, HIDDEN, HEADS, HEAD_DIM, FFN = 2, 32, 2, 16, 64
BS = SPEC.block_size
CONTEXT = SPEC.max_blocks_per_req * BS
NULL_SLOT = SPEC.null_block * BS
# integer columns of one token row: token id, position, KV slot, seed (-1: greedy), block table
TOKEN, POS, SLOT, SEED, TABLE = 0, 1, 2, 3, 4
NCOL = TABLE + SPEC.max_blocks_per_req


@dataclass(frozen=True)
class Entry:
    """The connector's scheduler-side record of a request: where its cache reaches, in which
    blocks, when it last ran, and how many leading positions it believes are in the store."""

    seq_len: int
    block_ids: tuple[int, ...]
    last_step: int
    stored_len: int


class LayerwiseConnectorRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, save_inside_forward: bool
    ) -> None:
        self.be = backends.get(backend)
        self.device = self.be.device
        self.mode = mode
        self.save_inside_forward = save_inside_forward
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape: int) -> Tensor:
            return (torch.randn(shape, generator=gen) / math.sqrt(shape[0])).to(self.device)

        self.embed, self.pos_embed = weight(SPEC.vocab_size, HIDDEN), weight(CONTEXT, HIDDEN)
        self.layers = [
            {name: weight(HIDDEN, HIDDEN) for name in ("q", "k", "v", "o")}
            | {"up": weight(HIDDEN, FFN), "down": weight(FFN, HIDDEN)}
            for _ in range(LAYERS)
        ]
        self.head = weight(HIDDEN, SPEC.vocab_size)

        kv_shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k = [torch.zeros(kv_shape, device=self.device) for _ in range(LAYERS)]
        self.v = [torch.zeros(kv_shape, device=self.device) for _ in range(LAYERS)]
        # the connector's store tier, slot-major like the cache (kept on the device so that a
        # save can sit inside a captured forward, as a GPU staging buffer's gather does)
        self.store_k = [torch.zeros(kv_shape, device=self.device) for _ in range(LAYERS)]
        self.store_v = [torch.zeros(kv_shape, device=self.device) for _ in range(LAYERS)]
        # constants the graphs read: kept as attributes for as long as the graphs live
        self.block_offsets = torch.arange(BS, device=self.device)
        self.context_positions = torch.arange(CONTEXT, device=self.device)

        self.entries: dict[int, Entry] = {}
        self.step_no = 0
        self.connector_slots: list[int] = []  # this step's connector metadata, read by the hook

        rows = max(SPEC.capture_sizes)
        self.static_rows = torch.zeros(rows, NCOL, dtype=torch.int64, device=self.device)
        self.static_temps = torch.ones(rows, device=self.device)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self._capture_all()

    # -- graphs ----------------------------------------------------------------------------------

    def _capture_all(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._prepare([], size)  # capture on a batch of padding rows only
            self._forward(self.static_rows[:size], self.static_temps[:size])  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self._forward(
                    self.static_rows[:size], self.static_temps[:size]
                )
            self.graphs[size] = graph

    def _graph_size(self, batch: Batch) -> int | None:
        if self.mode != "graph" or batch.num_reqs == 0 or set(batch.query_lens) != {1}:
            return None
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    def _prepare(self, requests: Sequence[Request], size: int) -> None:
        """Rewrite every row the graph reads: the batch in the prefix, padding rows after it."""
        rows = [self._token_row(r, 0) for r in requests]
        rows += [self._padding_row()] * (size - len(requests))
        temps = [float(r.temperature) for r in requests] + [1.0] * (size - len(requests))
        self.static_rows[:size].copy_(torch.tensor(rows, dtype=torch.int64))
        self.static_temps[:size].copy_(torch.tensor(temps, dtype=torch.float32))

    @staticmethod
    def _token_row(r: Request, i: int) -> list[int]:
        position = r.context_len + i
        table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
        seed = -1 if r.seed is None else r.seed & 0x7FFFFFFF
        return [r.tokens[i], position, kv_slot(r.block_ids, position, BS), seed, *table]

    @staticmethod
    def _padding_row() -> list[int]:
        return [0, 0, NULL_SLOT, -1] + [SPEC.null_block] * SPEC.max_blocks_per_req

    # -- the connector -----------------------------------------------------------------------

    def _save(self, slots: Sequence[int], layers: Sequence[int]) -> None:
        index = torch.tensor(slots, dtype=torch.int64).to(self.device)
        for layer in layers:
            self.store_k[layer].index_copy_(0, index, self.k[layer].index_select(0, index))
            self.store_v[layer].index_copy_(0, index, self.v[layer].index_select(0, index))

    def _save_kv_layer_hook(self, layer: int) -> None:
        """Python, run wherever the forward runs: asks the step's metadata what to save. Inside a
        capture that metadata is the padding batch's (nothing), and a replay never asks again."""
        if self.connector_slots:
            self._save(self.connector_slots, [layer])

    def _continues(self, e: Entry, r: Request) -> bool:
        return r.context_len == e.seq_len and tuple(r.block_ids[: len(e.block_ids)]) == e.block_ids

    def _load_returning(self, batch: Batch) -> None:
        """A request that sat out the previous step was swapped out: load its stored prefix back
        into its blocks, on the current stream, before anything of this step reads them."""
        slots: list[int] = []
        for r in batch.requests:
            e = self.entries.get(r.req_id)
            if e is None or r.context_len == 0 or e.last_step >= self.step_no - 1:
                continue
            if self._continues(e, r):
                stored = min(r.context_len, e.stored_len)
                slots += [kv_slot(r.block_ids, p, BS) for p in range(stored)]
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.int64).to(self.device)
        for layer in range(LAYERS):
            self.k[layer].index_copy_(0, index, self.store_k[layer].index_select(0, index))
            self.v[layer].index_copy_(0, index, self.store_v[layer].index_select(0, index))

    def _remember(self, batch: Batch) -> None:
        """Scheduler-side bookkeeping: the step's tokens count as stored once the step ran."""
        for r in batch.requests:
            e = self.entries.get(r.req_id)
            if r.context_len == 0:
                stored = r.seq_len
            elif e is not None and self._continues(e, r):
                stored = r.seq_len if e.stored_len >= r.context_len else e.stored_len
            else:
                stored = 0  # a life this runner did not see from its first token
            self.entries[r.req_id] = Entry(r.seq_len, tuple(r.block_ids), self.step_no, stored)

    # -- steps -----------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        self._load_returning(batch)
        self.connector_slots = [
            kv_slot(r.block_ids, p, BS)
            for r in batch.requests
            for p in range(r.context_len, r.seq_len)
        ]
        size = self._graph_size(batch)
        result = self._replay(batch, size) if size is not None else self._run_eager(batch)
        if not self.save_inside_forward and self.connector_slots:
            self._save(self.connector_slots, range(LAYERS))  # outside any graph: every step
        self.connector_slots = []
        self._remember(batch)
        self.step_no += 1
        return result

    def _replay(self, batch: Batch, size: int) -> StepResult:
        self._prepare(batch.requests, size)
        self.graphs[size].replay()  # type: ignore[attr-defined]
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def _run_eager(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=self.device),
                torch.zeros(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason="empty batch",
            )
        rows, temps, last = [], [], []
        for r in batch.requests:
            for i in range(r.query_len):
                rows.append(self._token_row(r, i))
                temps.append(float(r.temperature))
            last.append(len(rows) - 1)
        logits, tokens = self._forward(
            torch.tensor(rows, dtype=torch.int64).to(self.device),
            torch.tensor(temps, dtype=torch.float32).to(self.device),
        )
        picked = torch.tensor(last, dtype=torch.int64).to(self.device)
        reason = "eager twin" if self.mode == "eager" else "no decode graph for this batch"
        return StepResult(logits[picked], tokens[picked], "eager", None, reason=reason)

    # -- model -----------------------------------------------------------------------------------

    def _forward(self, rows: Tensor, temps: Tensor) -> tuple[Tensor, Tensor]:
        pos, slot, table = rows[:, POS], rows[:, SLOT], rows[:, TABLE:]
        x = self.embed[rows[:, TOKEN]] + self.pos_embed[pos]
        context_slots = (table[:, :, None] * BS + self.block_offsets).flatten(1)
        visible = self.context_positions[None, :] <= pos[:, None]
        for layer, w in enumerate(self.layers):
            x = x + self._attention(layer, w, x, slot, context_slots, visible)
            if self.save_inside_forward:
                self._save_kv_layer_hook(layer)  # where the layer-wise decorator puts it
            x = x + torch.nn.functional.silu(x @ w["up"]) @ w["down"]
        logits = x @ self.head
        return logits, self._sample(logits, rows[:, SEED], pos, temps)

    def _attention(
        self,
        layer: int,
        w: dict[str, Tensor],
        x: Tensor,
        slot: Tensor,
        context_slots: Tensor,
        visible: Tensor,
    ) -> Tensor:
        q = (x @ w["q"]).view(-1, HEADS, HEAD_DIM)
        # store this step's keys and values first: a token attends to itself through the cache
        self.k[layer].index_copy_(0, slot, (x @ w["k"]).view(-1, HEADS, HEAD_DIM))
        self.v[layer].index_copy_(0, slot, (x @ w["v"]).view(-1, HEADS, HEAD_DIM))
        mask = visible[:, :, None, None]
        zero = torch.zeros((), device=self.device)
        # masked slots may hold NaN (the poisoned null block): replace them, never multiply
        keys = torch.where(mask, self.k[layer][context_slots], zero)
        values = torch.where(mask, self.v[layer][context_slots], zero)
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        attended = torch.einsum("thc,tchd->thd", scores.softmax(-1), values)
        return attended.flatten(1) @ w["o"]

    @staticmethod
    def _sample(logits: Tensor, seeds: Tensor, pos: Tensor, temps: Tensor) -> Tensor:
        """Gumbel-max from an integer hash of (seed, position, token id); greedy where seed < 0."""
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        h = (
            seeds[:, None] * 2654435761 + pos[:, None] * 40503 + vocab[None, :] * 69069
        ) & 0xFFFFFFFF
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        h = h ^ (h >> 16)
        uniform = ((h & 0xFFFFFF).to(torch.float32) + 0.5) / float(1 << 24)
        sampled = (logits / temps[:, None] - torch.log(-torch.log(uniform))).argmax(-1)
        return torch.where(seeds >= 0, sampled, logits.argmax(-1))

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()  # type: ignore[attr-defined]
        self.graphs.clear()
        self.outputs.clear()


class LayerwiseConnectorTarget:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, save_inside_forward: bool
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.runner = LayerwiseConnectorRunner(
            mode, seed=seed, backend=backend, save_inside_forward=save_inside_forward
        )

    def step(self, batch: Batch) -> StepResult:
        return self.runner.step(batch)

    def state(self) -> Mapping[str, Tensor]:
        state = {f"k{i}": k for i, k in enumerate(self.runner.k)}
        return state | {f"v{i}": v for i, v in enumerate(self.runner.v)}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode != "graph":
            return {}
        return {"rows": self.runner.static_rows, "temps": self.runner.static_temps}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        raise NotImplementedError("this runner does not declare weight_update")

    def close(self) -> None:
        self.runner.close()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> LayerwiseConnectorTarget:
    return LayerwiseConnectorTarget(mode, seed=seed, backend=backend, save_inside_forward=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> LayerwiseConnectorTarget:
    return LayerwiseConnectorTarget(mode, seed=seed, backend=backend, save_inside_forward=True)
