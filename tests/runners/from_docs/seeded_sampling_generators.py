"""A decode-graph runner whose sampler gives seeded requests their own device `torch.Generator`.

What it is: a one-layer paged-KV decoder written against plain `torch.cuda` (on sim the harness's
drop-in makes that the sim). Decode batches of up to 4 requests replay one CUDA graph per capture
size (1, 2, 4); prefill, mixed, speculative and larger batches run eagerly. Sampling follows
vLLM's sampler in shape: greedy rows take the batch path (argmax inside the graph), and every
request that carries a seed gets a device generator of its own, created the first time the
request appears (seeded from its seed), kept while it keeps appearing, dropped at the first step
it is absent. Its draw is an exponential race (`probs / Exp(1)`, argmax).

How a seeded draw stays a function of (seed, position) only, as docs/contract.md asks:

- eagerly, before the draw the request's generator is re-seeded from `mix(seed, position)` (the
  position of the request's last query token), then draws `vocab` exponentials;
- in a graph, one generator per graph row is registered with every graph that has that row
  (`CUDAGraph.register_generator_state`, before the capture); before each replay the runner
  re-seeds the request's generator the same way and copies its state into the row's registered
  generator (`set_state`), so the replay draws exactly what the eager path draws (same seed, offset
  0, same number of elements), whatever row, bucket or company the request has.

The bug (`make_buggy_target`): seeded rows draw from one shared "batch" generator instead, seeded
with a request's seed when that request first appears (the "set the seed before generation" fix
proposed for vLLM, https://github.com/vllm-project/vllm/pull/1637, which the maintainers rejected
because "the batching behavior will change the sample outputs of each individual request even if
you fixed the seed at the beginning"; per-request generators came with
https://github.com/vllm-project/vllm/pull/2514). The generator is registered with every graph, so
each replay advances it whatever rows are present: a request's token depends on its row, on its
company and on how many steps ran before it joined. Same family: vLLM issue
https://github.com/vllm-project/vllm/issues/51226 (a seeded request's output depends on whether
another request in its batch has a seed) and SGLang-omni PR
https://github.com/sgl-project/sglang-omni/pull/398 (a graph-captured sampler drawing from the
global generator: "the captured offset interacts ... with batch composition").
No code was copied from those projects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

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
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
_M64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position), kept below 2**63: the seed of one request's draw."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 1


def sample_position(request: Request) -> int:
    return request.context_len + len(request.tokens) - 1


class TinyModel:
    def __init__(self, seed: int, device: torch.device) -> None:
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
        host = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):  # in place: graphs keep reading these tensors
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=host) / math.sqrt(t.shape[0])).to(t.device))

    def forward(self, ins: dict[str, Tensor], k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][ins["tokens"]] + w["pos"][ins["positions"]]
        h = _norm(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, ins["slots"], k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, ins["slots"], v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=x.device)
        ctx = (ins["tables"][:, :, None] * SPEC.block_size + offs).flatten(1)  # [T, CONTEXT]
        keys, vals = k_cache[ctx], v_cache[ctx]
        seen = torch.arange(CONTEXT, device=x.device)[None, :] <= ins["positions"][:, None]
        att = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / HEAD_DIM**0.5
        att = att.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(seen[:, :, None, None], vals, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", att, vals).flatten(1) @ w["o"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        if "last" in ins:
            x = x[ins["last"]]
        return _norm(x) @ w["head"]


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def pick(logits: Tensor, temps: Tensor, sampled: Tensor, noise: Tensor) -> Tensor:
    """Greedy rows: argmax. Sampled rows: exponential race over the tempered softmax."""
    greedy = logits.argmax(-1)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    drawn = (probs / noise).argmax(-1)
    return torch.where(sampled, drawn, greedy)


class SeededGeneratorRunner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.device = torch.device("cuda")
        with torch.inference_mode():
            self.model = TinyModel(seed, self.device)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.k_cache = torch.zeros(shape, device=self.device)
            self.v_cache = torch.zeros(shape, device=self.device)
        # req_id -> (seed, generator): the per-request generators of the sampler.
        self.req_gens: dict[int, tuple[int, torch.Generator]] = {}
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        self.setup_sampler()
        if mode == "graph":
            with torch.inference_mode():
                self.buffers = self.allocate(SPEC.capture_sizes[-1])
                self.capture()

    # -- sampler ---------------------------------------------------------------------------------

    def setup_sampler(self) -> None:
        # one registered generator per graph row; seeded anyhow, re-set before every replay
        self.row_gens = [
            torch.Generator(device=self.device).manual_seed(1000 + r)
            for r in range(SPEC.capture_sizes[-1])
        ]

    def sync_generators(self, batch: Batch) -> None:
        """Create a generator for a seeded request new to us; drop those of absent requests."""
        live = {r.req_id for r in batch.requests}
        for req_id in [i for i in self.req_gens if i not in live]:
            del self.req_gens[req_id]
        for r in batch.requests:
            if r.seed is None:
                self.req_gens.pop(r.req_id, None)
                continue
            entry = self.req_gens.get(r.req_id)
            if entry is None or entry[0] != r.seed:  # a new request (or one reusing the id)
                self.req_gens[r.req_id] = (r.seed, self.new_request_generator(r))

    def new_request_generator(self, request: Request) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(request.seed & ((1 << 63) - 1))

    def request_generator(self, request: Request) -> torch.Generator:
        """The request's generator, positioned for this step's draw."""
        gen = self.req_gens[request.req_id][1]
        gen.manual_seed(draw_seed(request.seed, sample_position(request)))
        return gen

    def eager_noise(self, batch: Batch) -> Tensor:
        rows = []
        for r in batch.requests:
            if r.seed is None:
                rows.append(torch.ones(SPEC.vocab_size, device=self.device))
            else:
                gen = self.request_generator(r)
                rows.append(
                    torch.empty(SPEC.vocab_size, device=self.device).exponential_(generator=gen)
                )
        return torch.stack(rows)

    def register_graph_generators(self, graph: Any, size: int) -> None:
        for gen in self.row_gens[:size]:
            graph.register_generator_state(gen)

    def graph_noise(self, size: int) -> Tensor:
        """Captured: each row draws from its own registered generator."""
        return torch.stack(
            [
                torch.empty(SPEC.vocab_size, device=self.device).exponential_(generator=gen)
                for gen in self.row_gens[:size]
            ]
        )

    def set_graph_generators(self, batch: Batch) -> None:
        """Before a replay: each seeded row's registered generator takes its request's state."""
        for row, r in enumerate(batch.requests):
            if r.seed is not None:
                self.row_gens[row].set_state(self.request_generator(r).get_state())

    # -- graph mode ------------------------------------------------------------------------------

    def allocate(self, rows: int) -> dict[str, Tensor]:
        dev, i64 = self.device, torch.int64
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=dev),
            "positions": torch.zeros(rows, dtype=i64, device=dev),
            "slots": torch.zeros(rows, dtype=i64, device=dev),
            "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
            "temps": torch.ones(rows, device=dev),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
        }

    def graph_forward(self, size: int) -> tuple[Tensor, Tensor]:
        ins = {n: b[:size] for n, b in self.buffers.items()}
        logits = self.model.forward(ins, self.k_cache, self.v_cache)
        return logits, pick(logits, ins["temps"], ins["sampled"], self.graph_noise(size))

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            self.graph_forward(size)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            self.register_graph_generators(graph, size)
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.graph_forward(size)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = {
            "tokens": [r.tokens[0] for r in batch.requests],
            "positions": [r.context_len for r in batch.requests],
            "slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in batch.requests],
            "tables": [_table(r) for r in batch.requests],
            "temps": [r.temperature if r.seed is not None else 1.0 for r in batch.requests],
            "sampled": [r.seed is not None for r in batch.requests],
        }
        pad = {
            "tokens": 0,
            "positions": 0,
            "slots": NULL_SLOT,
            "tables": SPEC.null_block,
            "temps": 1.0,
            "sampled": False,
        }
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(pad[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.set_graph_generators(batch)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ------------------------------------------------------------------------------

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        tok, pos, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                tok.append(t)
                pos.append(r.context_len + i)
                slots.append(kv_slot(r.block_ids, r.context_len + i, SPEC.block_size))
                tables.append(_table(r))
            last.append(len(tok) - 1)
        dev = self.device
        ins = {
            "tokens": torch.tensor(tok, dtype=torch.int64, device=dev),
            "positions": torch.tensor(pos, dtype=torch.int64, device=dev),
            "slots": torch.tensor(slots, dtype=torch.int64, device=dev),
            "tables": torch.tensor(tables, dtype=torch.int64, device=dev),
            "last": torch.tensor(last, dtype=torch.int64, device=dev),
        }
        logits = self.model.forward(ins, self.k_cache, self.v_cache)
        temps = torch.tensor(
            [r.temperature if r.seed is not None else 1.0 for r in batch.requests], device=dev
        )
        sampled = torch.tensor([r.seed is not None for r in batch.requests], device=dev)
        tokens = pick(logits, temps, sampled, self.eager_noise(batch))
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(len(r.tokens) != 1 for r in batch.requests):
            return "query length above one (prefill, mixed or speculative)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            if batch.num_reqs == 0:
                empty = torch.empty(0, SPEC.vocab_size, device=self.device)
                return StepResult(
                    empty,
                    torch.empty(0, dtype=torch.int64, device=self.device),
                    "eager",
                    None,
                    reason="empty batch",
                )
            self.sync_generators(batch)
            reason = self.fallback_reason(batch)
            return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

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
        self.req_gens.clear()


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


class SharedBatchGeneratorRunner(SeededGeneratorRunner):
    """THE BUG: seeded rows draw from one shared batch generator (seeded with a request's seed
    when it first appears, registered with every graph), not from per-request generators."""

    def setup_sampler(self) -> None:
        super().setup_sampler()
        self.batch_gen = torch.Generator(device=self.device).manual_seed(0)

    def new_request_generator(self, request: Request) -> torch.Generator:
        self.batch_gen.manual_seed(request.seed & ((1 << 63) - 1))  # "set seed before generation"
        return self.batch_gen

    def eager_noise(self, batch: Batch) -> Tensor:
        noise = torch.empty(batch.num_reqs, SPEC.vocab_size, device=self.device)
        return noise.exponential_(generator=self.batch_gen)

    def register_graph_generators(self, graph: Any, size: int) -> None:
        graph.register_generator_state(self.batch_gen)

    def graph_noise(self, size: int) -> Tensor:
        noise = torch.empty(size, SPEC.vocab_size, device=self.device)
        return noise.exponential_(generator=self.batch_gen)

    def set_graph_generators(self, batch: Batch) -> None:
        pass  # the shared generator simply advances with each replay


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SeededGeneratorRunner:
    # `backend` is not the runner's business: on sim the harness's drop-in makes torch.cuda the sim
    return SeededGeneratorRunner(mode, seed=seed)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SeededGeneratorRunner:
    return SharedBatchGeneratorRunner(mode, seed=seed)
