"""A decode runner whose in-graph sampler applies per-request sparse logit-bias / bad-words lists.

The runner: a one-layer paged-KV decoder (embedding + learned positions, attention over a
slot-major paged cache through block tables, SiLU MLP, LM head) whose sampler, captured in the
same CUDA graph as the forward, applies each request's logit bias (OpenAI `logit_bias`, vLLM
`SamplingParams.logit_bias`, SGLang `logit_bias`) and bad words (a bias of -inf). Each request's
list holds 0-5 `(token id, bias)` pairs derived deterministically from the request itself
(`bias_entries(req_id)`), the same on every twin and whatever its batch. Graph mode captures a
decode graph per capture size lazily, the first time a decode batch needs it, each in a pool of
its own. The lists are flattened into sparse device buffers of fixed capacity
(`entry_rows`, `entry_tokens`, `entry_bias`), rewritten every step, plus a device count
(`entry_count`); the graph turns them into a dense `[rows, vocab + 1]` bias with one
`index_put_(accumulate=True)` and adds it to the logits. Entries past the count are masked:
their row is 0, their token the dump column `vocab` and their bias 0, so one captured graph
serves any lists. Prefill, mixed batches and batches above the largest capture size run eagerly
with the same code on freshly built tensors.

The bug (`make_buggy_target`): the graph takes the number of valid entries from the host, as a
Python int of the batch at hand (`rows[:n]`, `n` = the capture batch's total entries), instead of
masking with the device count. The capture freezes `n`: a later batch on that graph with more
entries loses its last biases, one with fewer applies the entries the buffer still holds past its
own (an earlier batch's, or whatever the buffer was left with), to the wrong rows and tokens.

Modelled on vLLM's GPU-side logit-bias state in Model Runner V2
(https://github.com/vllm-project/vllm/pull/32163: per-request `allowed_token_ids` / `logit_bias`
counts staged into device tensors so a graph-safe kernel reads them) and on
https://github.com/vllm-project/vllm/pull/48693 ("Make Gemma 4 suppress-token masking CUDA-graph
safe": Python suppress-token ids used in a captured region). No engine code is copied.
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
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
MAX_ENTRIES_PER_REQ = 5
ENTRY_CAPACITY = MAX_ENTRIES_PER_REQ * SPEC.capture_sizes[-1]
DUMP = SPEC.vocab_size  # the column padding entries write; sliced off
M32 = 0xFFFFFFFF


def bias_entries(req_id: int) -> list[tuple[int, float]]:
    """The request's logit-bias list: 0-5 distinct token ids, each with a bias; every fourth one a
    bad word (-inf). A pure function of the request, the same in any batch and on any twin."""
    count = (req_id * 5 + 3) % (MAX_ENTRIES_PER_REQ + 1)
    start = (req_id * 7 + 1) % SPEC.vocab_size
    entries = []
    for j in range(count):
        token = (start + 11 * j) % SPEC.vocab_size  # 11 is prime to 48: distinct ids
        if (req_id + j) % 4 == 0:
            bias = float("-inf")
        else:
            magnitude = 1.5 * (1 + (req_id * 3 + j * 5) % 6)
            bias = magnitude if (req_id + j) % 2 else -magnitude
        entries.append((token, bias))
    return entries


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    entry_rows: Tensor  # [E] logits row of each bias entry
    entry_tokens: Tensor  # [E]
    entry_bias: Tensor  # [E]
    entry_count: Tensor  # [1] valid entries (a device value)
    num_entries: int  # the same count on the host, as the batch at hand had it
    last: Tensor | None = None  # [R] each request's last token (None: one token a request)


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
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def forward(self, x_in: StepInputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][x_in.tokens] + w["pos"][x_in.positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, x_in.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x_in.slots, v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=x.device)
        ctx = (x_in.tables[:, :, None] * SPEC.block_size + offs).flatten(1)
        keys, vals = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= x_in.positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        probs = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], -math.inf)
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=x.device))
        att = torch.einsum("thc,tchd->thd", probs.softmax(-1), vals).flatten(1)
        x = x + att @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if x_in.last is not None:
            x = x[x_in.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 15) ^ x) * 0x2C1B3C6D) & M32
    x = (((x >> 12) ^ x) * 0x297A2D39) & M32
    return (x >> 15) ^ x


def apply_bias(logits: Tensor, inp: StepInputs, count_on_device: bool) -> Tensor:
    """Add each request's sparse bias list to its logits row (one scatter into a dense bias)."""
    rows, toks, bias = inp.entry_rows, inp.entry_tokens, inp.entry_bias
    if count_on_device:
        valid = torch.arange(rows.shape[0], device=rows.device) < inp.entry_count
        rows = torch.where(valid, rows, torch.zeros_like(rows))
        toks = torch.where(valid, toks, torch.full_like(toks, DUMP))
        bias = torch.where(valid, bias, torch.zeros_like(bias))
    else:
        # BUG: the host's count of the batch at hand; a capture freezes it into the graph.
        n = inp.num_entries
        rows, toks, bias = rows[:n], toks[:n], bias[:n]
    dense = torch.zeros(logits.shape[0], SPEC.vocab_size + 1, device=logits.device)
    dense.index_put_((rows, toks), bias, accumulate=True)
    return logits + dense[:, : SPEC.vocab_size]


