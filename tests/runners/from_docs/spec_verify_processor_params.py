"""A decode/verify graph runner whose captured step runs a per-request banned-token logits
processor over every token row a speculative verify step scores.

What it is
----------
A one-layer decoder (token embedding + learned positions, attention over a slot-major paged KV
cache read through per-token block tables, a GELU MLP, an LM head with a Gemma-style final-logit
soft-cap `CAP * tanh(z / CAP)`) written against the backend facade
(`pytest_graphmode.runtime.backends.get`) and the target contract only. After the soft-cap a
per-request logits processor bans tokens (sets them to -inf): the "disallowed token ids" processor
serving engines ship as their example custom processor. The contract's `Request` has no such
field, so a request's banned ids are a pure function of its `req_id` (`banned_ids`): two requests
in three carry eight banned ids, the third none.

Which logits rows the processor sees follows the engines' verify path: in a uniform step whose
requests all continue a cached sequence (a decode step, q = 1, or a speculative verify step, q =
1 + k tokens each, k <= NUM_DRAFTS = 3; a longer continuing query is a prefill chunk) every one
of the n * q token rows is scored and processed, as acceptance needs
the processed distribution at every draft position ("num_tokens_in_batch" = q); in any other step
(prefill, mixed) only each request's last token row is. The step returns the processed logits at
each request's last query token and the token sampled from them (greedy argmax, or Gumbel-max
with noise hashed from seed, position and token id: nothing drawn from a generator).

The processor is table-driven so that it can live inside a CUDA graph: a `ban_table` [max_num_reqs + 1,
vocab] bool (row i: request i's banned ids; the last row bans nothing and is what padding points
at) and a per-logits-row `ban_index` into it, both static buffers rewritten before every replay.
Graph mode captures one FULL graph per (padded request count R in 1/2/4, query length q in 1..4),
lazily, the first time a uniform continuing batch needs it; everything else (prefill, mixed,
larger batches) runs eagerly with freshly built tensors through the same code, as does the eager
twin.

Correct runner (`make_target`): `ban_index` maps every logits row to its own request's table row:
request i's index repeated q times (the per-request parameters expanded per token row).

Buggy runner (`make_buggy_target`), exactly one bug: the rows the processor selects are every token
row of the requests that carry a ban list (the request mask repeated q times), but the parameter
list handed to it has one entry per such request, consumed positionally: selected row p gets the
p-th banning request's ids, and selected rows past the list's length get none. With q = 1 that is
exact; in a verify step a request's last row takes another request's bans, or none. The graph and
eager twins build the same index, so they agree; only other company (fewer, other or reordered
requests, or a verify step run alone that was part of a mixed batch) changes which bans land on a
request's last row.

Modelled on: SGLang's `apply_custom_logit_processor`, which expands the batch mask with
`repeat_interleave(batch_mask, num_tokens_in_batch)` for speculative decoding but builds the
processor's `custom_params` list with one entry per request, so a processor that consumes its
parameters positionally applies them to the wrong draft rows and skips the rest:
https://github.com/sgl-project/sglang/pull/27771 (report and first fix) and
https://github.com/sgl-project/sglang/pull/38730 ("Fix custom logit processor params when
num_tokens_in_batch is used", merged: the params are repeated per token). No code copied.

What the contract could not express: per-request processor parameters (derived from `req_id`), and
the draft acceptance itself (the harness decides how many drafts a request keeps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

VOCAB = 64
SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=VOCAB,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
ROW_SIZES = (1, 2, 4)  # padded request counts of the graphs
NUM_DRAFTS = 3  # the engine's speculative tokens per step: a verify query is 1 + up to 3
MAX_Q = 1 + NUM_DRAFTS  # longest query a graph serves
MAX_ROWS = ROW_SIZES[-1]
MAX_TOKENS = SPEC.max_num_tokens
NO_BAN = SPEC.max_num_reqs  # the ban table's last row: bans nothing (padding, unconstrained rows)
CAP = 12.0  # final-logit soft-cap
M32 = 0xFFFFFFFF


# -- the per-request processor parameters ----------------------------------------------------------


def banned_ids(request: Request) -> tuple[int, ...]:
    """The request's disallowed token ids: a function of req_id alone."""
    if request.req_id % 3 == 2:
        return ()
    base = (request.req_id * 13 + 5) % VOCAB
    return tuple(sorted({(base + 9 * j) % VOCAB for j in range(8)}))


def ban_rows(batch: Batch, q: int, *, per_token: bool) -> list[int]:
    """For each processed logits row (q per request, request-major): the ban-table row it uses."""
    n = batch.num_reqs
    users = [i for i, r in enumerate(batch.requests) if banned_ids(r)]
    if per_token:
        own = set(users)
        return [i if i in own else NO_BAN for i in range(n) for _ in range(q)]
    # The processor selects every token row of the requests that use it, and receives one
    # parameter entry per such request, applied to the selected rows in order.
    selected = [i * q + j for i in users for j in range(q)]
    index = [NO_BAN] * (n * q)
    for p, row in enumerate(selected):
        if p < len(users):
            index[row] = users[p]
    return index


