"""A decode-graph runner with a persistent batch whose per-row sampling parameters live on device.

Requests occupy rows of a persistent batch keyed by req_id: a request absent from a step's batch
has finished and frees its row; a new request (an unknown id, or a known id whose context_len does
not continue where its row left off) takes the lowest free row, and its sampling parameters
(temperature and seed; seed -1 = greedy) are written into the persistent device tensors
`row_temperature` / `row_seed` at that moment. The captured decode graph reads them through the
static `row_index` buffer (batch row -> persistent row), gathered inside the graph. The eager path
builds its per-step parameter tensors fresh from the batch.

Graph mode is built on the backend facade (`pytest_graphmode.runtime.backends.get`): one graph per
capture size, captured largest first into one shared pool.

`make_buggy_target`: on admission a parameter is written only when it differs from the default
(temperature 1.0, seed -1), so a new request with default parameters inherits the previous
occupant's values.
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
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
PAD_ROW = SPEC.max_num_reqs  # a persistent row no request ever takes: greedy, temperature 1
GREEDY_SEED = -1  # the default seed value in the persistent rows (request.seed None)
DEFAULT_TEMPERATURE = 1.0
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    last: Tensor | None = None  # [R] last token of each request (None: decode, T == R)


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)
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
        self.w = {
            name: (torch.randn(shape, generator=g) / math.sqrt(shape[0])).to(device)
            for name, shape in shapes.items()
        }

    def forward(self, inp: StepInputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][inp.tokens] + w["pos"][inp.positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, inp.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, inp.slots, v.view(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(SPEC.block_size, device=x.device)
        context = (inp.tables[:, :, None] * SPEC.block_size + offsets).flatten(1)
        keys, values = k_cache[context], v_cache[context]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= inp.positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = scores / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", probs, values).flatten(1) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if inp.last is not None:
            x = x[inp.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def sample(logits: Tensor, positions: Tensor, seeds: Tensor, temperatures: Tensor) -> Tensor:
    """Gumbel-max, noise from a hash of (seed, position, token id); seed -1 = greedy."""
    sampled = seeds >= 0
    key = _mix(_mix(seeds & _MASK32) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _seed_of(r: Request) -> int:
    return GREEDY_SEED if r.seed is None else r.seed & _MASK32


def _slot(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


class PersistentBatchRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, buggy: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.buggy = buggy
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        # persistent batch (graph twin): req_id -> row, and the seq_len each row reached
        self.row_of: dict[int, int] = {}
        self.row_seq_len: dict[int, int] = {}
        self.row_seed = torch.full(
            (SPEC.max_num_reqs + 1,), GREEDY_SEED, dtype=torch.int64, device=dev
        )
        self.row_temperature = torch.full((SPEC.max_num_reqs + 1,), DEFAULT_TEMPERATURE, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows, i64 = SPEC.capture_sizes[-1], torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.zeros(rows, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "row_index": torch.full((rows,), PAD_ROW, dtype=i64, device=dev),
            }
            self.capture()

    # -- persistent batch -------------------------------------------------------------------------

    def update_rows(self, batch: Batch) -> None:
        present = {r.req_id for r in batch.requests}
        for req_id in [i for i in self.row_of if i not in present]:  # finished: free the row
            del self.row_seq_len[self.row_of.pop(req_id)]
        for r in batch.requests:
            row = self.row_of.get(r.req_id)
            if row is not None and self.row_seq_len[row] == r.context_len:
                self.row_seq_len[row] = r.context_len + len(r.tokens)
                continue
            if row is None:  # a new request takes the lowest free row
                row = min(set(range(SPEC.max_num_reqs)) - set(self.row_of.values()))
                self.row_of[r.req_id] = row
            self.row_seq_len[row] = r.context_len + len(r.tokens)
            self.write_row_params(row, r)

    def write_row_params(self, row: int, r: Request) -> None:
        seed, temperature = _seed_of(r), float(r.temperature)
        if not self.buggy or seed != GREEDY_SEED:
            self.row_seed[row : row + 1].fill_(seed)
        if not self.buggy or temperature != DEFAULT_TEMPERATURE:
            self.row_temperature[row : row + 1].fill_(temperature)

    # -- graph mode -------------------------------------------------------------------------------

    def static_inputs(self, size: int) -> StepInputs:
        b = self.buffers
        return StepInputs(
            b["tokens"][:size], b["positions"][:size], b["slots"][:size], b["tables"][:size]
        )

    def graph_forward(self, size: int) -> tuple[Tensor, Tensor]:
        inp = self.static_inputs(size)
        logits = self.model.forward(inp, self.k_cache, self.v_cache)
        index = self.buffers["row_index"][:size]
        seeds, temps = self.row_seed[index], self.row_temperature[index]  # gathered in the graph
        return logits, sample(logits, inp.positions, seeds, temps)

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            self.graph_forward(size)
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self.graph_forward(size)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        reqs, n = batch.requests, batch.num_reqs
        rows = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "row_index": [self.row_of[r.req_id] for r in reqs],
        }
        padding = {
            "tokens": 0,
            "positions": 0,
            "slots": NULL_SLOT,
            "tables": SPEC.null_block,
            "row_index": PAD_ROW,
        }
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(padding[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager ------------------------------------------------------------------------------------

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.be.device
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=dev)
            return StepResult(
                empty, torch.zeros(0, dtype=torch.int64, device=dev), "eager", None, reason=reason
            )
        tokens, positions, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                tokens.append(t)
                positions.append(r.context_len + i)
                slots.append(_slot(r, r.context_len + i))
                tables.append(_table(r))
            last.append(len(tokens) - 1)

        def t(v: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(v, dtype=dtype, device=dev)

        inp = StepInputs(
            t(tokens), t(positions), t(slots), t(tables).view(-1, SPEC.max_blocks_per_req), t(last)
        )
        logits = self.model.forward(inp, self.k_cache, self.v_cache)
        seeds = t([_seed_of(r) for r in batch.requests])  # fresh from the batch
        temps = t([float(r.temperature) for r in batch.requests], torch.float32)
        next_tokens = sample(logits, inp.positions[inp.last], seeds, temps)
        return StepResult(logits, next_tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return f"{batch.phase} batch"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        if self.mode == "graph":
            self.update_rows(batch)
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        raise NotImplementedError("no 'weight_update' feature")

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PersistentBatchRunner:
    return PersistentBatchRunner(mode, seed=seed, backend=backend, buggy=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PersistentBatchRunner:
    return PersistentBatchRunner(mode, seed=seed, backend=backend, buggy=True)
