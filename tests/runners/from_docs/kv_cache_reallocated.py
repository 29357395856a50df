"""A graph runner that offloads its KV cache to the host and brings it back around a weight reload.

The model is a two-layer decoder in float32 (token embedding plus learned positions; per layer an
RMS norm, attention over a paged KV cache and a SiLU MLP; an LM head), greedy, with weights drawn
from the seed. Its KV cache is one tensor `[layers, k/v, blocks, block_size, heads, head_dim]`,
exposed slot-major through `state()` as one view per layer and kind. Graph mode is written against
plain `torch.cuda`: at start-up one `torch.cuda.CUDAGraph` per capture size is captured with
`torch.cuda.graph`, largest first into one pool, keyed by the number of decode rows (one query
token per request); a replay writes the rows into the static buffers' prefix, points the padding
rows at the null block and copies the results out. Prefill, mixed and speculative steps and batches
above the largest size run eagerly, on the same weights and cache.

`update_weights(seed)` is the reload an RL trainer asks of its rollout engine between rollouts
(vLLM's sleep / wake_up, SGLang's release / resume_memory_occupation): sleep offloads the KV cache
to host memory so that the trainer can use the device, the new weights are copied into the weight
tensors in place, and wake-up brings the cache back.

    make_target:        wake-up copies the offloaded cache back into the kept device tensor, as a
                        memory saver that remaps the same virtual addresses does, so every graph
                        captured before the reload keeps writing and reading the tensor `state()`
                        and the eager steps use.
    make_buggy_target:  wake-up uploads the offloaded cache into a fresh device tensor and binds it
                        to `kv_cache`. The eager steps and `state()` follow the attribute, but a
                        graph holds the address it was captured with: on a GPU its replays keep
                        writing keys and values into the old tensor, a block the caching allocator
                        has taken back and may hand to anything else, and read attention context
                        from it, so the cache the engine sees never gets those tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 2, 16, 2
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size  # positions a request can reach
NULL_SLOT = SPEC.null_block * SPEC.block_size
_INPUTS = ("tokens", "positions", "slots", "tables")


class ReloadingRunner:
    """The engine's model runner. `graphs=True` captures decode graphs at start-up;
    `realloc_on_wake=True` brings the KV cache back into a new tensor at wake-up."""

    def __init__(self, *, graphs: bool, seed: int, realloc_on_wake: bool) -> None:
        self.device = torch.device("cuda")
        self.realloc_on_wake = realloc_on_wake
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            **{f"{n}{i}": (HIDDEN, HIDDEN) for i in range(LAYERS) for n in "qkvo"},
            **{f"up{i}": (HIDDEN, 2 * HIDDEN) for i in range(LAYERS)},
            **{f"down{i}": (2 * HIDDEN, HIDDEN) for i in range(LAYERS)},
        }
        self.weights = {n: torch.empty(s, device=self.device) for n, s in shapes.items()}
        self.load_weights(seed)
        self.kv_cache = torch.zeros(
            LAYERS, 2, SPEC.num_blocks, SPEC.block_size, HEADS, HEAD_DIM, device=self.device
        )
        rows = SPEC.capture_sizes[-1]
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if graphs:
            self.buffers = {
                name: torch.zeros(rows, dtype=torch.int64, device=self.device)
                for name in _INPUTS[:3]
            }
            self.buffers["tables"] = torch.zeros(
                rows, SPEC.max_blocks_per_req, dtype=torch.int64, device=self.device
            )
            self.capture()

    # -- weights and reload -----------------------------------------------------------------------

    def load_weights(self, seed: int) -> None:
        """In place: the captured graphs read these tensors' addresses."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):  # a fixed order: same seed, same weights
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    def reload(self, seed: int) -> None:
        """Sleep, load new weights, wake up: the trainer may use the device in between."""
        offloaded = self.sleep()
        self.load_weights(seed)
        self.wake_up(offloaded)

    def sleep(self) -> Tensor:
        """Offload the KV cache: requests still running keep their context across the reload."""
        torch.cuda.synchronize()
        return self.kv_cache.to("cpu")

    def wake_up(self, offloaded: Tensor) -> None:
        if self.realloc_on_wake:
            self.kv_cache = offloaded.to(self.device)
        else:
            # The cache tensor keeps its address, so the graphs captured with it stay valid.
            self.kv_cache.copy_(offloaded)

    def kv_views(self) -> dict[str, Tensor]:
        """Slot-major views: [num_blocks * block_size, heads, head_dim] per layer and kind."""
        return {
            f"{kind}{layer}": self.kv_cache[layer, j].view(SPEC.num_slots, HEADS, HEAD_DIM)
            for layer in range(LAYERS)
            for j, kind in enumerate("kv")
        }

    # -- graphs -----------------------------------------------------------------------------------

    def capture(self) -> None:
        """Largest first into one pool, so smaller graphs reuse the largest one's memory."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(SPEC.capture_sizes):
            self.prepare([], size)  # every row is padding during warm-up and capture
            inputs = self.static_inputs(size)
            self.forward(*inputs)  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(*inputs)
            self.graphs[size] = graph

    def static_inputs(self, size: int) -> tuple[Tensor, ...]:
        return tuple(self.buffers[name][:size] for name in _INPUTS)

    def capture_size(self, rows: int) -> int | None:
        return next((s for s in SPEC.capture_sizes if s >= rows), None)

    def prepare(self, rows: Sequence[tuple[int, int, int, list[int]]], size: int) -> None:
        """Write the rows into the buffers' prefix and reset rows n..size to the null block."""
        n = len(rows)
        for i, name in enumerate(_INPUTS):
            buffer = self.buffers[name]
            if n:
                buffer[:n].copy_(torch.tensor([row[i] for row in rows], dtype=torch.int64))
            buffer[n:size].fill_(NULL_SLOT if name == "slots" else SPEC.null_block)

    def replay(self, rows: Sequence[tuple[int, int, int, list[int]]]) -> tuple[Tensor, Tensor, int]:
        size = self.capture_size(len(rows))
        if size is None:
            raise ValueError(f"no decode graph for {len(rows)} rows")
        self.prepare(rows, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = len(rows)
        return logits[:n].clone(), tokens[:n].clone(), size  # the next replay rewrites them

    # -- eager ------------------------------------------------------------------------------------

    def eager(
        self, rows: Sequence[tuple[int, int, int, list[int]]], last: Sequence[int]
    ) -> tuple[Tensor, Tensor]:
        columns = [
            torch.tensor([row[i] for row in rows], dtype=torch.int64, device=self.device)
            for i in range(len(_INPUTS))
        ]
        logits, tokens = self.forward(*columns)
        index = torch.tensor(list(last), dtype=torch.int64, device=self.device)
        return logits[index], tokens[index]

    # -- the model --------------------------------------------------------------------------------

    def forward(
        self, tokens: Tensor, positions: Tensor, slots: Tensor, tables: Tensor
    ) -> tuple[Tensor, Tensor]:
        """No host reads, so a decode step can be captured. T tokens: tables [T, max_blocks]."""
        w = self.weights
        x = w["embed"][tokens] + w["pos"][positions]  # [T, hidden]
        for i in range(LAYERS):
            k_cache = self.kv_cache[i, 0].view(SPEC.num_slots, HEADS, HEAD_DIM)
            v_cache = self.kv_cache[i, 1].view(SPEC.num_slots, HEADS, HEAD_DIM)
            h = _rms(x)
            q, k, v = (h @ w[f"{n}{i}"] for n in "qkv")
            k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
            v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
            x = x + _attention(q, k_cache, v_cache, positions, tables) @ w[f"o{i}"]
            x = x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        logits = _rms(x) @ w["head"]  # [T, vocab]
        return logits, logits.argmax(-1)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor, tables: Tensor
) -> Tensor:
    offsets = torch.arange(SPEC.block_size, device=q.device)
    context = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT] slots
    keys, values = k_cache[context], v_cache[context]  # [T, CONTEXT, heads, dim]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    # Masked slots may hold anything (NaN in the null block): 0 * NaN would leak it.
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)  # [T, hidden]