# -- the model ----------------------------------------------------------------------------------


class Model:
    SHAPES: ClassVar[dict[str, tuple[int, int]]] = {
        "embed": (VOCAB, HIDDEN),
        "pos": (CONTEXT, HIDDEN),
        "wq": (HIDDEN, HIDDEN),
        "wk": (HIDDEN, HIDDEN),
        "wv": (HIDDEN, HIDDEN),
        "wo": (HIDDEN, HIDDEN),
        "up": (HIDDEN, 3 * HIDDEN),
        "down": (3 * HIDDEN, HIDDEN),
        "head": (HIDDEN, VOCAB),
    }

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.w = {n: torch.empty(s, device=device) for n, s in self.SHAPES.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(10_007 * seed + 3)
        for name in sorted(self.w):
            t = self.w[name]
            gain = 4.0 if name == "head" else 1.0
            values = gain * torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])
            t.copy_(values.to(self.device))  # in place: captured graphs read these tensors

    def logits(self, x: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Soft-capped logits at every token row of `x`."""
        w = self.w
        dev = k_cache.device
        h = w["embed"][x.tokens] + w["pos"][x.positions]
        a = _rms(h)
        q, k, v = a @ w["wq"], a @ w["wk"], a @ w["wv"]
        k_cache.index_copy_(0, x.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x.slots, v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        ctx = (x.tables[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)  # [T, C]
        keys, vals = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(CONTEXT, device=dev)[None, :] <= x.positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=dev))
        att = torch.einsum("thc,tchd->thd", scores.softmax(-1), vals).flatten(1)
        h = h + att @ w["wo"]
        h = h + torch.nn.functional.gelu(_rms(h) @ w["up"]) @ w["down"]
        z = _rms(h) @ w["head"]
        return CAP * torch.tanh(z / CAP)


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks]
    ban_index: Tensor  # [processed rows] -> ban_table row
    ban_table: Tensor  # [max_num_reqs + 1, V] bool
    seeds: Tensor  # [R]
    temps: Tensor  # [R]
    sampled: Tensor  # [R] bool
    select: Tensor | None = None  # eager last-token-only steps: the token rows to process


def process_and_sample(
    logits: Tensor, x: Inputs, num_reqs: int, q: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Ban, pick each request's last row, sample. `logits` holds num_reqs * q processed rows."""
    banned = x.ban_table[x.ban_index]  # [rows, V]
    processed = logits.masked_fill(banned, float("-inf"))
    last = processed.view(num_reqs, q, VOCAB)[:, -1]
    positions = x.positions if x.select is None else x.positions[x.select]
    last_pos = positions.view(num_reqs, q)[:, -1]
    key = _mix(_mix(x.seeds) ^ ((last_pos * 0x3C6EF372) & M32))
    ids = torch.arange(VOCAB, device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x1B873593) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = last / x.temps[:, None] - torch.log(-torch.log(u))
    tokens = torch.where(x.sampled, noisy.argmax(-1), last.argmax(-1))
    return last, tokens, processed


def _mix(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 16)) * 0x045D9F3B) & M32
    x = ((x ^ (x >> 16)) * 0x045D9F3B) & M32
    return x ^ (x >> 16)


# -- the runner ---------------------------------------------------------------------------------

_TOKEN_PAD: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "ban_index": NO_BAN,
}
_ROW_PAD: dict[str, Any] = {"seeds": 0, "temps": 1.0, "sampled": False}
_DTYPES = {"temps": torch.float32, "sampled": torch.bool}


def _token_columns(batch: Batch) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {"tokens": [], "positions": [], "slots": [], "tables": []}
    for r in batch.requests:
        table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
        for j, tok in enumerate(r.tokens):
            pos = r.context_len + j
            cols["tokens"].append(tok)
            cols["positions"].append(pos)
            cols["slots"].append(kv_slot(r.block_ids, pos, SPEC.block_size))
            cols["tables"].append(table)
    return cols


def _row_columns(batch: Batch) -> dict[str, list[Any]]:
    return {
        "seeds": [(r.seed & M32) if r.seed is not None else 0 for r in batch.requests],
        "temps": [r.temperature if r.seed is not None else 1.0 for r in batch.requests],
        "sampled": [r.seed is not None for r in batch.requests],
    }


def _ban_table(batch: Batch, device: torch.device) -> Tensor:
    table = torch.zeros(NO_BAN + 1, VOCAB, dtype=torch.bool)
    for i, r in enumerate(batch.requests):
        ids = banned_ids(r)
        if ids:
            table[i, list(ids)] = True
    return table.to(device)


class BannedTokensRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, per_token_params: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode must be 'graph' or 'eager', not {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.per_token_params = per_token_params
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.graphs: dict[tuple[int, int], Any] = {}
        self.outputs: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            for name, value in _TOKEN_PAD.items():
                shape = (MAX_TOKENS, SPEC.max_blocks_per_req) if name == "tables" else (MAX_TOKENS,)
                self.buffers[name] = torch.full(shape, value, dtype=torch.int64, device=dev)
            for name, value in _ROW_PAD.items():
                dtype = _DTYPES.get(name, torch.int64)
                self.buffers[name] = torch.full((MAX_ROWS,), value, dtype=dtype, device=dev)
            self.buffers["ban_table"] = torch.zeros(NO_BAN + 1, VOCAB, dtype=torch.bool, device=dev)

