"""A graph runner that samples inside its decode graphs from private per-row CUDA generators.

The model is a one-layer decoder written against plain `torch.cuda` (the "No port" drop-in path):
token embedding plus learned positions, attention over a paged KV cache (slot-major `[slots,
heads, dim]`, read through block tables, masked by position), an LM head, float32, weights drawn
from the seed. Sampling is Gumbel-max: exponential noise `q`, token `argmax(logits / T - log q)`,
greedy rows take `argmax(logits)`. The noise of row i comes from the sampler's own
`torch.Generator(device="cuda")` number i, never from torch's default generator: before every step
the host reseeds it from the row's request seed and position (splitmix64), so a request draws the
same noise in any row, batch or bucket.

Graph mode: one `torch.cuda.CUDAGraph` per capture size (1, 2, 4, 8 rows), captured at start-up,
largest first, into one pool, keyed `("decode", size)`. A step whose requests all have one query
token, and at most 8 of them, writes its rows (token, position, slot, block table), temperatures
and sampled flags into the static buffers' prefix, points padding rows at the null block, reseeds
the row generators, replays the smallest graph that fits and copies the results out. The forward
and the sampler's draws are inside the graph. Prefill, mixed and larger batches run eagerly through
the same forward, which the eager twin uses for every step.

    make_target:        registers each row generator with every graph it is captured into
                        (`CUDAGraph.register_generator_state`) before the capture, so a replay
                        reads the generator's philox seed and offset as the host left them, and
                        the per-step reseed reaches the draws inside the graph.
    make_buggy_target:  captures the same draws without registering the generators. The graph
                        does not own their philox state, so nothing carries the host's per-step
                        seeds into a replay: on a GPU torch either refuses the capture (torch
                        2.11 on an H200: "Attempt to increase offset for a CUDA generator not in
                        capture mode") or, where a runtime lets it through, bakes the capture's
                        seed and offset into the graph so that every replay repeats the capture's
                        noise whatever the requests' seeds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NULL_BLOCK = 0  # padding rows read and write this block only

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
    null_block=NULL_BLOCK,
)
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
ROWS = max(SPEC.capture_sizes)
_MASK64 = (1 << 64) - 1


def row_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position), 63 bits: the generator seed of a sampled row."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class Sampler:
    """Gumbel-max sampling with one private generator per row, reseeded on the host every step."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.generators = [torch.Generator(device=device) for _ in range(rows)]

    def seed(self, requests: Sequence[Request], rows: int) -> None:
        """Row i draws from its request's (seed, last position); greedy and padding rows from 0,
        so that what a row draws never depends on an earlier step."""
        for i, generator in enumerate(self.generators[:rows]):
            request = requests[i] if i < len(requests) else None
            if request is None or request.seed is None:
                generator.manual_seed(0)
            else:
                generator.manual_seed(row_seed(request.seed, request.seq_len - 1))

    def __call__(self, logits: Tensor, temperatures: Tensor, sampled: Tensor) -> Tensor:
        noise = torch.empty_like(logits)  # [R, V]
        # One draw of [V] per row from that row's generator: the same values in any batch size.
        for row, generator in zip(noise, self.generators[: len(noise)], strict=True):
            row.exponential_(generator=generator)
        scores = logits / temperatures[:, None] - noise.log()
        return torch.where(sampled, scores.argmax(-1), logits.argmax(-1))


