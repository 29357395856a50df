"""A token-padded graph runner whose seeded requests each own a device `torch.Generator`.

What it is: a one-layer paged-KV decoder (embedding + learned positions, attention through block
tables, SiLU MLP, LM head). Graph mode captures one graph per capture size *in tokens* (1, 2, 4,
8): decode, prefill chunks and mixed batches all replay one while their tokens fit, padded with
tokens that write only the null block. Sampling runs *inside* the graph: vLLM's Gumbel-style
`argmax(softmax(logits / T) / q)` with `q ~ Exp(1)` drawn per row from a device generator.

Per-request generators, as vLLM's sampler keeps them (`InputBatch.generators`): a seeded request
gets `torch.Generator(device)` seeded with its seed when it appears with `context_len == 0`
(a new request, or a preempted one recomputing: the harness reuses ids, so that is the only
safe moment), and each of its steps draws from it once (one `exponential_` of `[vocab]`, which
moves a CUDA philox offset by 4). A graph cannot draw from a generator made after its capture,
so each graph registers `max_num_reqs` *row* generators (`register_generator_state`); before a
replay each seeded row's generator gets its request's 16-byte state (`set_state(get_state())`),
and after the replay (whose launch moved the row generator on by 4) the request's generator
takes the row generator's offset back. The eager path draws from the request's generator
directly. Both paths draw the same values at the same (seed, offset).

Discarded draws: the token a request samples at a prefill chunk that does not end its prompt is
thrown away. The contract does not tell the runner the prompt length, so the runner learns it one
step late: when a request's next step continues its sequence with more than one query token,
the previous step was a partial prefill and its draw was discarded. The runner then rewinds the
request's generator (`set_offset(get_offset() - 4)`, as vLLM's model runner does for partial
prefills) *before* this step's draw, so the next real draw is the one it would have been had the
prompt come in one chunk. (A one-token continuation chunk is indistinguishable from a decode and
keeps its draw; both twins see the same batches, so the rule is deterministic.)

Bug (make_buggy_target): on the graph path the rewind is applied after the request's generator
state has already been staged into the graph's row generator (staging moved into input
preparation, bookkeeping left after it). The replay draws at the un-rewound offset and the
post-replay copy-back overwrites the rewind, so on the graph path the discarded draw is never
given back, while the eager path (which draws from the request's generator itself) is right: a
request's tokens after a partial prefill depend on which path its steps took.

Public source: vLLM's per-request seed support (https://github.com/vllm-project/vllm/pull/9945)
rewound partial-prefill generators by 1; https://github.com/vllm-project/vllm/pull/10097 changed
it to 4 ("relies on cuda-specific torch-internal impl details"): a rewind by the wrong amount /
at the wrong point leaves seeded outputs depending on chunking. Related:
https://github.com/vllm-project/vllm/pull/19940 (v0 recreated the generator on preemption).
No code copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
OFFSET_PER_DRAW = 4  # one small exponential_ moves a CUDA philox offset by 4


def rows_for(size: int) -> int:
    return min(size, SPEC.max_num_reqs)


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    last: Tensor  # [R] each row's last query token
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool


class Model:
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
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(t.device))

    def logits(self, x: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        h = w["embed"][x.tokens] + w["pos"][x.positions]
        n = _rms(h)
        q, k, v = n @ w["q"], n @ w["k"], n @ w["v"]
        k_cache.index_copy_(0, x.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x.slots, v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=h.device)
        ctx = (x.tables[:, :, None] * SPEC.block_size + offs).flatten(1)  # [T, CONTEXT]
        keys, values = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(CONTEXT, device=h.device)[None, :] <= x.positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        probs = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], -math.inf)
        probs = probs.softmax(-1)
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=h.device))
        h = h + torch.einsum("thc,tchd->thd", probs, values).flatten(1) @ w["o"]
        h = h + torch.nn.functional.silu(_rms(h) @ w["up"]) @ w["down"]
        return _rms(h[x.last]) @ w["head"]  # [R, vocab]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def sample(logits: Tensor, noise: Tensor, x: Inputs) -> Tensor:
    """vLLM-style random sampling: argmax(probs / q), q ~ Exp(1); greedy rows take the argmax."""
    probs = (logits / x.temperatures[:, None]).softmax(-1)
    return torch.where(x.sampled, (probs / noise).argmax(-1), logits.argmax(-1))


@dataclass
class Track:
    """A seeded request's generator and what the runner knows about its sequence."""

    seed: int
    gen: torch.Generator
    next_ctx: int  # the context_len its next step continues from
    drew: bool  # its last step drew once from `gen`


class OffsetRewindRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, buggy: bool = False) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec, self.mode, self.buggy = SPEC, mode, buggy
        self.be: Any = get_backend(backend)
        self.device = self.be.device
        with torch.inference_mode():
            self.model = Model(seed, self.device)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.k = torch.zeros(shape, device=self.device)
            self.v = torch.zeros(shape, device=self.device)
            self.tracks: dict[int, Track] = {}
            self.graphs: dict[int, Any] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            self.row_gens: list[torch.Generator] = []
            if mode == "graph":
                self.capture()

    # -- generators ------------------------------------------------------------------------------

    def new_generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed & (2**63 - 1))
        return gen

    def track(self, batch: Batch) -> list[tuple[int, Track, bool]]:
        """(row, track, rewind?) for each seeded request; rebuilds a track the request does not
        continue; forgets greedy requests' tracks."""
        out = []
        for row, r in enumerate(batch.requests):
            if r.seed is None:
                self.tracks.pop(r.req_id, None)
                continue
            t = self.tracks.get(r.req_id)
            if r.context_len == 0 or t is None or t.seed != r.seed or t.next_ctx != r.context_len:
                # new (or recomputing after preemption); a continuation never seen is not
                # reachable through the harness, and starts a fresh stream too
                t = Track(r.seed, self.new_generator(r.seed), r.context_len, False)
                self.tracks[r.req_id] = t
                out.append((row, t, False))
            else:
                # continuing a prompt with several tokens: the previous step was a partial
                # prefill whose sampled token was discarded; give its draw back
                out.append((row, t, t.drew and r.query_len > 1))
        return out

    @staticmethod
    def rewind(seeded: list[tuple[int, Track, bool]]) -> None:
        for _, t, back in seeded:
            if back:
                t.gen.set_offset(t.gen.get_offset() - OFFSET_PER_DRAW)

    @staticmethod
    def finish(batch: Batch, seeded: list[tuple[int, Track, bool]]) -> None:
        for row, t, _ in seeded:
            t.next_ctx = batch.requests[row].seq_len
            t.drew = True

    # -- graph mode ------------------------------------------------------------------------------

    def capture(self) -> None:
        size = SPEC.capture_sizes[-1]
        dev, i64 = self.device, torch.int64
        rows = rows_for(size)
        self.buffers = {
            "tokens": torch.zeros(size, dtype=i64, device=dev),
            "positions": torch.zeros(size, dtype=i64, device=dev),
            "slots": torch.zeros(size, dtype=i64, device=dev),
            "tables": torch.zeros(size, SPEC.max_blocks_per_req, dtype=i64, device=dev),
            "last": torch.zeros(rows, dtype=i64, device=dev),
            "temperatures": torch.ones(rows, device=dev),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
        }
        self.row_gens = [self.new_generator(1000 + i) for i in range(rows)]
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            x = self.static_inputs(size)
            self.forward_graphable(x)  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            for gen in self.row_gens[: rows_for(size)]:
                graph.register_generator_state(gen)
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self.forward_graphable(x)
            self.graphs[size] = graph

    def static_inputs(self, size: int) -> Inputs:
        b, rows = self.buffers, rows_for(size)
        return Inputs(
            b["tokens"][:size],
            b["positions"][:size],
            b["slots"][:size],
            b["tables"][:size],
            b["last"][:rows],
            b["temperatures"][:rows],
            b["sampled"][:rows],
        )

    def forward_graphable(self, x: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.logits(x, self.k, self.v)
        rows = x.last.shape[0]
        noise = torch.stack(
            [
                torch.empty(SPEC.vocab_size, device=self.device).exponential_(generator=g)
                for g in self.row_gens[:rows]
            ]
        )
        return logits, sample(logits, noise, x)

    def prepare(self, batch: Batch, size: int) -> None:
        tok = _token_rows(batch.requests)
        req = _request_rows(batch.requests)
        t, n = len(tok["tokens"]), batch.num_reqs
        pad_tok = {"tokens": 0, "positions": 0, "slots": NULL_SLOT, "tables": SPEC.null_block}
        pad_req = {"last": 0, "temperatures": 1.0, "sampled": False}
        for rows, count, limit, pad in ((tok, t, size, pad_tok), (req, n, rows_for(size), pad_req)):
            for name, values in rows.items():
                buf = self.buffers[name]
                if count:
                    buf[:count].copy_(
                        torch.tensor(values, dtype=buf.dtype).view(-1, *buf.shape[1:])
                    )
                buf[count:limit].fill_(pad[name])

    def stage(self, seeded: list[tuple[int, Track, bool]]) -> None:
        for row, t, _ in seeded:
            self.row_gens[row].set_state(t.gen.get_state())

    def collect(self, seeded: list[tuple[int, Track, bool]]) -> None:
        for row, t, _ in seeded:
            t.gen.set_offset(self.row_gens[row].get_offset())

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_tokens)
        seeded = self.track(batch)
        if self.buggy:
            self.prepare(batch, size)
            self.stage(seeded)  # BUG: staged before the rewind below
            self.rewind(seeded)
        else:
            self.rewind(seeded)
            self.prepare(batch, size)
            self.stage(seeded)
        self.graphs[size].replay()
        self.collect(seeded)
        self.finish(batch, seeded)
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("tokens", size))

    # -- eager -----------------------------------------------------------------------------------

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        seeded = self.track(batch)
        self.rewind(seeded)
        x = _eager_inputs(batch, self.device)
        logits = self.model.logits(x, self.k, self.v)
        gens = {row: t.gen for row, t, _ in seeded}
        noise = (
            torch.stack(
                [
                    torch.empty(SPEC.vocab_size, device=self.device).exponential_(generator=gens[i])
                    if i in gens
                    else torch.ones(SPEC.vocab_size, device=self.device)
                    for i in range(batch.num_reqs)
                ]
            )
            if batch.num_reqs
            else torch.ones(0, SPEC.vocab_size, device=self.device)
        )
        tokens = sample(logits, noise, x)
        self.finish(batch, seeded)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.num_tokens > SPEC.capture_sizes[-1]:
            return "more tokens than the largest capture size"
        return None

    # -- contract --------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k, "v": self.v}

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
        self.tracks.clear()


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _token_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    rows: dict[str, list[Any]] = {"tokens": [], "positions": [], "slots": [], "tables": []}
    for r in requests:
        for i, tok in enumerate(r.tokens):
            p = r.context_len + i
            rows["tokens"].append(tok)
            rows["positions"].append(p)
            rows["slots"].append(_slot(r, p))
            rows["tables"].append(_table(r))
    return rows


def _request_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    last, end = [], 0
    for r in requests:
        end += r.query_len
        last.append(end - 1)
    return {
        "last": last,
        "temperatures": [r.temperature if r.seed is not None else 1.0 for r in requests],
        "sampled": [r.seed is not None for r in requests],
    }


def _eager_inputs(batch: Batch, device: torch.device) -> Inputs:
    tok, req = _token_rows(batch.requests), _request_rows(batch.requests)

    def t(v: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(v, dtype=dtype, device=device)

    return Inputs(
        t(tok["tokens"]),
        t(tok["positions"]),
        t(tok["slots"]),
        t(tok["tables"]).view(-1, SPEC.max_blocks_per_req),
        t(req["last"]),
        t(req["temperatures"], torch.float32),
        t(req["sampled"], torch.bool),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OffsetRewindRunner:
    return OffsetRewindRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> OffsetRewindRunner:
    return OffsetRewindRunner(mode, seed=seed, backend=backend, buggy=True)
