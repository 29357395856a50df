"""An LMDeploy-style lazy decode-graph runner for a hybrid model whose recurrent state is updated in place.

The engine mechanism (LMDeploy's PyTorch engine, `lmdeploy/pytorch/backends/cuda/graph_runner.py`:
`CUDAGraphRunner.__call__` and `CUDASingleGraphRunner.capture` / `forward`, with the buffers of
`models/utils/cudagraph.py`): decode graphs are keyed by the request count padded to a capture
size and are captured the first time a decode step needs that key (with the start-up warm-up
skipped, or after the graphs were reset, every capture happens while serving). Capturing works on
the live step: the step's inputs are written into the graph's persistent buffers (padding rows:
block 0, zero lengths), the model runs once eagerly on those buffers as the warm-up, then the same
forward is captured. The model here is a one-layer hybrid in the style of Qwen3-Next: a gated
linear recurrence whose per-request state lives in a state cache indexed by a per-request state
slot (LMDeploy's `state_ids`) and is updated IN PLACE by every forward, beside attention over a
slot-major paged KV cache read through block offsets. Prefill, mixed batches and decode batches
past the largest graph run eagerly, with the recurrence stepped token by token inside each request.

The bug (`make_buggy_target`, `replay_after_capture=True`): the capture step does what LMDeploy's
runner did before InternLM/lmdeploy PR #4039 ("Qwen3 next", https://github.com/InternLM/lmdeploy/pull/4039,
commit 281e1017): after the warm-up and the capture it replays the new graph to produce the step's
output. For attention layers that is harmless (the replay writes the same keys and values into
the same slots again), but the recurrence is not idempotent: the warm-up has already advanced
every live request's state by this token, and the replay advances it a second time from there,
so the step's logits and the state carried into every later step are wrong for each request of
a step that captured a graph. Only capture steps are hit; a graph that already exists is replayed
once, correctly. PR #4039 made `capture()` return the warm-up's own output and skip the replay on
the capture step (its comment: "SSM would update the state in capture(warmup), replay the graph
will leads unexpected state update"); the correct runner here does the same. The replay-after-
capture flow dates from LMDeploy's CudaGraph mixin (PR #2485); it became a wrong-output bug with
the first model whose forward updates state in place, and #4039, the PR that added that model,
removed it. It hits only lazily captured keys: LMDeploy's start-up graph warm-up (PR #3851)
captures on dummy inputs, so the bug shows with the warm-up skipped (the flag #4039 added) or
after the graphs are reset. Unlike `capture_warmup_kv_lens_drift` (TensorRT-LLM, a forward that
corrects its own graph inputs in place), no input changes here: the extra pass advances the model's
own per-request state. Written from the description above; no LMDeploy code was copied.
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
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=6,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size  # positions a request may hold
# The harness keeps up to 2 * max_num_reqs requests alive; twice that many state slots keeps a
# sitting-out request's state from being evicted. The extra last row is the padding rows' slot.
NUM_STATE_SLOTS = 4 * SPEC.max_num_reqs
PAD_STATE = NUM_STATE_SLOTS
MASKED = -1e30  # finite, so a row with no visible key gives zeros instead of NaN
_M32 = 0xFFFFFFFF


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "w_gate": (HIDDEN, HIDDEN),  # recurrence: decay a = sigmoid(x @ w_gate)
            "w_in": (HIDDEN, HIDDEN),  # recurrence: input b = tanh(x @ w_in)
            "w_rec_out": (HIDDEN, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # copy_ in place: captured graphs hold these addresses
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def sample(logits: Tensor, seeds: Tensor, positions: Tensor, sampled: Tensor, temps: Tensor):
    """Gumbel-max with noise hashed from (seed, position, token id): same draw in any batch."""
    key = _mix(_mix(seeds & _M32) ^ ((positions * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class HybridGraphRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, replay_after_capture: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.replay_after_capture = SPEC, mode, replay_after_capture
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.ssm_state = torch.zeros(NUM_STATE_SLOTS + 1, HIDDEN, device=dev)
        # req_id -> (state slot, the context_len its next step must start from)
        self.state_owner: dict[int, tuple[int, int]] = {}
        self.slot_last_used: dict[int, int] = {}
        self.clock = 0
        self.graphs: dict[int, Any] = {}
        self.graph_logits: dict[int, Tensor] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            self.pool = self.be.graph_pool_handle()
            self.buffers = {  # LMDeploy's names; one max-size set shared by every graph
                "input_ids": torch.zeros(rows, dtype=torch.int64, device=dev),
                "position_ids": torch.zeros(rows, dtype=torch.int64, device=dev),
                "block_offsets": torch.zeros(
                    rows, SPEC.max_blocks_per_req, dtype=torch.int64, device=dev
                ),
                "q_seqlens": torch.zeros(rows, dtype=torch.int64, device=dev),
                "kv_seqlens": torch.zeros(rows, dtype=torch.int64, device=dev),
                "state_ids": torch.zeros(rows, dtype=torch.int64, device=dev),
            }

    # -- model pieces shared by both paths -------------------------------------------------------

    def recurrent_step(self, x: Tensor, state_ids: Tensor, live: Tensor) -> Tensor:
        """Advance each row's state by one token, in place; rows with `live` False keep theirs."""
        w = self.w.t
        old = self.ssm_state.index_select(0, state_ids)
        decay = torch.sigmoid(x @ w["w_gate"])
        new = decay * old + (1.0 - decay) * torch.tanh(x @ w["w_in"])
        # padding rows all point at the spare slot and write its old value back unchanged
        self.ssm_state.index_copy_(0, state_ids, torch.where(live[:, None], new, old))
        return new @ w["w_rec_out"]

    def attend_and_head(self, x: Tensor, rec: Tensor, tables: Tensor, kv_lens: Tensor) -> Tensor:
        """Attention of each token over its request's first `kv_lens` positions, MLP, LM head.
        The caller has stored this step's keys and values already."""
        w = self.w.t
        h = _norm(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        positions = torch.arange(CONTEXT, device=x.device)
        slots = tables[:, positions // SPEC.block_size] * SPEC.block_size + (
            positions % SPEC.block_size
        )
        visible = positions[None, :] < kv_lens[:, None]  # [T, CONTEXT]
        keys = self.k_cache[slots]  # [T, CONTEXT, H, D]; unused columns read the null block
        vals = torch.where(visible[:, :, None, None], self.v_cache[slots], 0.0)
        scores = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(visible[:, None, :], scores, MASKED)  # NaN keys never selected
        attn = torch.einsum("thc,tchd->thd", scores.softmax(-1), vals).flatten(1)
        x = x + rec + attn @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        return _norm(x) @ w["lm_head"]

    def store_kv(self, x: Tensor, slots: Tensor) -> None:
        h = _norm(x)
        self.k_cache.index_copy_(0, slots, (h @ self.w.t["wk"]).view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, (h @ self.w.t["wv"]).view(-1, HEADS, HEAD_DIM))

    def decode_forward(self, rows: int) -> Tensor:
        """One token per row, read from the persistent buffers only: what a graph captures."""
        b = {name: t[:rows] for name, t in self.buffers.items()}
        w = self.w.t
        pos = b["position_ids"]
        x = w["embed"][b["input_ids"]] + w["pos"][pos]
        block = b["block_offsets"].gather(1, (pos // SPEC.block_size)[:, None])[:, 0]
        self.store_kv(x, block * SPEC.block_size + pos % SPEC.block_size)
        rec = self.recurrent_step(x, b["state_ids"], b["q_seqlens"] > 0)
        return self.attend_and_head(x, rec, b["block_offsets"], b["kv_seqlens"])

    # -- host side ---------------------------------------------------------------------------------

    def assign_state_slots(self, batch: Batch) -> list[int]:
        """State slot of each request; a request starting from an empty cache gets a zeroed one.
        Both twins see the same batches, so they hand out the same slots."""
        in_batch = {r.req_id for r in batch.requests}
        slots = []
        for r in batch.requests:
            owned = self.state_owner.get(r.req_id)
            if r.context_len == 0:
                slot = owned[0] if owned else self.free_state_slot(in_batch)
                self.ssm_state[slot].zero_()
            elif owned is None or owned[1] != r.context_len:
                raise RuntimeError(
                    f"request {r.req_id} continues at {r.context_len} but its recurrent state "
                    f"is {'missing' if owned is None else f'at {owned[1]}'}"
                )
            else:
                slot = owned[0]
            self.state_owner[r.req_id] = (slot, r.seq_len)
            self.slot_last_used[slot] = self.clock
            slots.append(slot)
        self.clock += 1
        return slots

    def free_state_slot(self, in_batch: set[int]) -> int:
        taken = {slot for slot, _ in self.state_owner.values()}
        for slot in range(NUM_STATE_SLOTS):
            if slot not in taken:
                return slot
        # every slot has an owner: evict the one idle longest (finished requests are never
        # announced, so they are found this way)
        idle = [rid for rid in self.state_owner if rid not in in_batch]
        victim = min(idle, key=lambda rid: self.slot_last_used[self.state_owner[rid][0]])
        return self.state_owner.pop(victim)[0]

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if any(r.query_len != 1 for r in batch.requests):
            return "a row with more than one query token (prefill chunk)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest graph"
        return None

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            none = torch.zeros(0, dtype=torch.int64, device=self.device)
            return StepResult(empty, none, "eager", None, "empty step")
        state_slots = self.assign_state_slots(batch)
        reason = self.fallback_reason(batch)
        if reason is not None:
            logits = self.eager_forward(batch, state_slots)
            return StepResult(logits, self.sample(logits, batch.requests), "eager", None, reason)
        rows = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.fill_buffers(batch, state_slots)
        if rows not in self.graphs:
            logits = self.capture(rows)
            if logits is not None:
                n = batch.num_reqs
                return StepResult(
                    logits[:n].clone(),
                    self.sample(logits[:n], batch.requests),
                    "full",
                    ("decode", rows),
                    "captured on this step; output of the warm-up",
                )
        self.graphs[rows].replay()
        logits = self.graph_logits[rows][: batch.num_reqs].clone()  # the next replay overwrites it
        return StepResult(logits, self.sample(logits, batch.requests), "full", ("decode", rows))

    def capture(self, rows: int) -> Tensor | None:
        """Warm up on the live step's buffers, then capture. Returns the warm-up's logits as the
        step's output (PR #4039), or None where the caller replays the new graph instead."""
        warmup_logits = self.decode_forward(rows)  # advances every live row's state once
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            self.graph_logits[rows] = self.decode_forward(rows)  # recorded, not run
        self.graphs[rows] = graph
        if self.replay_after_capture:  # before #4039: the replay advances the state again
            return None
        return warmup_logits

    def fill_buffers(self, batch: Batch, state_slots: Sequence[int]) -> None:
        """Rewrite every row of every buffer: padding rows read block 0 (the null block), write
        nothing that matters, and point at the spare state slot with a zero query length."""
        rows = SPEC.capture_sizes[-1]
        n = batch.num_reqs
        pad = rows - n
        reqs = batch.requests
        table = [
            list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for r in reqs
        ]
        host = {
            "input_ids": [r.tokens[0] for r in reqs] + [0] * pad,
            "position_ids": [r.context_len for r in reqs] + [0] * pad,
            "block_offsets": table + [[SPEC.null_block] * SPEC.max_blocks_per_req] * pad,
            "q_seqlens": [1] * n + [0] * pad,
            "kv_seqlens": [r.seq_len for r in reqs] + [0] * pad,
            "state_ids": list(state_slots) + [PAD_STATE] * pad,
        }
        for name, values in host.items():
            self.buffers[name].copy_(torch.tensor(values, dtype=torch.int64).to(self.device))

    def eager_forward(self, batch: Batch, state_slots: Sequence[int]) -> Tensor:
        """Every token of the batch; the recurrence steps through each request's tokens in
        order, one wave per query index, so a prompt's state ends where a decode would take it."""
        dev, reqs, w = self.device, batch.requests, self.w.t
        tokens = torch.tensor([t for r in reqs for t in r.tokens], device=dev)
        positions = [r.context_len + i for r in reqs for i in range(r.query_len)]
        pos = torch.tensor(positions, device=dev)
        x = w["embed"][tokens] + w["pos"][pos]
        slots = [
            kv_slot(r.block_ids, p, SPEC.block_size)
            for r in reqs
            for p in range(r.context_len, r.seq_len)
        ]
        self.store_kv(x, torch.tensor(slots, device=dev))
        starts = [sum(r.query_len for r in reqs[:i]) for i in range(len(reqs))]
        rec = torch.zeros_like(x)
        for i in range(max(r.query_len for r in reqs)):
            members = [k for k, r in enumerate(reqs) if r.query_len > i]
            index = torch.tensor([starts[k] + i for k in members], device=dev)
            ids = torch.tensor([state_slots[k] for k in members], device=dev)
            live = torch.ones(len(members), dtype=torch.bool, device=dev)
            rec.index_copy_(0, index, self.recurrent_step(x[index], ids, live))
        tables = torch.tensor(
            [
                list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
                for r in reqs
                for _ in range(r.query_len)
            ],
            device=dev,
        )
        logits = self.attend_and_head(x, rec, tables, pos + 1)
        last = torch.tensor(
            [s + r.query_len - 1 for s, r in zip(starts, reqs, strict=True)], device=dev
        )
        return logits[last]

    def sample(self, logits: Tensor, reqs: Sequence[Request]) -> Tensor:
        dev = self.device
        return sample(
            logits,
            torch.tensor([0 if r.seed is None else r.seed & _M32 for r in reqs], device=dev),
            torch.tensor([r.seq_len - 1 for r in reqs], device=dev),
            torch.tensor([r.seed is not None for r in reqs], dtype=torch.bool, device=dev),
            torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev),
        )

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache, "ssm_state": self.ssm_state}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_logits.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return HybridGraphRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return HybridGraphRunner(mode, seed=seed, backend=backend, replay_after_capture=True)
