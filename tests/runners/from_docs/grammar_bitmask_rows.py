"""A decode graph runner with structured-output constraints applied through a packed token bitmask.

What it is
----------
A one-layer decoder (token embedding + learned positions, attention over a slot-major paged KV
cache read through block tables, a SiLU MLP, an LM head) written against the backend facade
(`pytest_graphmode.runtime.backends.get`) and the target contract only. Before sampling, the
logits of every row pass through a grammar bitmask the way vLLM applies xgrammar's masks: a packed
int32 bitmask of shape [rows, ceil(vocab / 32)], bit `t % 32` of word `t // 32` set when token `t`
is allowed; a cleared bit sets that logit to -inf.

The contract's `Request` has no grammar field, so the constraint is derived from the request alone
(identical on both twins, independent of the batch): a request whose `req_id` is divisible by 3 is
"structured" and at position p may only emit tokens t with (7 t + 3 req_id + p) mod 5 in {0, 2};
any other request is unconstrained. The grammar "state" is the position, so a constrained
request's mask changes from step to step, as a real grammar matcher's does.

Graph mode captures one decode graph per capture size (largest first, one shared pool). The graph
reads a persistent device bitmask buffer `bitmask` [max rows, words] (listed in static_buffers, so
the harness poisons it). Before every replay the host builds the mask rows and uploads them into
the buffer: constrained rows get their grammar mask, unconstrained rows all-ones, padding rows
all-ones (inert: padding logits are never returned). Every other batch (prefill, mixed,
speculative, too many rows) runs eagerly with a freshly built bitmask, as does the eager twin.
Sampling is Gumbel-max with noise hashed from (seed, position, token id), so it is deterministic per
request and independent of batch company; greedy requests take the argmax of the masked logits.

The bug (make_buggy_target)
---------------------------
The host writes only the rows of constrained requests into the persistent device bitmask each step
("only grammar requests need a mask; the rest was allocated as all-ones"). Rows of unconstrained
requests (and padding rows) keep whatever the buffer held: a structured request's mask from an
earlier step whose row it now occupies, or the harness's poison. An unconstrained request then
decodes under someone else's grammar. Modelled on SGLang's stale-bitmask leak
https://github.com/sgl-project/sglang/pull/23653 ("prevent stale bitmask leakage in LLGuidance
grammar backend": the cached bitmask was reused across decode steps and rows that held restrictive
grammar masks were never cleared, so plain requests inherited them; see also the report
https://github.com/sgl-project/sglang/pull/7321), and on vLLM-Gaudi's
https://github.com/vllm-project/vllm-gaudi/pull/1200 (rows of non-structured requests not set to
all-ones, corrupting plain requests batched beside json_schema ones). Related misalignment in vLLM
itself: https://github.com/vllm-project/vllm/pull/22963. No engine code was copied.

`StepResult.logits` are the masked logits (-inf where the grammar forbids a token).
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
    num_blocks=28,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=72,  # 3 bitmask words; the last one has 24 phantom bits
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
WORDS = (SPEC.vocab_size + 31) // 32
MASK32 = 0xFFFFFFFF
ALL_ALLOWED = [-1] * WORDS  # every bit set: no constraint


# -- the "grammar" --------------------------------------------------------------------------------


def constrained(request: Request) -> bool:
    return request.req_id % 3 == 0


def _to_int32(word: int) -> int:
    return word - (1 << 32) if word >= (1 << 31) else word


def grammar_row(request: Request, position: int) -> list[int]:
    """The packed mask of `request` at `position` (the position whose logits are sampled)."""
    if not constrained(request):
        return list(ALL_ALLOWED)
    words = [0] * WORDS
    for token in range(SPEC.vocab_size):
        if (7 * token + 3 * request.req_id + position) % 5 in (0, 2):
            words[token // 32] |= 1 << (token % 32)
    return [_to_int32(w) for w in words]


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """Logits of disallowed tokens become -inf. `bitmask` [R, WORDS] int32; no host reads."""
    ids = torch.arange(logits.shape[-1], device=logits.device)
    words = bitmask[:, ids // 32].to(torch.int64)  # [R, vocab]
    allowed = ((words >> (ids % 32)) & 1) == 1
    return logits.masked_fill(~allowed, float("-inf"))


# -- model and sampler ----------------------------------------------------------------------------


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    bitmask: Tensor  # [R, WORDS] int32
    last: Tensor | None = None  # [R] each request's last token; None when T == R


class Decoder:
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
        self.device = device
        self.w = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            weight = self.w[name]
            weight.copy_(
                (torch.randn(weight.shape, generator=gen) / math.sqrt(weight.shape[0])).to(
                    self.device
                )
            )

    def forward(self, x_in: StepInputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][x_in.tokens] + w["pos"][x_in.positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, x_in.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x_in.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + _attend(q, k_cache, v_cache, x_in) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if x_in.last is not None:
            x = x[x_in.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, x_in: StepInputs) -> Tensor:
    offsets = torch.arange(SPEC.block_size, device=q.device)
    ctx = (x_in.tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT]
    keys, values = k_cache[ctx], v_cache[ctx]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= x_in.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def constrain_and_sample(logits: Tensor, x_in: StepInputs) -> tuple[Tensor, Tensor]:
    """Mask with the grammar bitmask, then Gumbel-max (sampled rows) or argmax (greedy rows).
    Returns the masked logits (-inf where disallowed)."""
    masked = apply_bitmask(logits, x_in.bitmask)
    positions = x_in.positions if x_in.last is None else x_in.positions[x_in.last]
    key = _hash(_hash(x_in.seeds) ^ ((positions * 0x9E3779B1) & MASK32))
    ids = torch.arange(masked.shape[-1], device=masked.device)
    bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = masked / x_in.temperatures[:, None] - torch.log(-torch.log(uniform))
    tokens = torch.where(x_in.sampled, noisy.argmax(-1), masked.argmax(-1))
    return masked, tokens


# -- the runner -----------------------------------------------------------------------------------


class GrammarRunner:
    stale_unconstrained_rows = False  # the bug: only constrained rows are written each step

    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        device = self.device = self.backend.device
        self.model = Decoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=device)
        self.v_cache = torch.zeros(shape, device=device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=device),
                "positions": torch.zeros(rows, dtype=i64, device=device),
                "slots": torch.zeros(rows, dtype=i64, device=device),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=device),
                "seeds": torch.zeros(rows, dtype=i64, device=device),
                "temperatures": torch.ones(rows, device=device),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
                # allocated all-ones, as xgrammar's allocate_token_bitmask does
                "bitmask": torch.full((rows, WORDS), -1, dtype=torch.int32, device=device),
            }
            self.capture()

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            x_in = StepInputs(**{name: buf[:size] for name, buf in self.buffers.items()})
            self.run_model(x_in)  # warm-up
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(x_in)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = _decode_rows(batch.requests)
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(_PADDING[name])
        self.write_bitmask(batch, size)

    def write_bitmask(self, batch: Batch, size: int) -> None:
        """Fill the step's mask rows on the host and upload them into the persistent buffer."""
        bitmask = self.buffers["bitmask"]
        if self.stale_unconstrained_rows:
            # BUG: only structured requests get their row written; the rest keep what was there.
            index = [i for i, r in enumerate(batch.requests) if constrained(r)]
            if index:
                host = torch.tensor(
                    [grammar_row(batch.requests[i], batch.requests[i].context_len) for i in index],
                    dtype=torch.int32,
                )
                bitmask.index_copy_(
                    0, torch.tensor(index, device=self.device), host.to(self.device)
                )
            return
        host = torch.full((size, WORDS), -1, dtype=torch.int32)  # unconstrained and padding rows
        for i, request in enumerate(batch.requests):
            if constrained(request):
                host[i] = torch.tensor(grammar_row(request, request.context_len), dtype=torch.int32)
        bitmask[:size].copy_(host)

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def run_model(self, x_in: StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(x_in, self.k_cache, self.v_cache)
        return constrain_and_sample(logits, x_in)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "query length above one (prefill, mixed or speculative)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            return self.replay(batch)
        logits, tokens = self.run_model(_eager_inputs(batch, self.device))
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


class BuggyGrammarRunner(GrammarRunner):
    stale_unconstrained_rows = True


_PADDING: dict[str, float | int | bool] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(request: Request, position: int) -> int:
    return (
        request.block_ids[position // SPEC.block_size] * SPEC.block_size
        + position % SPEC.block_size
    )


def _table(request: Request) -> list[int]:
    return list(request.block_ids) + [SPEC.null_block] * (
        SPEC.max_blocks_per_req - len(request.block_ids)
    )


def _sampling(request: Request) -> tuple[int, float, bool]:
    if request.seed is None:
        return 0, 1.0, False
    return request.seed & MASK32, request.temperature, True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    sampling = [_sampling(r) for r in requests]
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_slot(r, r.context_len) for r in requests],
        "tables": [_table(r) for r in requests],
        "seeds": [s[0] for s in sampling],
        "temperatures": [s[1] for s in sampling],
        "sampled": [s[2] for s in sampling],
    }


def _eager_inputs(batch: Batch, device: torch.device) -> StepInputs:
    tokens, positions, slots, tables, last, masks = [], [], [], [], [], []
    for request in batch.requests:
        for i, token in enumerate(request.tokens):
            tokens.append(token)
            positions.append(request.context_len + i)
            slots.append(_slot(request, request.context_len + i))
            tables.append(_table(request))
        last.append(len(tokens) - 1)
        masks.append(grammar_row(request, request.seq_len - 1))  # the sampled position's mask
    sampling = [_sampling(r) for r in batch.requests]

    def tensor(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return StepInputs(
        tokens=tensor(tokens),
        positions=tensor(positions),
        slots=tensor(slots),
        tables=tensor(tables).view(-1, SPEC.max_blocks_per_req),
        seeds=tensor([s[0] for s in sampling]),
        temperatures=tensor([s[1] for s in sampling], torch.float32),
        sampled=tensor([s[2] for s in sampling], torch.bool),
        bitmask=tensor(masks, torch.int32).view(-1, WORDS),
        last=tensor(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> GrammarRunner:
    return GrammarRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> GrammarRunner:
    return BuggyGrammarRunner(mode, seed=seed, backend=backend)
