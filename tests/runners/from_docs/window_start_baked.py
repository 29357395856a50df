"""A sliding-window decoder runner written against the backend facade.

The model: one decoder layer (token embedding + learned positions, RMS norm, q/k/v/o attention
over a slot-major paged KV cache read through block tables, a SiLU MLP, an LM head). Attention is
local: the token at position p attends only to positions p - WINDOW + 1 .. p. To save bandwidth a
row reads only the few block-table columns its window can touch: from its window's first block
(`(p - WINDOW + 1) // block_size`, clamped at 0) on, NUM_WINDOW_BLOCKS columns, and masks the rest
by position. Sampling is Gumbel-max from a hash of (seed, position, token id).

Graph mode: decode batches (one query token per request, at most the largest capture size of
requests) replay a graph per capture size, captured lazily the first time a batch needs that size
(warm-up on the batch itself, then capture, into one shared pool). Anything else runs eagerly.

Correct runner (`make_target`): each row's window start is computed on the device from that row's
position inside the captured forward, so every replay recomputes it from the positions buffer.

Bug (`make_buggy_target`): the batch's window start is computed on the host, once for all rows:
the smallest window start of its rows (`max(0, min(p) - WINDOW + 1) // block_size`, a Python
int), and every row reads its block-table columns from there on. Eagerly that is right for every
batch; in a graph the int is frozen at the capture batch's value, so a graph first captured for
rows that are all past the window start replays a batch with a short row (a request just
admitted) from a later block than that row's window starts at, and the row misses its own keys.
Modelled on engines deriving sliding-window metadata from
host values of the capture batch: vLLM PR #40961 (SWA layers picked the full-attention kernel
because the seq len seen at capture was 1, https://github.com/vllm-project/vllm/pull/40961),
SGLang PR #1090 (window attention vs cuda graph, https://github.com/sgl-project/sglang/pull/1090)
and flash-attention issue #1164 (host `max_seqlen_k` frozen at capture,
https://github.com/Dao-AILab/flash-attention/issues/1164).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=48,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 6),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
WINDOW = 7  # positions a token sees, itself included; below the 32 a request can reach
BS = SPEC.block_size
MAXB = SPEC.max_blocks_per_req
NUM_WINDOW_BLOCKS = (WINDOW - 2) // BS + 2  # most blocks a window of WINDOW positions touches
CONTEXT = MAXB * BS
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NULL_SLOT = SPEC.null_block * BS
M32 = 0xFFFFFFFF
INPUT_NAMES = ("tokens", "positions", "slots", "tables", "seeds", "temps", "sampled")


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash32(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x2C1B3C6D) & M32
    x = (((x >> 13) ^ x) * 0x297A2D39) & M32
    return (x >> 16) ^ x


def window_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    positions: Tensor,
    first_block: Tensor | int,
) -> Tensor:
    """q [T, hidden]; tables [T, MAXB]; positions [T]. Each row reads NUM_WINDOW_BLOCKS block-table
    columns from `first_block` (its window's first block, a [T] device tensor), or every column
    from one host int on."""
    dev = q.device
    if isinstance(first_block, int):  # one start for the batch: read every column from it on
        cols = torch.arange(first_block, MAXB, device=dev)[None, :].expand(q.shape[0], -1)
    else:
        cols = first_block[:, None] + torch.arange(NUM_WINDOW_BLOCKS, device=dev)[None, :]
    in_table = cols < MAXB
    blocks = tables.gather(1, cols.clamp(max=MAXB - 1))  # [T, C]
    off = torch.arange(BS, device=dev)
    slots = (blocks[:, :, None] * BS + off).flatten(1)  # [T, C*BS]
    logical = (cols[:, :, None] * BS + off).flatten(1)  # positions those slots hold
    pos = positions[:, None]
    visible = in_table[:, :, None].expand(-1, -1, BS).flatten(1)
    visible = visible & (logical <= pos) & (logical > pos - WINDOW)
    keys, values = k_cache[slots], v_cache[slots]  # [T, C*BS, H, D]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    # Masked slots may hold NaN (the poisoned null block): zero them rather than 0 * NaN.
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=dev))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


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
        for name in sorted(self.w):  # in place: graphs keep reading these tensors
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def forward(
        self,
        inp: dict[str, Tensor],
        last: Tensor | None,
        kv: tuple[Tensor, Tensor],
        first_block: Tensor | int | None,
    ) -> tuple[Tensor, Tensor]:
        w = self.w
        positions = inp["positions"]
        x = w["embed"][inp["tokens"]] + w["pos"][positions]
        h = _rms(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        kv[0].index_copy_(0, inp["slots"], k.view(-1, HEADS, HEAD_DIM))
        kv[1].index_copy_(0, inp["slots"], v.view(-1, HEADS, HEAD_DIM))
        if first_block is None:  # the window's first block, per row, on the device
            first_block = (positions - (WINDOW - 1)).clamp(min=0) // BS
        x = x + window_attention(q, kv[0], kv[1], inp["tables"], positions, first_block) @ w["wo"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if last is not None:
            x, positions = x[last], positions[last]
        logits = _rms(x) @ w["head"]
        return logits, self.sample(logits, positions, inp)

    @staticmethod
    def sample(logits: Tensor, positions: Tensor, inp: dict[str, Tensor]) -> Tensor:
        key = _hash32(_hash32(inp["seeds"]) ^ ((positions * 0x61C88647) & M32))
        ids = torch.arange(logits.shape[-1], device=logits.device)
        bits = _hash32(key[:, None] ^ ((ids * 0x7FEB352D) & M32)[None, :])
        u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = logits / inp["temps"][:, None] - torch.log(-torch.log(u))
        return torch.where(inp["sampled"], noisy.argmax(-1), logits.argmax(-1))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (MAXB - len(r.block_ids))


def _token_rows(batch: Batch) -> tuple[dict[str, list[Any]], list[int]]:
    """Per query-token host rows (sampling columns per request) and each request's last row."""
    rows: dict[str, list[Any]] = {n: [] for n in INPUT_NAMES}
    last = []
    for r in batch.requests:
        for i, tok in enumerate(r.tokens):
            p = r.context_len + i
            rows["tokens"].append(tok)
            rows["positions"].append(p)
            rows["slots"].append(kv_slot(r.block_ids, p, BS))
            rows["tables"].append(_table(r))
        last.append(len(rows["tokens"]) - 1)
        seed, temp, sampled = _sampling(r)
        rows["seeds"].append(seed)
        rows["temps"].append(temp)
        rows["sampled"].append(sampled)
    return rows, last


PADDING = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
}
DTYPES = {"temps": torch.float32, "sampled": torch.bool}