    # -- graph path ----------------------------------------------------------------------------

    def _key(self, batch: Batch) -> tuple[int, int]:
        q = batch.requests[0].query_len
        rows = next(s for s in ROW_SIZES if s >= batch.num_reqs)
        return rows, q

    def _graph_inputs(self, rows: int, q: int) -> Inputs:
        b = self.buffers
        t = rows * q
        return Inputs(
            tokens=b["tokens"][:t],
            positions=b["positions"][:t],
            slots=b["slots"][:t],
            tables=b["tables"][:t],
            ban_index=b["ban_index"][:t],
            ban_table=b["ban_table"],
            seeds=b["seeds"][:rows],
            temps=b["temps"][:rows],
            sampled=b["sampled"][:rows],
        )

    def _prepare(self, batch: Batch, q: int) -> None:
        """Write the batch into the buffers' prefix and every other row back to padding."""
        dev = self.be.device
        cols = _token_columns(batch)
        cols["ban_index"] = ban_rows(batch, q, per_token=self.per_token_params)
        t = len(cols["tokens"])
        for name, pad in _TOKEN_PAD.items():
            buf = self.buffers[name]
            buf[:t].copy_(torch.tensor(cols[name], dtype=buf.dtype).to(dev))
            buf[t:].fill_(pad)
        n = batch.num_reqs
        for name, values in _row_columns(batch).items():
            buf = self.buffers[name]
            buf[:n].copy_(torch.tensor(values, dtype=buf.dtype).to(dev))
            buf[n:].fill_(_ROW_PAD[name])
        self.buffers["ban_table"].copy_(_ban_table(batch, dev))

    def _replay(self, batch: Batch) -> StepResult:
        rows, q = key = self._key(batch)
        self._prepare(batch, q)
        if key not in self.graphs:  # lazily, on the batch that first needs this shape
            inputs = self._graph_inputs(rows, q)
            self._forward(inputs, rows, q)  # warm-up outside the capture
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph):
                last, tokens, _ = self._forward(inputs, rows, q)
            self.graphs[key] = graph
            self.outputs[key] = (last, tokens)
        self.graphs[key].replay()
        last, tokens = self.outputs[key]
        n = batch.num_reqs
        return StepResult(last[:n].clone(), tokens[:n].clone(), "full", ("verify", rows, q))

    # -- both modes ----------------------------------------------------------------------------

    def _forward(self, x: Inputs, num_reqs: int, q: int) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.model.logits(x, self.k_cache, self.v_cache)
        if x.select is not None:
            logits = logits[x.select]
        return process_and_sample(logits, x, num_reqs, q)

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.be.device
        n = batch.num_reqs
        if n == 0:
            empty = torch.empty(0, VOCAB, device=dev)
            return StepResult(empty, torch.empty(0, dtype=torch.int64, device=dev), "eager", None)
        if self._verify_shaped(batch):
            q = batch.requests[0].query_len  # every token row is processed
            select = None
        else:
            q = 1  # only each request's last token row is processed
            ends = torch.tensor([r.query_len for r in batch.requests]).cumsum(0) - 1
            select = ends.to(dev)
        cols: dict[str, Any] = {**_token_columns(batch), **_row_columns(batch)}
        cols["ban_index"] = ban_rows(batch, q, per_token=self.per_token_params)
        t = {
            name: torch.tensor(values, dtype=_DTYPES.get(name, torch.int64)).to(dev)
            for name, values in cols.items()
        }
        x = Inputs(**t, ban_table=_ban_table(batch, dev), select=select)
        last, tokens, _ = self._forward(x, n, q)
        return StepResult(last, tokens, "eager", None, reason=reason)

    @staticmethod
    def _verify_shaped(batch: Batch) -> bool:
        """A decode or verify step: one query length of at most 1 + NUM_DRAFTS tokens, every
        request continuing its sequence (a longer continuing query is a prefill chunk)."""
        return (
            batch.uniform
            and batch.num_reqs > 0
            and batch.requests[0].query_len <= 1 + NUM_DRAFTS
            and all(r.context_len > 0 for r in batch.requests)
        )

    def _fallback(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if not self._verify_shaped(batch):
            return "not a uniform decode/verify batch"
        if batch.num_reqs > MAX_ROWS:
            return "more requests than the largest graph"
        rows, q = self._key(batch)
        if q > MAX_Q or rows * q > MAX_TOKENS:
            return "query longer than the graphs serve"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self._fallback(batch)
            return self._replay(batch) if reason is None else self._eager(batch, reason)

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
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> BannedTokensRunner:
    return BannedTokensRunner(mode, seed=seed, backend=backend, per_token_params=True)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> BannedTokensRunner:
    return BannedTokensRunner(mode, seed=seed, backend=backend, per_token_params=False)
