"""A graph runner whose data-parallel ranks agree on a padded size and on whether to replay.

A one-layer decoder (token embedding plus learned positions, attention over a slot-major paged KV
cache read through block tables, a SiLU MLP standing in for a mixture of experts, an LM head) with
counter-based sampling. Between the attention and the MLP sits an expert-parallel exchange: every
rank all-gathers the step's hidden states (a stand-in for the MoE all-to-all dispatch and combine:
each rank's tokens come back to it), so every rank must reach it at every step with the same
number of rows. On sim a collective cannot be captured, so graph mode is piecewise on both
backends: one graph before the exchange (embedding, KV write, attention) and one after it (MLP,
head, sampler), captured at start-up for each capture size, largest first, into one shared pool,
keyed by the padded token count. Batches whose rows all have one query token replay them; a
batch with a longer query (a prompt, a chunk) or more tokens than the largest capture size runs
eagerly. Each step begins with an all-reduce (MAX) over the ranks: every rank pads its batch to
the largest token count any rank has (vLLM's data-parallel padding), an idle rank runs that many
padding rows as a dummy batch, and the exchange always sees equal shapes.

    make_target:        the all-reduce carries each rank's "cannot replay" flag next to its
                        token count, so when any rank's batch needs the eager path (a prefill,
                        too many tokens, a rank forced eager) every rank runs eagerly that step,
                        padded to the agreed count: same path, same key, same collective shapes.
    make_buggy_target:  the all-reduce carries the token count alone and each rank decides graph
                        or eager from its own batch. On a step where one rank prefills and the
                        other only decodes, one replays the piecewise graph of the padded capture
                        size and the other runs eagerly with the unrounded count: they take
                        different paths, and their exchanges differ in size (gloo aborts, NCCL
                        reads past the smaller buffer or hangs), as in vLLM's DP ranks disagreeing
                        on the CUDA graph mode before the mode was synchronized across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime import data_parallel
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
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    """One step's device tensors: T tokens (padding included), R requests."""

    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T] the KV slot each token writes
    tables: Tensor  # [T, max_blocks_per_req] the block table of each token's request
    sample_positions: Tensor  # [R] each request's last query position
    seeds: Tensor  # [R] 32-bit sampling seed
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool: False = greedy
    last: Tensor | None = None  # [R] each request's last token row; None when every row is one


