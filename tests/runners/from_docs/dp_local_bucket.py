"""A data-parallel graph runner with token-padded graphs.

Each step the ranks agree on one shape, as data-parallel serving engines do: an all-reduce (max)
of every rank's token count (and a forced-eager flag) over the process group of
`data_parallel.current()`. Every rank then pads its batch to the capture size of that maximum and
replays the graphs of that size; an idle rank runs the agreed size with padding rows only and
returns empty results. Inside the forward sits a collective over a [padded_tokens, hidden] tensor
(an all-reduce of zeros added to the hidden states, standing in for a tensor/expert-parallel
layer's reduction), so every rank must use the same padded size. The sim backend cannot capture a
collective (aten.allreduce_ returns a host Work object), so each capture size has two graph
pieces, the part before the collective and the part after it, and the collective runs eagerly
between them (path "piecewise"). Batches whose agreed size is past the largest capture size run
eagerly on every rank with the same collective at the agreed (unpadded) size.

`make_buggy_target` pads to the capture size of the rank's own token count instead of the
agreed maximum (the data-parallel padding bug of public engines).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime import data_parallel
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=128,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    last: Tensor  # [R] index of each request's last query token
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x7FEB352D) & M32
    x = (((x >> 15) ^ x) * 0x846CA68B) & M32
    return (x >> 16) ^ x


class Model:
    """One decoder layer over a slot-major paged KV cache; no host reads."""

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
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.device = device
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def before(self, inp: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Embedding, KV write and attention: the part before the collective."""
        w = self.w
        x = w["embed"][inp.tokens] + w["pos"][inp.positions]
        h = _rms(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, inp.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, inp.slots, v.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=x.device)
        ctx = (inp.tables[:, :, None] * SPEC.block_size + offs).flatten(1)  # [T, CONTEXT]
        keys, values = k_cache[ctx], v_cache[ctx]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= inp.positions[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        scores = scores / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        att = torch.einsum("thc,tchd->thd", probs, values).flatten(1)
        return x + att @ w["wo"]

    def after(self, x: Tensor, inp: Inputs) -> tuple[Tensor, Tensor]:
        """MLP, LM head at each request's last token, sampling: the part after the collective."""
        w = self.w
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        x = x[inp.last]
        logits = _rms(x) @ w["head"]
        pos = inp.positions[inp.last]
        key = _hash(_hash(inp.seeds) ^ ((pos * 0x9E3779B1) & M32))
        ids = torch.arange(SPEC.vocab_size, device=x.device)
        bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
        u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = logits / inp.temperatures[:, None] - torch.log(-torch.log(u))
        tokens = torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))
        return logits, tokens


def _slot(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def _rows(batch: Batch) -> dict[str, list[Any]]:
    """Host values: token rows and request rows of a batch (any query lengths)."""
    tok, pos, slots, tables, last = [], [], [], [], []
    seeds, temps, sampled = [], [], []
    for r in batch.requests:
        table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
        for i, t in enumerate(r.tokens):
            tok.append(t)
            pos.append(r.context_len + i)
            slots.append(_slot(r, r.context_len + i))
            tables.append(table)
        last.append(len(tok) - 1)
        greedy = r.seed is None
        seeds.append(0 if greedy else r.seed & M32)
        temps.append(1.0 if greedy else float(r.temperature))
        sampled.append(not greedy)
    return {
        "tokens": tok,
        "positions": pos,
        "slots": slots,
        "tables": tables,
        "last": last,
        "seeds": seeds,
        "temperatures": temps,
        "sampled": sampled,
    }


PADDING: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "last": 0,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}
DTYPES = {
    "tokens": torch.int64,
    "positions": torch.int64,
    "slots": torch.int64,
    "tables": torch.int64,
    "last": torch.int64,
    "seeds": torch.int64,
    "temperatures": torch.float32,
    "sampled": torch.bool,
}


