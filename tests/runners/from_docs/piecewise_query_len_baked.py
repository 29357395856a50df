"""A graph runner that replays prefill and mixed batches too, padded to a token count.

Two kinds of graphs, both captured lazily (the first batch that needs a key captures it, with its
own inputs staged in the static buffers):
  ("decode", R):  every request has one query token; R = request count padded to a capture size.
  ("varlen", T):  any other batch (prefill chunks, prefill + decode); T = token count padded to a
                  capture size, requests padded to min(T, max_num_reqs).
Token-wise work (embedding, projections, MLP, LM head) runs over the padded token rows; attention
over the paged cache reads per-token / per-request metadata from static buffers (query start
offsets, each token's request, positions, slot mapping, block tables, sequence lengths). The
attention gathers, for each request, a window of `max_query_len` query tokens, attends over the
request's blocks, and gathers each token's row back. `max_query_len` is a host int: it sizes the
window, so it is fixed in a captured graph.

make_target: varlen graphs are captured with max_query_len = padded token count (serves any mix).
make_buggy_target: captured with the capturing batch's longest query (as FlashAttention varlen
metadata's `max_query_len` captured into a graph).
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
    max_blocks_per_req=8,
    vocab_size=96,
    max_num_reqs=6,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8, 16),
    features=frozenset({"decode", "prefill"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 2, 16, 2
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
MAX_TOKENS = SPEC.capture_sizes[-1]


@dataclass
class StepInputs:
    """T token rows, R request rows."""

    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] slot mapping
    token_req: Tensor  # [T] each token's request row
    query_start: Tensor  # [R + 1] query start offsets (query_start[R] = valid token count)
    seq_lens: Tensor  # [R]
    tables: Tensor  # [R, max_blocks_per_req]
    last: Tensor  # [R] row of each request's last query token


class TinyModel:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            **{f"{n}{i}": (HIDDEN, HIDDEN) for i in range(LAYERS) for n in "qkvo"},
            **{f"up{i}": (HIDDEN, 2 * HIDDEN) for i in range(LAYERS)},
            **{f"down{i}": (2 * HIDDEN, HIDDEN) for i in range(LAYERS)},
        }
        self.weights = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            w = self.weights[name]
            w.copy_((torch.randn(w.shape, generator=g) / math.sqrt(w.shape[0])).to(w.device))

    def forward(
        self, inp: StepInputs, kv: list[tuple[Tensor, Tensor]], max_query_len: int
    ) -> Tensor:
        w = self.weights
        x = w["embed"][inp.tokens] + w["pos"][inp.positions]
        for i, (kc, vc) in enumerate(kv):
            h = _rms(x)
            q, k, v = (h @ w[f"{n}{i}"] for n in "qkv")
            kc.index_copy_(0, inp.slots, k.view(-1, HEADS, HEAD_DIM))
            vc.index_copy_(0, inp.slots, v.view(-1, HEADS, HEAD_DIM))
            x = x + varlen_attention(q, kc, vc, inp, max_query_len) @ w[f"o{i}"]
            x = x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        return _rms(x[inp.last]) @ w["head"]  # [R, vocab]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def varlen_attention(
    q: Tensor, kc: Tensor, vc: Tensor, inp: StepInputs, max_query_len: int
) -> Tensor:
    """Per request, a window of `max_query_len` query rows from its query start; causal attention
    over the request's paged context; each token's output gathered back from its window."""
    dev = q.device
    T = q.shape[0]
    starts = inp.query_start[:-1]  # [R]
    qlens = inp.query_start[1:] - starts  # [R]
    j = torch.arange(max_query_len, device=dev)
    rows = (starts[:, None] + j[None, :]).clamp(0, T - 1)  # [R, W]
    in_window = j[None, :] < qlens[:, None]  # [R, W]
    qw = q.view(T, HEADS, HEAD_DIM)[rows]  # [R, W, h, d]
    qpos = inp.positions[rows]  # [R, W]
    offsets = torch.arange(SPEC.block_size, device=dev)
    context = (inp.tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [R, C]
    keys, values = kc[context], vc[context]  # [R, C, h, d]
    cpos = torch.arange(CONTEXT, device=dev)
    visible = (cpos[None, None, :] <= qpos[:, :, None]) & in_window[:, :, None]  # [R, W, C]
    scores = torch.einsum("rwhd,rchd->rwhc", qw, keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, :, None, :], float("-inf")).softmax(-1)
    stored = cpos[None, :] < inp.seq_lens[:, None]  # [R, C]
    values = torch.where(stored[:, :, None, None], values, torch.zeros((), device=dev))
    window = torch.einsum("rwhc,rchd->rwhd", probs, values).flatten(2)  # [R, W, hidden]
    # gather back: token t is row (t - query_start[req]) of its request's window
    t = torch.arange(T, device=dev)
    req = inp.token_req
    jt = t - inp.query_start[req]
    keep = (t < inp.query_start[-1]) & (jt >= 0) & (jt < max_query_len)
    out = window[req, jt.clamp(0, max_query_len - 1)]  # [T, hidden]
    return torch.where(keep[:, None], out, torch.zeros((), device=dev))


class PiecewiseRunner:
    BAKE_CAPTURING_QUERY_LEN = False

    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        dev = self.backend.device
        self.model = TinyModel(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = [
            (torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)) for _ in range(LAYERS)
        ]
        self.graphs: dict[Any, Any] = {}
        self.outputs: dict[Any, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            i64, R, T = torch.int64, SPEC.max_num_reqs, MAX_TOKENS
            self.buffers = {
                "tokens": torch.zeros(T, dtype=i64, device=dev),
                "positions": torch.zeros(T, dtype=i64, device=dev),
                "slots": torch.zeros(T, dtype=i64, device=dev),
                "token_req": torch.zeros(T, dtype=i64, device=dev),
                "query_start": torch.zeros(max(R, T) + 1, dtype=i64, device=dev),
                "seq_lens": torch.zeros(max(R, T), dtype=i64, device=dev),
                "tables": torch.zeros(max(R, T), SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "last": torch.zeros(max(R, T), dtype=i64, device=dev),
            }

    # -- graph mode -----------------------------------------------------------------------------

    def key_for(self, batch: Batch) -> tuple[str, int, int] | None:
        """(kind, padded tokens, padded requests), or None when no graph serves the batch."""
        if batch.num_reqs == 0 or batch.num_tokens > MAX_TOKENS:
            return None
        if all(n == 1 for n in batch.query_lens):
            size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
            return ("decode", size, size)
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_tokens)
        return ("varlen", size, min(size, SPEC.max_num_reqs))

    def static_inputs(self, tokens: int, reqs: int) -> StepInputs:
        b = self.buffers
        return StepInputs(
            tokens=b["tokens"][:tokens],
            positions=b["positions"][:tokens],
            slots=b["slots"][:tokens],
            token_req=b["token_req"][:tokens],
            query_start=b["query_start"][: reqs + 1],
            seq_lens=b["seq_lens"][:reqs],
            tables=b["tables"][:reqs],
            last=b["last"][:reqs],
        )

    def prepare(self, batch: Batch, tokens: int, reqs: int) -> None:
        """Write the batch into the prefix, padding sentinels into every other row a graph reads."""
        host = _host_inputs(batch.requests, tokens, reqs)
        for name, values in host.items():
            buf = self.buffers[name]
            staged = torch.tensor(values, dtype=buf.dtype).view(-1, *buf.shape[1:])
            buf[: staged.shape[0]].copy_(staged)

    def capture(self, key: tuple[str, int, int], max_query_len: int) -> None:
        _, tokens, reqs = key
        inputs = self.static_inputs(tokens, reqs)
        self.run_model(inputs, max_query_len)  # warm-up on the staged batch
        self.backend.synchronize()
        graph = self.backend.Graph()
        with self.backend.graph(graph):
            self.outputs[key] = self.run_model(inputs, max_query_len)
        self.graphs[key] = graph

    def replay(self, batch: Batch, key: tuple[str, int, int]) -> StepResult:
        kind, tokens, reqs = key
        self.prepare(batch, tokens, reqs)
        if key not in self.graphs:
            if kind == "decode":
                max_query_len = 1
            elif self.BAKE_CAPTURING_QUERY_LEN:
                max_query_len = max(batch.query_lens)  # BUG: the capturing batch's longest query
            else:
                max_query_len = tokens
            self.capture(key, max_query_len)
        self.graphs[key].replay()
        logits, next_tokens = self.outputs[key]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), next_tokens[:n].clone(), "full", (kind, tokens))

    # -- both modes -----------------------------------------------------------------------------

    def run_model(self, inputs: StepInputs, max_query_len: int) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inputs, self.kv, max_query_len)
        return logits, logits.argmax(-1)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        host = _host_inputs(batch.requests, batch.num_tokens, batch.num_reqs)
        dev = self.backend.device
        t = {n: torch.tensor(v, dtype=torch.int64, device=dev) for n, v in host.items()}
        t["tables"] = t["tables"].view(-1, SPEC.max_blocks_per_req)
        logits, tokens = self.run_model(StepInputs(**t), max(batch.query_lens))
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        if self.mode == "eager":
            return self.run_eager(batch, "eager twin")
        key = self.key_for(batch)
        if key is None:
            return self.run_eager(batch, "empty batch or more tokens than the largest capture size")
        return self.replay(batch, key)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{kind}{i}": kv[j] for i, kv in enumerate(self.kv) for j, kind in enumerate("kv")}

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


def _slot(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def _host_inputs(requests: Sequence[Request], tokens: int, reqs: int) -> dict[str, list[Any]]:
    """Host rows for `tokens` token rows and `reqs` request rows; rows past the batch are padding:
    null slot and null block table, requests with empty queries, tokens belonging to no query."""
    out: dict[str, list[Any]] = {n: [] for n in ("tokens", "positions", "slots", "token_req")}
    starts, seq_lens, tables, last = [0], [], [], []
    for row, r in enumerate(requests):
        for i, tok in enumerate(r.tokens):
            out["tokens"].append(tok)
            out["positions"].append(r.context_len + i)
            out["slots"].append(_slot(r, r.context_len + i))
            out["token_req"].append(row)
        starts.append(len(out["tokens"]))
        seq_lens.append(r.seq_len)
        tables.append(
            list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
        )
        last.append(len(out["tokens"]) - 1)
    n = len(out["tokens"])
    pad_t = tokens - n
    out["tokens"] += [0] * pad_t
    out["positions"] += [0] * pad_t
    out["slots"] += [NULL_SLOT] * pad_t
    out["token_req"] += [0] * pad_t
    pad_r = reqs - len(requests)
    starts += [n] * pad_r
    seq_lens += [0] * pad_r
    tables += [[SPEC.null_block] * SPEC.max_blocks_per_req] * pad_r
    last += [max(n - 1, 0)] * pad_r
    out.update(
        query_start=starts, seq_lens=seq_lens, tables=[x for t in tables for x in t], last=last
    )
    return out


class BuggyRunner(PiecewiseRunner):
    BAKE_CAPTURING_QUERY_LEN = True


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PiecewiseRunner:
    return PiecewiseRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PiecewiseRunner:
    return BuggyRunner(mode, seed=seed, backend=backend)