class Decoder:
    """Weights and the two halves of the forward pass; no host reads, so each can be captured."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "qkv": (HIDDEN, 3 * HIDDEN),
            "out": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        """In place, so the captured graphs read the new weights."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    def attend(self, inputs: StepInputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Embedding, KV write and attention: [T, hidden]."""
        w = self.weights
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]
        q, k, v = (_rms(x) @ w["qkv"]).split(HIDDEN, dim=-1)
        # Store this step's keys before reading: a prompt's later tokens attend to its earlier ones.
        k_cache.index_copy_(0, inputs.slots, k.reshape(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, inputs.slots, v.reshape(-1, HEADS, HEAD_DIM))
        offsets = torch.arange(SPEC.block_size, device=x.device)
        context = (inputs.tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, C]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= inputs.positions[:, None]
        keys, values = k_cache[context], v_cache[context]  # [T, C, heads, dim]
        zero = torch.zeros((), device=x.device)
        # Masked slots may hold NaN (the null block) or the harness's mark: 0 * NaN is NaN.
        keys = torch.where(visible[:, :, None, None], keys, zero)
        values = torch.where(visible[:, :, None, None], values, zero)
        scores = torch.einsum("thd,tchd->thc", q.reshape(-1, HEADS, HEAD_DIM), keys)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = (scores / math.sqrt(HEAD_DIM)).softmax(-1)
        return x + torch.einsum("thc,tchd->thd", probs, values).flatten(1) @ w["out"]

    def finish(self, hidden: Tensor, inputs: StepInputs) -> tuple[Tensor, Tensor]:
        """Expert MLP, head and sampler on each request's last token: ([R, vocab], [R])."""
        w = self.weights
        if inputs.last is not None:
            hidden = hidden[inputs.last]
        hidden = hidden + torch.nn.functional.silu(_rms(hidden) @ w["up"]) @ w["down"]
        logits = _rms(hidden) @ w["head"]
        return logits, _sample(logits, inputs)


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    """A 32-bit integer mix; every product stays below 2**63."""
    x = (((x >> 16) ^ x) * 0x7FEB352D) & _MASK32
    x = (((x >> 15) ^ x) * 0x846CA68B) & _MASK32
    return (x >> 16) ^ x


def _sample(logits: Tensor, inputs: StepInputs) -> Tensor:
    """Gumbel-max with noise from (seed, position, token id): the same in any batch or bucket."""
    key = _hash(inputs.seeds ^ ((inputs.sample_positions * 0x9E3779B9) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x2C1B3C6D) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24  # never 0 or 1
    noisy = logits / inputs.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inputs.sampled, noisy.argmax(-1), logits.argmax(-1))


class DataParallelRunner:
    """The target contract; `mode="graph"` captures the two pieces per size at start-up."""

    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, agree_on_mode: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.agree_on_mode = agree_on_mode
        self.backend: Any = get_backend(backend)
        # Read once, as an engine reads its parallel state at start-up.
        self.member = data_parallel.current()
        device = self.backend.device
        self.model = Decoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=device)
        self.v_cache = torch.zeros(shape, device=device)
        self.buffers: dict[str, Tensor] = {}
        self.before: dict[int, Any] = {}  # size -> graph up to the exchange
        self.after: dict[int, Any] = {}  # size -> graph from the exchange on
        self.hidden: dict[int, Tensor] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self.buffers = self.allocate(SPEC.capture_sizes[-1])
            self.capture()

    # -- data parallelism -------------------------------------------------------------------------

    @property
    def ranks(self) -> int:
        return 1 if self.member is None else self.member.world_size

    def collective(self, call: Any, *args: Any) -> None:
        member = self.member
        assert member is not None
        if member.watch is not None:
            member.watch("enter")
        call(*args, group=member.group)
        if member.watch is not None:
            member.watch("leave")

    def agree(self, batch: Batch, reason: str | None) -> tuple[int, bool]:
        """The token count every rank pads to, and whether this rank replays."""
        if self.ranks == 1:
            return batch.num_tokens, reason is None
        assert self.member is not None
        row = [batch.num_tokens]
        if self.agree_on_mode:
            row.append(int(reason is not None))
        agreed = torch.tensor(row, dtype=torch.int64, device=self.member.device)
        self.collective(dist.all_reduce, agreed, dist.ReduceOp.MAX)
        values = agreed.cpu().tolist()
        if self.agree_on_mode:
            return values[0], values[1] == 0
        return values[0], reason is None

    def exchange(self, hidden: Tensor) -> Tensor:
        """The expert-parallel all-to-all's stand-in: each rank's rows travel and come back."""
        if self.ranks == 1:
            return hidden
        member = self.member
        assert member is not None
        local = hidden.to(member.device)
        rows = [torch.empty_like(local) for _ in range(member.world_size)]
        self.collective(dist.all_gather, rows, local)
        return rows[member.rank].to(hidden.device)

    # -- graph mode -------------------------------------------------------------------------------

    def allocate(self, rows: int) -> dict[str, Tensor]:
        device, i64 = self.backend.device, torch.int64
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=device),
            "positions": torch.zeros(rows, dtype=i64, device=device),
            "slots": torch.zeros(rows, dtype=i64, device=device),
            "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=device),
            "sample_positions": torch.zeros(rows, dtype=i64, device=device),
            "seeds": torch.zeros(rows, dtype=i64, device=device),
            "temperatures": torch.ones(rows, device=device),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
            "exchanged": torch.zeros(rows, HIDDEN, device=device),  # what the second piece reads
        }

    def static_inputs(self, size: int) -> StepInputs:
        names = [f.name for f in fields(StepInputs) if f.name != "last"]
        return StepInputs(**{name: self.buffers[name][:size] for name in names})

    def capture(self) -> None:
        """Largest first into one pool; the exchange runs between the two pieces, uncaptured."""
        pool = self.backend.graph_pool_handle()
        exchanged = self.buffers["exchanged"]
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inputs = self.static_inputs(size)
            exchanged[:size].copy_(self.model.attend(inputs, self.k_cache, self.v_cache))
            self.model.finish(exchanged[:size], inputs)  # warm-up outside the graphs
            self.backend.synchronize()
            before, after = self.backend.Graph(), self.backend.Graph()
            with self.backend.graph(before, pool=pool):
                self.hidden[size] = self.model.attend(inputs, self.k_cache, self.v_cache)
            with self.backend.graph(after, pool=pool):
                self.outputs[size] = self.model.finish(exchanged[:size], inputs)
            self.before[size], self.after[size] = before, after

    def prepare(self, batch: Batch, size: int) -> None:
        """The batch into the buffers' prefix, padding sentinels in every other row up to size."""
        n = batch.num_reqs
        for name, values in _decode_rows(batch.requests).items():
            buffer = self.buffers[name]
            if n:
                buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype))
            buffer[n:size].fill_(_PADDING[name])

    def replay(self, batch: Batch, size: int) -> StepResult:
        self.prepare(batch, size)
        self.before[size].replay()
        self.buffers["exchanged"][:size].copy_(self.exchange(self.hidden[size]))
        self.after[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "piecewise", ("tokens", size))

    # -- both modes -------------------------------------------------------------------------------

    def run_eager(self, batch: Batch, padded: int, reason: str) -> StepResult:
        inputs = _eager_inputs(batch, padded, self.backend.device)
        hidden = self.exchange(self.model.attend(inputs, self.k_cache, self.v_cache))
        logits, tokens = self.model.finish(hidden, inputs)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def local_reason(self, batch: Batch) -> str | None:
        """Why this rank's own batch cannot replay a graph; None when it can."""
        if self.mode == "eager":
            return "eager twin"
        if self.member is not None and self.member.force_eager:
            return "rank forced eager"
        if any(n != 1 for n in batch.query_lens):
            return "query longer than one token (prefill chunk)"
        if batch.num_tokens > SPEC.capture_sizes[-1]:
            return "more tokens than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.local_reason(batch)
        tokens, replay = self.agree(batch, reason)
        if tokens == 0:  # no rank has work: nobody runs anything
            empty = torch.zeros(0, SPEC.vocab_size, device=self.backend.device)
            zero = torch.zeros(0, dtype=torch.int64, device=self.backend.device)
            return StepResult(empty, zero, "eager", None, reason="no rank has work")
        size = next((s for s in SPEC.capture_sizes if s >= tokens), None)
        if replay and size is not None:
            return self.replay(batch, size)
        if reason is None:
            reason = "another data-parallel rank runs eagerly"
            if size is None:
                reason = "another data-parallel rank has more tokens than the largest graph"
        return self.run_eager(batch, tokens, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for graph in (*self.before.values(), *self.after.values()):
            graph.reset()
        self.before.clear()
        self.after.clear()
        self.hidden.clear()
        self.outputs.clear()


_PADDING: dict[str, float | int | bool] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,  # padding writes the null block and nothing else
    "tables": SPEC.null_block,
    "sample_positions": 0,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(request: Request, position: int) -> int:
    block = request.block_ids[position // SPEC.block_size]
    return block * SPEC.block_size + position % SPEC.block_size


def _table(request: Request) -> list[int]:
    return list(request.block_ids) + [SPEC.null_block] * (
        SPEC.max_blocks_per_req - len(request.block_ids)
    )


def _sampling(request: Request) -> tuple[int, float, bool]:
    if request.seed is None:
        return 0, 1.0, False
    return (request.seed ^ (request.seed >> 32)) & _MASK32, float(request.temperature), True


def _decode_rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    """Per-row host values of a batch whose requests have one query token each."""
    sampling = [_sampling(r) for r in requests]
    return {
        "tokens": [r.tokens[0] for r in requests],
        "positions": [r.context_len for r in requests],
        "slots": [_slot(r, r.context_len) for r in requests],
        "tables": [_table(r) for r in requests],
        "sample_positions": [r.context_len for r in requests],
        "seeds": [s[0] for s in sampling],
        "temperatures": [s[1] for s in sampling],
        "sampled": [s[2] for s in sampling],
    }


def _eager_inputs(batch: Batch, padded: int, device: torch.device) -> StepInputs:
    """Every request's query tokens in order, then padding rows up to `padded` tokens."""
    tokens, positions, slots, tables, last = [], [], [], [], []
    for request in batch.requests:
        for i, token in enumerate(request.tokens):
            tokens.append(token)
            positions.append(request.context_len + i)
            slots.append(_slot(request, request.context_len + i))
            tables.append(_table(request))
        last.append(len(tokens) - 1)
    pad = padded - len(tokens)
    tokens += [0] * pad
    positions += [0] * pad
    slots += [NULL_SLOT] * pad
    tables += [[SPEC.null_block] * SPEC.max_blocks_per_req] * pad
    sampling = [_sampling(r) for r in batch.requests]

    def tensor(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return StepInputs(
        tokens=tensor(tokens),
        positions=tensor(positions),
        slots=tensor(slots),
        tables=tensor(tables).view(-1, SPEC.max_blocks_per_req),
        sample_positions=tensor([r.seq_len - 1 for r in batch.requests]),
        seeds=tensor([s[0] for s in sampling]),
        temperatures=tensor([s[1] for s in sampling], torch.float32),
        sampled=tensor([s[2] for s in sampling], torch.bool),
        last=tensor(last),
    )


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DataParallelRunner:
    return DataParallelRunner(mode, seed=seed, backend=backend, agree_on_mode=True)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> DataParallelRunner:
    return DataParallelRunner(mode, seed=seed, backend=backend, agree_on_mode=False)