def sample(logits: Tensor, inp: StepInputs) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): no generator, no company."""
    pos = inp.positions if inp.last is None else inp.positions[inp.last]
    key = _hash(_hash(inp.seeds) ^ ((pos * 0x27D4EB2F) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x165667B1) & M32)[None, :])
    u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inp.temperatures[:, None] - torch.log(-torch.log(u))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


class LogitBiasRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, count_on_device: bool
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.count_on_device = count_on_device
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Decoder(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.inputs: dict[int, StepInputs] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.zeros(rows, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "seeds": torch.zeros(rows, dtype=i64, device=dev),
                "temperatures": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
                "entry_rows": torch.zeros(ENTRY_CAPACITY, dtype=i64, device=dev),
                "entry_tokens": torch.zeros(ENTRY_CAPACITY, dtype=i64, device=dev),
                "entry_bias": torch.zeros(ENTRY_CAPACITY, device=dev),
                "entry_count": torch.zeros(1, dtype=i64, device=dev),
            }

    # -- graph mode ---------------------------------------------------------------------------

    def prepare(self, batch: Batch, size: int) -> int:
        """Write the batch's rows and its bias entries into the static buffers; pad the rest.
        Returns the batch's number of bias entries."""
        n = batch.num_reqs
        b = self.buffers
        cols = _rows(batch.requests)
        for name, values in cols.items():
            buf = b[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(_PAD[name])
        e_rows, e_toks, e_bias = _entries(batch.requests)
        m = len(e_rows)
        if m:
            b["entry_rows"][:m].copy_(torch.tensor(e_rows, dtype=torch.int64))
            b["entry_tokens"][:m].copy_(torch.tensor(e_toks, dtype=torch.int64))
            b["entry_bias"][:m].copy_(torch.tensor(e_bias, dtype=torch.float32))
        b["entry_count"].fill_(m)
        return m

    def static_inputs(self, size: int, num_entries: int) -> StepInputs:
        b = self.buffers
        return StepInputs(
            tokens=b["tokens"][:size],
            positions=b["positions"][:size],
            slots=b["slots"][:size],
            tables=b["tables"][:size],
            seeds=b["seeds"][:size],
            temperatures=b["temperatures"][:size],
            sampled=b["sampled"][:size],
            entry_rows=b["entry_rows"],
            entry_tokens=b["entry_tokens"],
            entry_bias=b["entry_bias"],
            entry_count=b["entry_count"],
            num_entries=num_entries,
        )

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        m = self.prepare(batch, size)
        if size not in self.graphs:  # captured the first time a batch needs this size
            inputs = self.static_inputs(size, m)
            self.inputs[size] = inputs  # the graph reads these views: keep them alive
            self.run_model(inputs)  # warm-up, outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph):
                self.outputs[size] = self.run_model(inputs)
            self.graphs[size] = graph
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ---------------------------------------------------------------------------

    def run_model(self, inp: StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, self.k_cache, self.v_cache)
        logits = apply_bias(logits, inp, self.count_on_device)
        return logits, sample(logits, inp)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        logits, tokens = self.run_model(_eager_inputs(batch, self.be.device))
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "more than one query token a request"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.inputs.clear()


_PAD: dict[str, float | int | bool] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None or r.temperature <= 0:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


def _rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    s = [_sampling(r) for r in requests]
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_slot(r, r.context_len) for r in requests],
        "tables": [_table(r) for r in requests],
        "seeds": [x[0] for x in s],
        "temperatures": [x[1] for x in s],
        "sampled": [x[2] for x in s],
    }


def _entries(requests: Sequence[Request]) -> tuple[list[int], list[int], list[float]]:
    """The batch's bias lists flattened: (logits row, token id, bias) per entry."""
    rows, toks, bias = [], [], []
    for row, r in enumerate(requests):
        for token, value in bias_entries(int(r.req_id)):
            rows.append(row)
            toks.append(token)
            bias.append(value)
    return rows, toks, bias


def _eager_inputs(batch: Batch, device: torch.device) -> StepInputs:
    tokens, positions, slots, tables, last = [], [], [], [], []
    for r in batch.requests:
        for i, t in enumerate(r.tokens):
            tokens.append(t)
            positions.append(r.context_len + i)
            slots.append(_slot(r, r.context_len + i))
            tables.append(_table(r))
        last.append(len(tokens) - 1)
    s = [_sampling(r) for r in batch.requests]
    e_rows, e_toks, e_bias = _entries(batch.requests)

    def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return StepInputs(
        tokens=t(tokens),
        positions=t(positions),
        slots=t(slots),
        tables=t(tables).view(-1, SPEC.max_blocks_per_req),
        seeds=t([x[0] for x in s]),
        temperatures=t([x[1] for x in s], torch.float32),
        sampled=t([x[2] for x in s], torch.bool),
        entry_rows=t(e_rows),
        entry_tokens=t(e_toks),
        entry_bias=t(e_bias, torch.float32),
        entry_count=t([len(e_rows)]),
        num_entries=len(e_rows),
        last=t(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> LogitBiasRunner:
    return LogitBiasRunner(mode, seed=seed, backend=backend, count_on_device=True)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> LogitBiasRunner:
    return LogitBiasRunner(mode, seed=seed, backend=backend, count_on_device=False)