class SlidingWindowRunner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = (torch.zeros(shape, device=dev), torch.zeros(shape, device=dev))
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        self.pool: Any = None
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            self.buffers = {
                n: torch.zeros(
                    (rows, MAXB) if n == "tables" else (rows,),
                    dtype=DTYPES.get(n, torch.int64),
                    device=dev,
                )
                for n in INPUT_NAMES
            }
            self.pool = self.be.graph_pool_handle()

    def first_block(self, positions: list[int]) -> int | None:
        """None: each row computes its window's first block on the device."""
        return None

    def run(self, inp: dict[str, Tensor], last: Tensor | None, positions: list[int]):
        return self.model.forward(inp, last, self.kv, self.first_block(positions))

    # -- graph mode ---------------------------------------------------------------------------

    def prepare(self, batch: Batch, size: int) -> None:
        rows, _ = _token_rows(batch)
        n = batch.num_reqs
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[n:size].fill_(PADDING[name])

    def capture(self, size: int, batch: Batch) -> None:
        """Lazily, with `batch` already in the static buffers."""
        inp = {n: b[:size] for n, b in self.buffers.items()}
        positions = [r.context_len for r in batch.requests]
        positions += [PADDING["positions"]] * (size - len(positions))  # padding rows
        self.run(inp, None, positions)  # warm-up (writes the same keys the replay writes)
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            self.outputs[size] = self.run(inp, None, positions)
        self.graphs[size] = graph

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        if size not in self.graphs:
            self.capture(size, batch)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ---------------------------------------------------------------------------

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode" or batch.query_lens[0] != 1:
            return "not a one-token decode batch"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        dev = self.be.device
        rows, last = _token_rows(batch)
        inp = {
            n: torch.tensor(v, dtype=DTYPES.get(n, torch.int64), device=dev)
            for n, v in rows.items()
        }
        inp["tables"] = inp["tables"].view(-1, MAXB)
        logits, tokens = self.run(inp, torch.tensor(last, device=dev), rows["positions"])
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            dev = self.be.device
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=dev),
                torch.zeros(0, dtype=torch.int64, device=dev),
                "eager",
                None,
                reason="empty batch",
            )
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.kv[0], "v": self.kv[1]}

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


class BatchWindowStartRunner(SlidingWindowRunner):
    """The bug: one window start for the whole batch, computed on the host from the positions of
    the batch it is called with."""

    def first_block(self, positions: list[int]) -> int:
        return max(0, min(positions) - (WINDOW - 1)) // BS


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SlidingWindowRunner:
    return SlidingWindowRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SlidingWindowRunner:
    return BatchWindowStartRunner(mode, seed=seed, backend=backend)
