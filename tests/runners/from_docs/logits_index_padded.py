"""Token-major padded graphs for decode, prefill and mixed batches.

Graph mode (backend facade) captures two graph kinds per token capture size:
- ("decode", S): every request has one query token; T == R, logits for every row, no gather.
- ("varlen", S): all rows' query tokens concatenated (token-major), padded to S tokens; each
  request's logits are gathered from the hidden state of its LAST query token through a static
  `logits_index` buffer built on the host from the cumulative sum of the query lengths
  (query_start_loc of the padded layout).
Batches above the largest capture size run eagerly (unpadded path, its own last-token index).

`make_buggy_target` builds the last-token index as query_start_loc[1:] (the exclusive end)
instead of query_start_loc[1:] - 1, clamped to the padded buffer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=128,
    max_num_reqs=8,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8, 16),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
MAX_TOKENS = SPEC.capture_sizes[-1]
MAX_ROWS = SPEC.max_num_reqs
M32 = 0xFFFFFFFF


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


class Model:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
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

    def hidden(self, tokens, positions, slots, tables, k_cache, v_cache) -> Tensor:
        """Token-major forward: [T] inputs -> [T, hidden]."""
        w = self.w
        x = w["embed"][tokens] + w["pos"][positions]
        h = _rms(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=x.device)
        ctx = (tables[:, :, None] * SPEC.block_size + offs).flatten(1)  # [T, CONTEXT]
        keys, vals = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = scores / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=x.device))
        att = torch.einsum("thc,tchd->thd", probs, vals).flatten(1)
        x = x + att @ w["wo"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        return x

    def logits(self, x: Tensor) -> Tensor:
        return _rms(x) @ self.w["head"]


def sample(logits: Tensor, positions: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor):
    """Gumbel-max, noise from a hash of (seed, position of the last query token, token id)."""
    key = _hash(_hash(seeds) ^ ((positions * 0x9E3779B1) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
    u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


def _token_rows(batch: Batch) -> dict[str, list]:
    rows: dict[str, list] = {"tokens": [], "positions": [], "slots": [], "tables": []}
    for r in batch.requests:
        for i, tok in enumerate(r.tokens):
            rows["tokens"].append(tok)
            rows["positions"].append(r.context_len + i)
            rows["slots"].append(_slot(r, r.context_len + i))
            rows["tables"].append(_table(r))
    return rows


class Runner:
    def __init__(self, mode: str, *, seed: int, backend: str, buggy: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.buggy = buggy
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k = torch.zeros(shape, device=dev)
        self.v = torch.zeros(shape, device=dev)
        self.graphs: dict[tuple, Any] = {}
        self.outputs: dict[tuple, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            i64 = torch.int64
            self.buffers = {
                "tokens": torch.zeros(MAX_TOKENS, dtype=i64, device=dev),
                "positions": torch.zeros(MAX_TOKENS, dtype=i64, device=dev),
                "slots": torch.zeros(MAX_TOKENS, dtype=i64, device=dev),
                "tables": torch.zeros(MAX_TOKENS, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "logits_index": torch.zeros(MAX_ROWS, dtype=i64, device=dev),
                "seeds": torch.zeros(MAX_ROWS, dtype=i64, device=dev),
                "temperatures": torch.ones(MAX_ROWS, device=dev),
                "sampled": torch.zeros(MAX_ROWS, dtype=torch.bool, device=dev),
            }
            self.capture()

    # -- graph mode ------------------------------------------------------------------------
    @staticmethod
    def keys() -> list[tuple[str, int]]:
        keys = [("varlen", s) for s in SPEC.capture_sizes if s >= 2]
        keys += [("decode", s) for s in SPEC.capture_sizes if s <= MAX_ROWS]
        return sorted(keys, key=lambda k: (-k[1], k[0]))

    @staticmethod
    def req_rows(key: tuple[str, int]) -> int:
        return key[1] if key[0] == "decode" else min(key[1], MAX_ROWS)

    def graph_forward(self, key: tuple[str, int]) -> tuple[Tensor, Tensor]:
        size, rows = key[1], self.req_rows(key)
        b = self.buffers
        positions = b["positions"][:size]
        x = self.model.hidden(
            b["tokens"][:size], positions, b["slots"][:size], b["tables"][:size], self.k, self.v
        )
        if key[0] == "varlen":
            index = b["logits_index"][:rows]
            x, positions = x[index], positions[index]
        logits = self.model.logits(x)
        tokens = sample(
            logits, positions, b["seeds"][:rows], b["temperatures"][:rows], b["sampled"][:rows]
        )
        return logits, tokens

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for key in self.keys():
            self.prepare(Batch(()), key)
            self.graph_forward(key)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[key] = self.graph_forward(key)
            self.graphs[key] = g

    def logits_index(self, query_lens: Sequence[int], size: int, rows: int) -> list[int]:
        """Last query token of each row in the padded token-major layout."""
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        qsl += [qsl[-1]] * (rows - len(query_lens))  # padding rows: empty, at the end
        if self.buggy:
            return [min(end, size - 1) for end in qsl[1:]]
        return [max(end - 1, 0) for end in qsl[1:]]

    def prepare(self, batch: Batch, key: tuple[str, int]) -> None:
        size, rows = key[1], self.req_rows(key)
        t = _token_rows(batch)
        pad_t = size - len(t["tokens"])
        vals: dict[str, list] = {
            "tokens": t["tokens"] + [0] * pad_t,
            "positions": t["positions"] + [0] * pad_t,
            "slots": t["slots"] + [NULL_SLOT] * pad_t,
            "tables": t["tables"] + [[SPEC.null_block] * SPEC.max_blocks_per_req] * pad_t,
        }
        samp = [_sampling(r) for r in batch.requests]
        pad_r = rows - len(samp)
        vals["seeds"] = [s[0] for s in samp] + [0] * pad_r
        vals["temperatures"] = [s[1] for s in samp] + [1.0] * pad_r
        vals["sampled"] = [s[2] for s in samp] + [False] * pad_r
        if key[0] == "varlen":
            vals["logits_index"] = self.logits_index(batch.query_lens, size, rows)
        for name, v in vals.items():
            buf = self.buffers[name]
            buf[: len(v)].copy_(torch.tensor(v, dtype=buf.dtype))

    def graph_key(self, batch: Batch) -> tuple[str, int] | None:
        n = batch.num_tokens
        if n == 0 or n > MAX_TOKENS:
            return None
        size = next(s for s in SPEC.capture_sizes if s >= n)
        if all(q == 1 for q in batch.query_lens):
            return ("decode", size)
        return ("varlen", size)

    # -- both ------------------------------------------------------------------------------
    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.be.device
        t = _token_rows(batch)
        last, end = [], 0
        for q in batch.query_lens:
            end += q
            last.append(end - 1)
        i64 = torch.int64
        tt = {n: torch.tensor(v, dtype=i64, device=dev) for n, v in t.items()}
        tables = tt["tables"].view(-1, SPEC.max_blocks_per_req)
        x = self.model.hidden(tt["tokens"], tt["positions"], tt["slots"], tables, self.k, self.v)
        idx = torch.tensor(last, dtype=i64, device=dev)
        logits = self.model.logits(x[idx])
        samp = [_sampling(r) for r in batch.requests]
        tokens = sample(
            logits,
            tt["positions"][idx],
            torch.tensor([s[0] for s in samp], dtype=i64, device=dev),
            torch.tensor([s[1] for s in samp], dtype=torch.float32, device=dev),
            torch.tensor([s[2] for s in samp], dtype=torch.bool, device=dev),
        )
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        if self.mode == "eager":
            return self.run_eager(batch, "eager twin")
        key = self.graph_key(batch)
        if key is None:
            return self.run_eager(batch, "no capture size fits the batch's tokens")
        self.prepare(batch, key)
        self.graphs[key].replay()
        logits, tokens = self.outputs[key]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", key)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k, "v": self.v}

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, backend=backend, buggy=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, backend=backend, buggy=True)