class DPRunner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        pad_to_local: bool = False,
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.pad_to_local = pad_to_local  # the bug: pad to the local count, not the agreed max
        self.backend: Any = get_backend(backend)
        self.device = self.backend.device
        member = data_parallel.current()
        self.member = member if member is not None and member.world_size > 1 else None
        self.model = Model(seed, self.device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k = torch.zeros(shape, device=self.device)
        self.v = torch.zeros(shape, device=self.device)
        self.graphs: dict[int, tuple[Any, Any]] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            self.buffers = {
                name: torch.zeros(
                    rows, SPEC.max_blocks_per_req, dtype=DTYPES[name], device=self.device
                )
                if name == "tables"
                else torch.zeros(rows, dtype=DTYPES[name], device=self.device)
                for name in PADDING
            }
            # between the two graph pieces: hidden states and the collective's tensor
            self.buffers["mid_h"] = torch.zeros(rows, HIDDEN, device=self.device)
            self.buffers["mid_r"] = torch.zeros(rows, HIDDEN, device=self.device)
            self.capture()

    # -- collectives ------------------------------------------------------------------------------

    def _collective(self, fn: Any) -> None:
        assert self.member is not None
        if self.member.watch is not None:
            self.member.watch("enter")
        fn()
        if self.member.watch is not None:
            self.member.watch("leave")

    def agree(self, batch: Batch) -> tuple[int, bool]:
        """All-reduce (max) of the token counts and forced-eager flags of every rank."""
        forced = self.mode == "eager" or bool(self.member is not None and self.member.force_eager)
        if self.member is None:
            return batch.num_tokens, forced
        local = torch.tensor(
            [batch.num_tokens, int(forced)], dtype=torch.int64, device=self.member.device
        )
        self._collective(
            lambda: dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.member.group)
        )
        most, any_forced = (int(v) for v in local.cpu().tolist())
        return most, bool(any_forced)

    def reduce_hidden(self, r: Tensor) -> None:
        """The in-model collective: every rank must pass the same [padded_tokens, hidden]."""
        if self.member is not None:
            self._collective(lambda: dist.all_reduce(r, group=self.member.group))

    # -- graph mode -------------------------------------------------------------------------------

    def static_inputs(self, size: int) -> Inputs:
        return Inputs(**{name: self.buffers[name][:size] for name in PADDING})

    def piece_a(self, size: int) -> None:
        h = self.model.before(self.static_inputs(size), self.k, self.v)
        self.buffers["mid_h"][:size].copy_(h)
        self.buffers["mid_r"][:size].zero_()

    def piece_b(self, size: int) -> tuple[Tensor, Tensor]:
        x = self.buffers["mid_h"][:size] + self.buffers["mid_r"][:size]
        return self.model.after(x, self.static_inputs(size))

    def capture(self) -> None:
        for size in sorted(SPEC.capture_sizes, reverse=True):
            pool = self.backend.graph_pool_handle()
            self.prepare(Batch(()), size)
            self.piece_a(size)  # warm-up
            self.piece_b(size)
            self.backend.synchronize()
            ga, gb = self.backend.Graph(), self.backend.Graph()
            with self.backend.graph(ga, pool=pool):
                self.piece_a(size)
            with self.backend.graph(gb, pool=pool):
                self.outputs[size] = self.piece_b(size)
            self.graphs[size] = (ga, gb)

    def prepare(self, batch: Batch, size: int) -> None:
        rows = _rows(batch)
        for name, values in rows.items():
            buf = self.buffers[name]
            n = len(values)
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(PADDING[name])

    def replay(self, batch: Batch, size: int) -> StepResult:
        self.prepare(batch, size)
        ga, gb = self.graphs[size]
        ga.replay()
        self.reduce_hidden(self.buffers["mid_r"][:size])
        gb.replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(
            logits[:n].clone(),
            tokens[:n].clone(),
            "piecewise",
            ("tokens", size),
            reason="collective between two graph pieces",
        )

    # -- eager ------------------------------------------------------------------------------------

    def run_eager(self, batch: Batch, agreed: int, reason: str) -> StepResult:
        r = torch.zeros(agreed, HIDDEN, device=self.device)
        if not batch.requests:  # idle rank: only the collective, at the agreed size
            self.reduce_hidden(r)
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(
                empty,
                torch.zeros(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason=reason,
            )
        rows = _rows(batch)
        inp = Inputs(
            **{
                name: torch.tensor(values, dtype=DTYPES[name], device=self.device)
                for name, values in rows.items()
            }
        )
        h = self.model.before(inp, self.k, self.v)
        self.reduce_hidden(r)
        logits, tokens = self.model.after(h + r[: batch.num_tokens], inp)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        agreed, forced = self.agree(batch)
        if forced:
            return self.run_eager(batch, agreed, "eager twin or a rank forced eager")
        if agreed > SPEC.capture_sizes[-1]:
            return self.run_eager(batch, agreed, f"{agreed} tokens past the largest capture size")
        if agreed == 0:
            return self.run_eager(batch, 0, "no rank has work")
        target = batch.num_tokens if self.pad_to_local else agreed
        size = next(s for s in SPEC.capture_sizes if s >= target)
        return self.replay(batch, size)

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k, "v": self.v}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for ga, gb in self.graphs.values():
            ga.reset()
            gb.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DPRunner:
    return DPRunner(mode, seed=seed, backend=backend, pad_to_local=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DPRunner:
    return DPRunner(mode, seed=seed, backend=backend, pad_to_local=True)
