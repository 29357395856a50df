"""A hybrid (Mamba + attention) decode runner modelled on vLLM V1's per-group Mamba metadata
under full CUDA graphs with prefix caching of states, with one real bug.

The engine mechanism: a hybrid model such as Nemotron-H has several Mamba layer groups (KV cache
groups) beside its attention layers. Each group has its own attention-metadata builder, and each
builder owns persistent buffers that its layers' full decode CUDA graphs read: the state indices
(the group's block table) and, with `mamba_cache_mode="all"` (prefix caching keeps a state
checkpoint per block), two block-table columns per request: `block_idx_last_computed_token` (the
block whose state the step starts from) and `block_idx_last_scheduled_token` (the block the step's
final state goes to). When the graphs are captured every builder builds its own metadata
(`build_for_cudagraph_capture`), so group k's graph reads group k's buffers. At run time vLLM
builds the metadata once per distinct `(MambaSpec, builder type)`: the first group calls
`build()`, every later group with an identical spec gets the cached metadata through
`update_block_table()`, a shallow copy in which only its block table is replaced and copied into
its own persistent buffer.

This runner has two recurrent layers with identical specs ("ssm_a" before the attention layer and
"ssm_b" after it), each a group with its own builder and buffers, and one paged attention layer.
A recurrent layer keeps its state slot-major: the state after each token is stored in that
token's KV slot (an "all"-mode checkpoint at every position, so the harness can compare and mark
it), addressed as vLLM addresses it, block-table column plus the offset in the block: a step reads
the state at `table[col_last_computed] * block_size + (pos - 1) % block_size` and writes it at
`table[col_last_scheduled] * block_size + pos % block_size`. Decode steps of up to 4 rows, all
continuing a sequence, replay graphs captured at start-up for 1, 2 and 4 rows (padding rows point
at the null block, position 0, so they read no state and write only the null block); prefills,
mixed steps, first-token steps (no prior state, vLLM keeps them prefills) and batches above 4 rows
run eagerly on fresh metadata tensors.

The bug (`share_block_idx=True`): vllm-project/vllm issue #34865 ("Prefix caching failing for
Nemotron models", https://github.com/vllm-project/vllm/issues/34865: NaN logprobs and garbage
tokens with `mamba_cache_mode="all"`), fixed by PR #34874 ("Fix prefix caching for Mamba 'all'
mode (Nemotron models)", https://github.com/vllm-project/vllm/pull/34874).
`update_block_table()` copied the state indices into the current builder's persistent buffer but
left `block_idx_last_computed_token` and `block_idx_last_scheduled_token` as the first group's
tensors. Eagerly that is harmless (the first group's tensors hold the right values), but the
second group's captured graph reads its own two column buffers, which nothing refreshes after
capture: it reads its starting state from, and writes its new state to, whatever block column
those buffers last held. The fix copies both columns into the current builder's buffers too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),  # decode graphs, keyed by padded row count
    # no spec_decode: vLLM turns update_block_table() off with speculative decoding
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, STATE_DIM = 32, 2, 16, 24
BS, MAX_COLS = SPEC.block_size, SPEC.max_blocks_per_req
NULL = SPEC.null_block
_M32 = 0xFFFFFFFF
GROUPS = ("ssm_a", "ssm_b")  # two recurrent layer groups with equal specs
_GROUP_FIELDS = ("state_table", "col_last_computed", "col_last_scheduled")


@dataclass(frozen=True)
class MambaGroupSpec:
    """What vLLM keys its metadata cache on: groups with equal specs share one build()."""

    state_dim: int
    block_size: int


@dataclass(frozen=True)
class MambaGroupMetadata:
    state_table: Tensor  # [rows, MAX_COLS] the group's block table (its state indices)
    col_last_computed: Tensor  # [rows] block-table column of the state the step starts from
    col_last_scheduled: Tensor  # [rows] block-table column the step's new state goes to


@dataclass(frozen=True)
class CommonMetadata:
    """Per token of the step (a decode row is one token); host lists, uploaded once."""

    tokens: Tensor
    positions: Tensor
    slots: Tensor  # attention KV write slots
    tables: Tensor  # [tokens, MAX_COLS] the token's request's block table, null-padded
    col_last_computed: list[int]
    col_last_scheduled: list[int]


class MambaGroupBuilder:
    """One per recurrent layer group; owns the persistent buffers that group's graphs read."""

    def __init__(self, spec: MambaGroupSpec, device: Any, persistent: bool, share_block_idx: bool):
        self.spec, self.device, self.share_block_idx = spec, device, share_block_idx
        rows = max(SPEC.capture_sizes)
        self.buffers: dict[str, Tensor] = {}
        if persistent:
            self.buffers = {
                "state_table": torch.zeros(rows, MAX_COLS, dtype=torch.int64, device=device),
                "col_last_computed": torch.zeros(rows, dtype=torch.int64, device=device),
                "col_last_scheduled": torch.zeros(rows, dtype=torch.int64, device=device),
            }

    def build(self, common: CommonMetadata, graph_rows: int | None) -> MambaGroupMetadata:
        dev = self.device
        meta = MambaGroupMetadata(
            common.tables,
            torch.tensor(common.col_last_computed, dtype=torch.int64, device=dev),
            torch.tensor(common.col_last_scheduled, dtype=torch.int64, device=dev),
        )
        if graph_rows is None:  # an eager step reads the fresh tensors
            return meta
        # A replayed step: everything goes into this builder's buffers, padding rows reset,
        # because the captured graph reads these addresses and nothing else.
        n = meta.state_table.shape[0]
        for name, pad in (
            ("state_table", NULL),
            ("col_last_computed", 0),
            ("col_last_scheduled", 0),
        ):
            self.buffers[name][:n].copy_(getattr(meta, name))
            self.buffers[name][n:graph_rows].fill_(pad)
        return MambaGroupMetadata(*(self.buffers[name][:graph_rows] for name in _GROUP_FIELDS))

    def update_block_table(
        self, cached: MambaGroupMetadata, table: Tensor, graph_rows: int | None
    ) -> MambaGroupMetadata:
        """Reuse another group's metadata (equal spec), swapping in this group's block table."""
        if graph_rows is None:
            return replace(cached, state_table=table)
        n = table.shape[0]
        buf = self.buffers
        buf["state_table"][:n].copy_(table)
        buf["state_table"][n:graph_rows].fill_(NULL)
        meta = replace(cached, state_table=buf["state_table"][:graph_rows])
        if self.share_block_idx:  # before PR #34874: the columns stay the first group's tensors
            return meta
        # PR #34874: this group's graph reads this group's column buffers; refresh them too
        # (the cached tensors already hold this step's values and padding for graph_rows rows).
        for name in ("col_last_computed", "col_last_scheduled"):
            buf[name][:graph_rows].copy_(getattr(cached, name))
        return replace(
            meta,
            col_last_computed=buf["col_last_computed"][:graph_rows],
            col_last_scheduled=buf["col_last_scheduled"][:graph_rows],
        )


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        for g in GROUPS:
            shapes |= {
                f"{g}.in": (HIDDEN, STATE_DIM),
                f"{g}.gate": (HIDDEN, STATE_DIM),
                f"{g}.out": (STATE_DIM, HIDDEN),
            }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: captured graphs read these tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def sample(logits: Tensor, reqs: Sequence[Request]) -> Tensor:
    """Gumbel-max with noise from (request seed, position, token id): nothing about the batch."""
    dev = logits.device
    seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], dtype=torch.int64, device=dev)
    pos = torch.tensor([r.seq_len - 1 for r in reqs], dtype=torch.int64, device=dev)
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    sampled = torch.tensor([r.seed is not None for r in reqs], dtype=torch.bool, device=dev)
    key = _hash(_hash(seeds) ^ ((pos * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], dtype=torch.int64, device=dev)
    bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class HybridMambaRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, share_block_idx: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        slots = SPEC.num_slots
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=dev)
        self.ssm = {g: torch.zeros(slots, STATE_DIM, device=dev) for g in GROUPS}
        group_spec = MambaGroupSpec(STATE_DIM, BS)  # equal for both groups, as in Nemotron-H
        self.group_specs = {g: group_spec for g in GROUPS}
        self.builders = {
            g: MambaGroupBuilder(group_spec, dev, mode == "graph", share_block_idx) for g in GROUPS
        }
        self.graphs: dict[int, Any] = {}
        self.graph_logits: dict[int, Tensor] = {}
        self.inputs: dict[str, Tensor] = {}
        if mode == "graph":
            rows = max(SPEC.capture_sizes)
            self.inputs = {
                "tokens": torch.zeros(rows, dtype=torch.int64, device=dev),
                "positions": torch.zeros(rows, dtype=torch.int64, device=dev),
                "slots": torch.zeros(rows, dtype=torch.int64, device=dev),
                "tables": torch.zeros(rows, MAX_COLS, dtype=torch.int64, device=dev),
            }
            self.capture()

    # -- metadata ---------------------------------------------------------------------------------

    def common_metadata(self, batch: Batch) -> tuple[CommonMetadata, list[Tensor], list[int]]:
        """Per token: inputs and block-table columns; also the recurrence's waves (the j-th
        token of every request, in order) and each request's last token."""
        tok, pos, slots, tables, cols_lc, cols_ls, waves, last = [], [], [], [], [], [], [], []
        for r in batch.requests:
            row = list(r.block_ids) + [NULL] * (MAX_COLS - len(r.block_ids))
            for j, t in enumerate(r.tokens):
                p = r.context_len + j
                if j == len(waves):
                    waves.append([])
                waves[j].append(len(tok))
                tok.append(t)
                pos.append(p)
                slots.append(kv_slot(r.block_ids, p, BS))
                tables.append(row)
                cols_lc.append(max(p - 1, 0) // BS)
                cols_ls.append(p // BS)
            last.append(len(tok) - 1)
        dev = self.device
        common = CommonMetadata(
            torch.tensor(tok, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            torch.tensor(slots, dtype=torch.int64, device=dev),
            torch.tensor(tables, dtype=torch.int64, device=dev).view(-1, MAX_COLS),
            cols_lc,
            cols_ls,
        )
        wave_idx = [torch.tensor(w, dtype=torch.int64, device=dev) for w in waves]
        return common, wave_idx, last

    def group_metadata(
        self, common: CommonMetadata, graph_rows: int | None, for_capture: bool = False
    ) -> dict[str, MambaGroupMetadata]:
        """vLLM's per-group loop: capture builds every group; otherwise one build per spec."""
        metas: dict[str, MambaGroupMetadata] = {}
        cached: dict[tuple, MambaGroupMetadata] = {}
        for g in GROUPS:
            builder = self.builders[g]
            key = (self.group_specs[g], type(builder))
            if for_capture:
                metas[g] = builder.build(common, graph_rows)
            elif key in cached:
                metas[g] = builder.update_block_table(cached[key], common.tables, graph_rows)
            else:
                metas[g] = cached[key] = builder.build(common, graph_rows)
        return metas

    # -- the model --------------------------------------------------------------------------------

    def recurrent(self, g: str, h: Tensor, positions: Tensor, meta, waves) -> Tensor:
        """Gated diagonal recurrence; the state after each token is stored in that token's slot."""
        w, state = self.w.t, self.ssm[g]
        u = h @ w[f"{g}.in"]
        decay = torch.sigmoid(h @ w[f"{g}.gate"])
        read_block = meta.state_table.gather(1, meta.col_last_computed[:, None])[:, 0]
        write_block = meta.state_table.gather(1, meta.col_last_scheduled[:, None])[:, 0]
        read_slot = read_block * BS + (positions - 1) % BS
        write_slot = write_block * BS + positions % BS
        has_prev = (positions > 0)[:, None]  # position 0 starts from a zero state
        out = torch.zeros(h.shape[0], STATE_DIM, device=h.device)
        zero = torch.zeros((), device=h.device)
        # token j of each request reads what token j - 1 wrote; a decode graph is one wave
        for idx in [slice(None)] if waves is None else waves:
            prev = torch.where(has_prev[idx], state[read_slot[idx]], zero)
            new = decay[idx] * prev + (1 - decay[idx]) * u[idx]
            state.index_copy_(0, write_slot[idx], new)
            out[idx] = new
        return out @ w[f"{g}.out"]

    def attention(self, h: Tensor, positions: Tensor, slots: Tensor, tables: Tensor) -> Tensor:
        w = self.w.t
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots, (h @ w["wk"]).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, (h @ w["wv"]).view(-1, HEADS, HEAD_DIM))
        ctx_slots = (tables[:, :, None] * BS + torch.arange(BS, device=h.device)).flatten(1)
        visible = torch.arange(ctx_slots.shape[1], device=h.device)[None, :] <= positions[:, None]
        zero = torch.zeros((), device=h.device)
        keys = torch.where(visible[:, :, None, None], self.k_cache[ctx_slots], zero)
        vals = torch.where(visible[:, :, None, None], self.v_cache[ctx_slots], zero)
        scores = torch.einsum("thd,tlhd->thl", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), -math.inf, device=h.device)
        )
        return torch.einsum("thl,tlhd->thd", scores.softmax(-1), vals).flatten(1) @ w["wo"]

    def forward(self, tokens, positions, slots, tables, metas, waves) -> Tensor:
        w = self.w.t
        x = w["embed"][tokens]
        x = x + self.recurrent("ssm_a", _norm(x), positions, metas["ssm_a"], waves)
        x = x + self.attention(_norm(x), positions, slots, tables)
        x = x + self.recurrent("ssm_b", _norm(x), positions, metas["ssm_b"], waves)
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        return _norm(x) @ w["head"]

    # -- graph mode -------------------------------------------------------------------------------

    def prepare(self, batch: Batch, rows: int, for_capture: bool = False) -> dict:
        """Write the batch into the static inputs' prefix, padding rows after it."""
        common, _, _ = self.common_metadata(batch)
        n, buf = batch.num_reqs, self.inputs
        for name, pad in (("tokens", 0), ("positions", 0), ("slots", NULL * BS), ("tables", NULL)):
            buf[name][:n].copy_(getattr(common, name))
            buf[name][n:rows].fill_(pad)
        return self.group_metadata(common, rows, for_capture)

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for rows in sorted(SPEC.capture_sizes, reverse=True):
            metas = self.prepare(Batch(()), rows, for_capture=True)
            args = [self.inputs[k][:rows] for k in ("tokens", "positions", "slots", "tables")]
            self.forward(*args, metas, None)  # warm-up outside the graph
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.graph_logits[rows] = self.forward(*args, metas, None)
            self.graphs[rows] = graph

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if any(len(r.tokens) != 1 for r in batch.requests):
            return "prefill or mixed batch"
        if any(r.context_len == 0 for r in batch.requests):
            return "first token of a prompt: no prior state (a prefill)"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more rows than the largest graph"
        return None

    # -- steps ------------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self.run_eager(batch, reason)
        rows = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, rows)  # metadata goes into the buffers the graph reads
        self.graphs[rows].replay()
        logits = self.graph_logits[rows][: batch.num_reqs].clone()
        return StepResult(logits, sample(logits, batch.requests), "full", ("decode", rows))

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        common, waves, last = self.common_metadata(batch)
        metas = self.group_metadata(common, None)
        logits = self.forward(
            common.tokens, common.positions, common.slots, common.tables, metas, waves
        )
        logits = logits[torch.tensor(last, dtype=torch.int64, device=self.device)]
        return StepResult(logits, sample(logits, batch.requests), "eager", None, reason)

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache, **self.ssm}

    def static_buffers(self) -> Mapping[str, Tensor]:
        groups = {f"{g}.{k}": t for g, b in self.builders.items() for k, t in b.buffers.items()}
        return {**self.inputs, **groups}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_logits.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridMambaRunner:
    return HybridMambaRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> HybridMambaRunner:
    return HybridMambaRunner(mode, seed=seed, backend=backend, share_block_idx=True)
