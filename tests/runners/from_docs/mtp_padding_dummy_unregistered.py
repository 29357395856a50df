"""MTP-style one-model speculative decoding on CUDA graphs, with a per-request "past hidden state"
pool addressed through a slot manager, after TensorRT-LLM's PyTorch backend.

The engine mechanism (TensorRT-LLM `tensorrt_llm/_torch/speculative/mtp.py`: `MTPHiddenStatesManager`,
`MTPSpecMetadata.prepare`, `MTPWorker.update_mtp_hidden_states`; `pyexecutor/cuda_graph_runner.py`):
vanilla MTP keeps, for every live request, the target model's hidden state (and token) at its last
accepted position in a pool of rows handed out by a `SlotManager` keyed by request id. Every step,
`prepare()` looks each row's request id up in that slot manager on the host and stages the slot ids
into a persistent device buffer; inside the captured generation graph the MTP update scatters each
row's new hidden state into `pool[slot_ids[row]]`, which the draft heads read at the next step.
Generation batches (every row continues its sequence with the same query length, 1 + drafts) replay
a graph keyed by (padded rows, query length). A batch whose row count is not a captured size is
padded with a CUDA-graph dummy request (`CUDA_GRAPH_DUMMY_REQUEST_ID`) replicated into the padding
rows; its KV goes to the null block and its pool row is a spare one that no live request owns.

Here: a one-layer float32 decoder (token + learned positions, attention over a slot-major paged KV
cache read through block tables, SiLU MLP, LM head). The contract has no place for runner-made
drafts (the harness proposes them), so the MTP draft heads are left out; what stays is the part
the bug is in: the slot lookup and the in-graph scatter of each row's last-token hidden state into
the pool. The pool is exposed in `state()` (the live slots only, the dummy's spare row excluded),
so the harness compares it between the twins. Slots are handed out per request id: a request that
starts (`context_len` 0) gets a slot zeroed for it, a request whose blocks another request lists
has finished and its slot is freed (live requests never share blocks), and when none is free the
least recently seen entry is evicted. Sampling (greedy or Gumbel-max hashed from seed, position and
token id) runs after the replay, on the graph's logits. Prefill, mixed batches, query lengths past
`MAX_Q` and batches whose padded tokens exceed `max_num_tokens` run eagerly through the same forward.

The bug (`make_buggy_target`, `register_padding_dummy=False`): NVIDIA/TensorRT-LLM issue #5386
("invalid request_id in `MTPSpecMetadata`", https://github.com/NVIDIA/TensorRT-LLM/issues/5386, MTP
with `cuda_graph_padding_enabled`), fixed by PR #6258 ("Add cuda graph dummy requests to the
spec_resource_manager", https://github.com/NVIDIA/TensorRT-LLM/pull/6258). The padding dummy was
added to the KV cache manager when the padded batch was built, but never to the speculative
resource manager, so `prepare()` found no slot for its request id and the step failed on the host
("invalid slot id") on every padded replay; unpadded replays and eager steps never meet it, and the
graphs themselves were captured with warm-up requests that were registered. The fix registers the
dummy with the speculative resource manager too, where it owns a spare pool row of its own. Only
batches whose row count is not a captured size show the bug.
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
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),  # generation graphs pad their rows to one of these
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 64
MAX_Q = 5  # 1 + up to 4 drafts: the query lengths generation graphs are captured for
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
CTX = MAX_POS  # every row attends over its whole block table, masked by position
NUM_LIVE_SLOTS = 2 * SPEC.max_num_reqs  # the harness keeps at most this many requests live
CUDA_GRAPH_DUMMY_REQUEST_ID = -1  # stands for TensorRT-LLM's UINT64_MAX - 1
_M32 = 0xFFFFFFFF


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def sample(logits: Tensor, reqs: Sequence[Request]) -> Tensor:
    """Greedy, or Gumbel-max with noise hashed from (seed, position, token id): batch-independent."""
    dev = logits.device
    seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], dtype=torch.int64, device=dev)
    pos = torch.tensor([r.seq_len - 1 for r in reqs], dtype=torch.int64, device=dev)
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    sampled = torch.tensor([r.seed is not None for r in reqs], dtype=torch.bool, device=dev)
    key = _mix(_mix(seeds) ^ ((pos * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=dev)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class SlotManager:
    """Request id -> pool row, as TensorRT-LLM's `SlotManager` (plus the runner's own freeing)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: dict[int, int] = {}
        self.last_seen: dict[int, int] = {}
        self.clock = 0

    def add_slot(self, req_id: int) -> int:
        if req_id in self.slot_of:
            return self.slot_of[req_id]
        used = set(self.slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if not free:  # evict the entry seen longest ago (both twins evict alike)
            victim = min(self.last_seen, key=self.last_seen.__getitem__)
            free = [self.remove_slot(victim)]
        self.slot_of[req_id] = free[0]
        self.touch(req_id)
        return free[0]

    def remove_slot(self, req_id: int) -> int:
        self.last_seen.pop(req_id, None)
        return self.slot_of.pop(req_id)

    def touch(self, req_id: int) -> None:
        self.clock += 1
        self.last_seen[req_id] = self.clock

    def get_slot(self, req_id: int) -> int:
        slot = self.slot_of.get(req_id)
        if slot is None:  # what `torch.tensor([..., None])` refused in TensorRT-LLM's prepare()
            raise ValueError(f"invalid request_id {req_id} in MTPSpecMetadata: it holds no slot")
        return slot


class MtpGraphRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, register_padding_dummy: bool = True):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.register_padding_dummy = SPEC, mode, register_padding_dummy
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos_embed": (MAX_POS, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, FFN),
            "down": (FFN, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {name: torch.empty(shape, device=dev) for name, shape in shapes.items()}
        self.update_weights(seed)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        # MTPHiddenStatesManager's pool: live slots, then one spare row for the padding dummy
        self.mtp_pool = torch.zeros(NUM_LIVE_SLOTS + 1, HIDDEN, device=dev)
        self.mtp_slots = SlotManager(NUM_LIVE_SLOTS)
        self.dummy_slot = NUM_LIVE_SLOTS
        self.block_owner: dict[int, int] = {}
        self.graphs: dict[tuple[int, int], Any] = {}
        self.graph_logits: dict[tuple[int, int], Tensor] = {}
        self.pool = None
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            max_rows = SPEC.capture_sizes[-1]
            self.buffers = {
                "input_ids": torch.zeros(SPEC.max_num_tokens, dtype=torch.int64, device=dev),
                "position_ids": torch.zeros(SPEC.max_num_tokens, dtype=torch.int64, device=dev),
                "write_slots": torch.zeros(SPEC.max_num_tokens, dtype=torch.int64, device=dev),
                "block_tables": torch.zeros(
                    max_rows, SPEC.max_blocks_per_req, dtype=torch.int64, device=dev
                ),
                "mtp_slot_ids": torch.zeros(max_rows, dtype=torch.int64, device=dev),
            }

    # -- the model ------------------------------------------------------------------------------

    def forward(self, ids, pos, wslots, tables, q: int, mtp_slot_ids) -> Tensor:
        """Rows of q tokens each ([rows * q] flat); returns logits at each row's last token."""
        w = self.w
        rows = tables.shape[0]
        x = w["embed"][ids] + w["pos_embed"][pos]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        qh = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, wslots, (h @ w["wk"]).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, wslots, (h @ w["wv"]).view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=ids.device)
        ctx_slots = (tables[:, :, None] * SPEC.block_size + offs).reshape(rows, CTX)
        tok_slots = ctx_slots.repeat_interleave(q, dim=0)  # [T, CTX]
        visible = torch.arange(CTX, device=ids.device)[None, :] <= pos[:, None]
        keys, vals = self.k_cache[tok_slots], self.v_cache[tok_slots]  # [T, CTX, H, D]
        zero = torch.zeros((), device=ids.device)
        # masked slots may hold NaN (the poisoned null block): replace them, never multiply
        keys = torch.where(visible[:, :, None, None], keys, zero)
        vals = torch.where(visible[:, :, None, None], vals, zero)
        scores = torch.einsum("thd,tchd->thc", qh, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(
            visible[:, None, :], scores, torch.full((), -math.inf, device=zero.device)
        )
        attn = torch.einsum("thc,tchd->thd", scores.softmax(-1), vals).flatten(1)
        x = x + attn @ w["wo"]
        x = x + torch.nn.functional.silu(x @ w["up"]) @ w["down"]
        last = x.view(rows, q, HIDDEN)[:, q - 1]
        # MTPWorker.update_mtp_hidden_states: each row's hidden state at its last token goes to
        # its request's pool row, for the draft heads of the next step
        self.mtp_pool.index_copy_(0, mtp_slot_ids, last)
        return last @ w["lm_head"]

    # -- host bookkeeping ---------------------------------------------------------------------

    def track_requests(self, batch: Batch) -> None:
        """Hand out MTP slots: new and restarted requests get a zeroed one, finished ones free theirs."""
        for r in batch.requests:
            for b in r.block_ids:
                owner = self.block_owner.get(b)
                if owner is not None and owner != r.req_id and owner in self.mtp_slots.slot_of:
                    self.mtp_slots.remove_slot(owner)  # its owner finished or was preempted
                self.block_owner[b] = r.req_id
        for r in batch.requests:
            if r.context_len == 0 or r.req_id not in self.mtp_slots.slot_of:
                if r.req_id in self.mtp_slots.slot_of:
                    self.mtp_slots.remove_slot(r.req_id)
                self.mtp_pool[self.mtp_slots.add_slot(r.req_id)].zero_()
            self.mtp_slots.touch(r.req_id)

    def graph_key(self, batch: Batch) -> tuple[int, int] | None:
        reqs = batch.requests
        if not reqs or any(r.context_len == 0 for r in reqs):
            return None  # a context request: eager
        q = len(reqs[0].tokens)
        if q > MAX_Q or any(len(r.tokens) != q for r in reqs):
            return None
        rows = next((s for s in SPEC.capture_sizes if s >= len(reqs)), None)
        if rows is None or rows * q > SPEC.max_num_tokens:
            return None
        return rows, q

    # -- steps ----------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        self.track_requests(batch)
        key = self.graph_key(batch) if self.mode == "graph" else None
        if key is None:
            reason = "eager twin" if self.mode == "eager" else "not a generation batch a graph fits"
            return self.run_eager(batch, reason)
        if key not in self.graphs:
            self.capture(key)
        self.prepare(batch, key)
        self.graphs[key].replay()
        logits = self.graph_logits[key][: batch.num_reqs].clone()
        return StepResult(logits, sample(logits, batch.requests), "full", ("mtp_gen", *key))

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        logits = []
        for r in batch.requests:  # one request at a time: rows of one query length each
            ids, pos, wslots = _token_inputs(r)
            table = torch.tensor([_table_row(r)], dtype=torch.int64, device=self.device)
            slot = torch.tensor([self.mtp_slots.get_slot(r.req_id)], device=self.device)
            t = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
            logits.append(self.forward(t(ids), t(pos), t(wslots), table, len(r.tokens), slot))
        out = torch.cat(logits)
        return StepResult(out, sample(out, batch.requests), "eager", None, reason)

    def prepare(self, batch: Batch | None, key: tuple[int, int]) -> None:
        """MTPSpecMetadata.prepare + the padded input copy: rewrites every row the graph reads."""
        rows, q = key
        reqs = batch.requests if batch is not None else ()
        ids, pos, wslots, tables, slots = [], [], [], [], []
        for r in reqs:
            i, p, s = _token_inputs(r)
            ids += i
            pos += p
            wslots += s
            tables.append(_table_row(r))
            slots.append(self.mtp_slots.get_slot(r.req_id))
        num_pad = rows - len(reqs)
        if num_pad:
            if batch is None:  # capture: warm-up requests the spec manager registered itself
                pad_slot = self.dummy_slot
            else:
                # the padded batch replicates CUDA_GRAPH_DUMMY_REQUEST_ID; it owns the null
                # block in the KV cache manager, and (since PR 6258) a spare MTP pool row
                if self.register_padding_dummy and CUDA_GRAPH_DUMMY_REQUEST_ID not in (
                    self.mtp_slots.slot_of
                ):
                    self.mtp_slots.slot_of[CUDA_GRAPH_DUMMY_REQUEST_ID] = self.dummy_slot
                pad_slot = self.mtp_slots.slot_of.get(CUDA_GRAPH_DUMMY_REQUEST_ID)
                if pad_slot is None:
                    self.mtp_slots.get_slot(CUDA_GRAPH_DUMMY_REQUEST_ID)  # raises, as #5386
            ids += [0] * (num_pad * q)
            pos += [0] * (num_pad * q)
            wslots += [SPEC.null_block * SPEC.block_size] * (num_pad * q)
            tables += [[SPEC.null_block] * SPEC.max_blocks_per_req] * num_pad
            slots += [pad_slot] * num_pad
        buf, n, dev = self.buffers, rows * q, self.device
        buf["input_ids"][:n].copy_(torch.tensor(ids, dtype=torch.int64, device=dev))
        buf["position_ids"][:n].copy_(torch.tensor(pos, dtype=torch.int64, device=dev))
        buf["write_slots"][:n].copy_(torch.tensor(wslots, dtype=torch.int64, device=dev))
        buf["block_tables"][:rows].copy_(torch.tensor(tables, dtype=torch.int64, device=dev))
        buf["mtp_slot_ids"][:rows].copy_(torch.tensor(slots, dtype=torch.int64, device=dev))

    def capture(self, key: tuple[int, int]) -> None:
        rows, q = key
        buf, n = self.buffers, rows * q
        args = (
            buf["input_ids"][:n],
            buf["position_ids"][:n],
            buf["write_slots"][:n],
            buf["block_tables"][:rows],
            q,
            buf["mtp_slot_ids"][:rows],
        )
        if self.pool is None:
            self.pool = self.be.graph_pool_handle()
        self.prepare(None, key)  # every row is a warm-up request: writes only the null block
        self.forward(*args)  # warm-up outside the graph
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            self.graph_logits[key] = self.forward(*args)
        self.graphs[key] = graph

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        # the dummy's spare row is the padding's own, like the null block: left out
        return {
            "k": self.k_cache,
            "v": self.v_cache,
            "mtp_past_hidden": self.mtp_pool[:NUM_LIVE_SLOTS],
        }

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):  # in place: the captured graphs read these tensors
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(t.device))

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_logits.clear()


def _token_inputs(r: Request) -> tuple[list[int], list[int], list[int]]:
    pos = [r.context_len + i for i in range(len(r.tokens))]
    return list(r.tokens), pos, [kv_slot(r.block_ids, p, SPEC.block_size) for p in pos]


def _table_row(r: Request) -> list[int]:
    # columns past the request's blocks point at the null block, masked by position
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> MtpGraphRunner:
    return MtpGraphRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> MtpGraphRunner:
    return MtpGraphRunner(mode, seed=seed, backend=backend, register_padding_dummy=False)