class SamplingRunner:
    """`graphs=True` captures decode graphs at start-up; `graphs=False` always runs eagerly."""

    def __init__(self, *, graphs: bool, seed: int, register_generators: bool) -> None:
        self.device = torch.device("cuda")
        self.register_generators = register_generators
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {n: torch.empty(s, device=self.device) for n, s in shapes.items()}
        self.load_weights(seed)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=self.device)
        self.sampler = Sampler(SPEC.max_num_reqs, self.device)
        width = 3 + SPEC.max_blocks_per_req
        self.static = {
            "rows": torch.zeros(ROWS, width, dtype=torch.int64, device=self.device),
            "temperatures": torch.ones(ROWS, device=self.device),
            "sampled": torch.zeros(ROWS, dtype=torch.bool, device=self.device),
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if graphs:
            self._capture()

    def load_weights(self, seed: int) -> None:
        """(Re)initialise in place: captured graphs keep reading the same tensors."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    # -- graphs ---------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._prepare([], size)  # every row is padding during warm-up and capture
            self._replayable(size)  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            if self.register_generators:
                for generator in self.sampler.generators[:size]:
                    graph.register_generator_state(generator)
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._replayable(size)
            self.graphs[size] = graph

    def _replayable(self, size: int) -> tuple[Tensor, Tensor]:
        rows = self.static["rows"][:size]
        temperatures = self.static["temperatures"][:size]
        return self._forward(rows, None, temperatures, self.static["sampled"][:size])

    def capture_size(self, rows: int) -> int | None:
        return next((s for s in SPEC.capture_sizes if s >= rows), None)

    def _prepare(self, requests: Sequence[Request], size: int) -> None:
        """Write the requests, then padding rows, into every row of the graph's static buffers."""
        pad = size - len(requests)
        rows = [_row(r, r.seq_len - 1, r.tokens[-1]) for r in requests] + [_padding()] * pad
        self.static["rows"][:size].copy_(torch.tensor(rows, dtype=torch.int64))
        temperatures = [r.temperature for r in requests] + [1.0] * pad
        self.static["temperatures"][:size].copy_(torch.tensor(temperatures))
        sampled = [r.seed is not None for r in requests] + [False] * pad
        self.static["sampled"][:size].copy_(torch.tensor(sampled))
        self.sampler.seed(requests, size)

    def decode(self, requests: Sequence[Request]) -> tuple[Tensor, Tensor, int]:
        """Replay the smallest graph that fits one query token per request."""
        size = self.capture_size(len(requests))
        if size is None or size not in self.graphs:
            raise ValueError(f"no decode graph for {len(requests)} rows")
        self._prepare(requests, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = len(requests)
        return logits[:n].clone(), tokens[:n].clone(), size  # the next replay rewrites them

    # -- eager ----------------------------------------------------------------------------------

    def eager(self, requests: Sequence[Request]) -> tuple[Tensor, Tensor]:
        """Any query lengths; results at each request's last query token."""
        rows, last = [], []
        for request in requests:
            for i, token in enumerate(request.tokens):
                rows.append(_row(request, request.context_len + i, token))
            last.append(len(rows) - 1)
        self.sampler.seed(requests, len(requests))
        device_rows = torch.tensor(rows, dtype=torch.int64).to(self.device)
        index = torch.tensor(last, dtype=torch.int64).to(self.device)
        temperatures = torch.tensor([r.temperature for r in requests]).to(self.device)
        sampled = torch.tensor([r.seed is not None for r in requests]).to(self.device)
        return self._forward(device_rows, index, temperatures, sampled)

    # -- the model ------------------------------------------------------------------------------

    def _forward(
        self, rows: Tensor, last: Tensor | None, temperatures: Tensor, sampled: Tensor
    ) -> tuple[Tensor, Tensor]:
        """`rows`: [T, 3 + max_blocks] (token, position, slot, block table); logits and tokens at
        the `last` rows (every row where None)."""
        w = self.weights
        tokens, positions, slots, tables = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:]
        x = w["embed"][tokens] + w["pos"][positions]  # [T, H]
        q, k, v = (x @ w[n] for n in "qkv")
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(SPEC.block_size, device=self.device)
        context = (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, C] slots
        keys, values = self.k_cache[context], self.v_cache[context]  # [T, C, heads, dim]
        visible = torch.arange(CONTEXT, device=self.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        probs = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        # Masked slots may hold anything, NaN in the null block: 0 * NaN would leak it.
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        attended = torch.einsum("thc,tchd->thd", probs.softmax(-1), values).flatten(1)
        hidden = x + attended @ w["o"]
        if last is not None:
            hidden = hidden[last]
        logits = hidden @ w["head"]  # [R, V]
        return logits, self.sampler(logits, temperatures, sampled)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def _row(request: Request, position: int, token: int) -> list[int]:
    table = list(request.block_ids)
    table += [NULL_BLOCK] * (SPEC.max_blocks_per_req - len(table))
    return [token, position, kv_slot(request.block_ids, position, SPEC.block_size), *table]


def _padding() -> list[int]:
    return [0, 0, NULL_BLOCK * SPEC.block_size] + [NULL_BLOCK] * SPEC.max_blocks_per_req


# -- the contract ---------------------------------------------------------------------------------


class SamplingTarget:
    """Graph twin: decode batches replay the runner's graphs. Eager twin: the runner without them."""

    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, register_generators: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.runner = SamplingRunner(
            graphs=mode == "graph", seed=seed, register_generators=register_generators
        )

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(n != 1 for n in batch.query_lens):
            return "a request with more than one query token"
        if self.runner.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            logits, tokens, size = self.runner.decode(batch.requests)
            return StepResult(logits, tokens, "full", ("decode", size))
        if batch.num_reqs == 0:
            logits = torch.zeros(0, SPEC.vocab_size, device=self.runner.device)
            tokens = torch.zeros(0, dtype=torch.int64, device=self.runner.device)
        else:
            logits, tokens = self.runner.eager(batch.requests)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.runner.k_cache, "v": self.runner.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.runner.static if self.runner.graphs else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.load_weights(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SamplingTarget:
    # `backend` is not the runner's business: on sim the harness's drop-in is active around it.
    return SamplingTarget(mode, seed=seed, register_generators=True)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SamplingTarget:
    return SamplingTarget(mode, seed=seed, register_generators=False)