def _table(request: Request) -> list[int]:
    return list(request.block_ids) + [SPEC.null_block] * (
        SPEC.max_blocks_per_req - len(request.block_ids)
    )


def _rows(request: Request) -> list[tuple[int, int, int, list[int]]]:
    """(token, position, slot, block table) of each query token."""
    table = _table(request)
    return [
        (token, pos, kv_slot(request.block_ids, pos, SPEC.block_size), table)
        for pos, token in enumerate(request.tokens, start=request.context_len)
    ]


class ReloadingTarget:
    """The adapter: decode batches that fit a graph replay it on the graph twin; the rest, and
    every step of the eager twin, run eagerly."""

    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, realloc_on_wake: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.runner = ReloadingRunner(
            graphs=mode == "graph", seed=seed, realloc_on_wake=realloc_on_wake
        )

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode (query length > 1)"
        if self.runner.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            logits, tokens, size = self.runner.replay([_rows(r)[0] for r in batch.requests])
            return StepResult(logits, tokens, "full", ("decode", size))
        rows: list[tuple[int, int, int, list[int]]] = []
        last = []
        for request in batch.requests:
            rows.extend(_rows(request))
            last.append(len(rows) - 1)
        if not rows:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.runner.device)
            none = torch.zeros(0, dtype=torch.int64, device=self.runner.device)
            return StepResult(empty, none, "eager", None, reason=reason)
        logits, tokens = self.runner.eager(rows, last)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return self.runner.kv_views()

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.runner.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.reload(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ReloadingTarget:
    # `backend` is not the runner's business: on sim the harness's drop-in is active around it.
    return ReloadingTarget(mode, seed=seed, realloc_on_wake=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> ReloadingTarget:
    return ReloadingTarget(mode, seed=seed, realloc_on_wake=True)
