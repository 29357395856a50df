"""A hybrid decoder graph runner: a gated linear recurrence (Mamba-style, with a short causal conv
in front of it) next to paged attention, with prefill (chunked), decode and sampling.

Model (one layer): x = embed + pos; branch 1 is attention over a slot-major paged KV cache; branch
2 is u = x @ W_in, a depthwise causal conv of width CONV over the request's token stream (its last
CONV - 1 inputs are kept per request: the conv window), then h_t = a * h_{t-1} + silu(conv_t) with
a per-channel decay a in (0, 1) (the SSM state), y = h @ W_out. Then an MLP and the LM head.

Recurrent state: every request owns one state slot, the row of its FIRST KV block in two tensors
`ssm` [num_blocks, INNER] and `conv` [num_blocks, CONV - 1, INNER] (as vLLM V1 puts a Mamba
layer's state in a block of the request's own table). Row `null_block` is the padding slot. Both
are in `state()`; they are not slot-major, so the harness compares them whole. A request's first
step (context_len == 0) must start from a zero state and a zero conv window; later steps (decode or
a later prefill chunk) continue from the slot. That is `has_initial_state`, one bool per row, as
vLLM's Mamba metadata carries it. A freed block's state row is never cleared (nor is it in vLLM):
a new request that gets that block as its first one finds the old request's state there.

Graph mode: one full graph per capture size (1, 2, 4 rows, largest first, one pool) for batches
whose every row has one query token (continuing decodes and one-token prompts alike); anything
else runs eagerly through the same forward. Before each replay `prepare` rewrites every row of
every static buffer: the batch in the prefix, padding sentinels after it (null block, pad state
slot, row_valid False). Padding rows write their KV into the null block and write their state row
back unchanged (torch.where(row_valid, new, old)), so no element of `ssm`/`conv` changes for them.

CORRECT (make_target): has_initial_state is a device buffer rewritten every step from
context_len > 0, and the forward selects zero or the stored state per row with torch.where, inside
the graph.

BUG (make_buggy_target): the metadata builder also derives a host bool "every row continues"
(all(has_initial_state), computed from the host context lens, so no sync) and the forward takes a
fast path on it that skips the per-row select and reads the stored state as is. Eagerly that is
exact. But the graph is captured right after a warm-up whose dummy rows all "continue" (padding
rows continue from the pad slot), so every captured graph has the fast path baked in, and the
flag recomputed at each replay's prepare is never seen by it: a brand-new one-token request that
is batched into a decode replay continues from whatever its first block's state row holds (the
last owner's state) instead of from zero.

Public sources this is modelled on (no code copied):
- vLLM PR #23035 "[V1][Mamba1] Full CUDA and Piecewise CUDA Graphs Support"
  https://github.com/vllm-project/vllm/pull/23035 : has_initial_states is computed only when the
  batch has prefills; the decode graph path assumes every row continues from its state slot.
- vLLM issue #41841 "Stale padded request metadata can misclassify Mamba CUDA graph rows"
  https://github.com/vllm-project/vllm/issues/41841 (fix PR #42947): host-side prefill/decode
  classification of rows decides which state metadata a replay sees; a replay then reads or writes
  other requests' recurrent state slots.
- SGLang PR #38994 "[Fix][KDA] Rebuild accepted-state lists during CUDA graph capture"
  https://github.com/sgl-project/sglang/pull/38994 : metadata populated during warm-up is reused
  by the capture, so replay keeps the warm-up values of state indices (the "evaluated in warm-up
  right before capture and reused" shape of this bug).
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
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, INNER, CONV = 32, 2, 16, 16, 3
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
PAD_STATE = SPEC.null_block  # state row of padding rows: no request's first block
M32 = 0xFFFFFFFF


@dataclass
class Inputs:
    """R rows of Q query positions each (Q = 1 in every graph)."""

    tokens: Tensor  # [R, Q]
    positions: Tensor  # [R, Q]
    slots: Tensor  # [R, Q] KV slot of each token (null slot for padding tokens)
    tables: Tensor  # [R, max_blocks_per_req]
    qlens: Tensor  # [R] valid query tokens of the row (1 for padding rows)
    state_slot: Tensor  # [R] the row's recurrent state slot
    has_init: Tensor  # [R] bool: continue from the slot (else start from zero)
    row_valid: Tensor  # [R] bool: False for padding rows
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool


class HybridModel:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "w_in": (HIDDEN, INNER),
            "conv_w": (CONV, INNER),
            "decay": (1, INNER),
            "w_out": (INNER, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(t.device))


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


class HybridRunner:
    buggy = False

    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        dev = self.backend.device
        self.device = dev
        self.model = HybridModel(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.ssm = torch.zeros(SPEC.num_blocks, INNER, device=dev)
        self.conv = torch.zeros(SPEC.num_blocks, CONV - 1, INNER, device=dev)
        self.all_continue = False  # host flag of the metadata builder (used by the buggy path)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.buffers = self._allocate(SPEC.capture_sizes[-1])
            self.capture()

    # -- forward ------------------------------------------------------------------------------
    def initial_states(self, inp: Inputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        h_old = self.ssm[inp.state_slot]  # [R, INNER]
        c_old = self.conv[inp.state_slot]  # [R, CONV-1, INNER]
        if self.buggy and self.all_continue:
            # fast path: every row continues, no per-row select (a host bool, frozen at capture)
            return h_old, c_old, h_old, c_old
        zero = torch.zeros((), device=h_old.device)
        h0 = torch.where(inp.has_init[:, None], h_old, zero)
        c0 = torch.where(inp.has_init[:, None, None], c_old, zero)
        return h0, c0, h_old, c_old

    def forward(self, inp: Inputs) -> tuple[Tensor, Tensor]:
        w = self.model.w
        R, Q = inp.tokens.shape
        dev = inp.tokens.device
        x = w["embed"][inp.tokens] + w["pos"][inp.positions]  # [R, Q, H]
        tok_valid = torch.arange(Q, device=dev)[None, :] < inp.qlens[:, None]  # [R, Q]

        # recurrent branch: causal conv over (stored window ++ this step's inputs), then scan
        h0, c0, h_old, c_old = self.initial_states(inp)
        u = x @ w["w_in"]  # [R, Q, INNER]
        window = torch.cat([c0, u], dim=1)  # [R, CONV-1+Q, INNER]
        conv = sum(w["conv_w"][j] * window[:, j : j + Q] for j in range(CONV))
        conv = torch.nn.functional.silu(conv)
        decay = torch.sigmoid(w["decay"][0])
        h, ys = h0, []
        for q in range(Q):
            h = torch.where(tok_valid[:, q, None], decay * h + conv[:, q], h)
            ys.append(h)
        r = torch.stack(ys, dim=1) @ w["w_out"]  # [R, Q, H]
        # new window: the last CONV-1 entries of the first CONV-1+qlen of the window
        idx = inp.qlens[:, None] + torch.arange(CONV - 1, device=dev)[None, :]  # [R, CONV-1]
        c_new = torch.gather(window, 1, idx[:, :, None].expand(R, CONV - 1, INNER))
        keep = inp.row_valid
        self.ssm.index_copy_(0, inp.state_slot, torch.where(keep[:, None], h, h_old))
        self.conv.index_copy_(0, inp.state_slot, torch.where(keep[:, None, None], c_new, c_old))

        # attention branch over the paged cache
        hn = _rms(x).reshape(R * Q, HIDDEN)
        qh, kh, vh = (hn @ w[n] for n in "qkv")
        flat_slots = inp.slots.reshape(-1)
        self.k_cache.index_copy_(0, flat_slots, kh.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, flat_slots, vh.view(-1, HEADS, HEAD_DIM))
        offs = torch.arange(SPEC.block_size, device=dev)
        ctx = (inp.tables[:, :, None] * SPEC.block_size + offs).flatten(1)  # [R, CONTEXT]
        ctx = ctx[:, None, :].expand(R, Q, CONTEXT).reshape(R * Q, CONTEXT)
        keys, values = self.k_cache[ctx], self.v_cache[ctx]  # [T, C, heads, dim]
        pos = inp.positions.reshape(-1)
        visible = torch.arange(CONTEXT, device=dev)[None, :] <= pos[:, None]
        scores = torch.einsum("thd,tchd->thc", qh.view(-1, HEADS, HEAD_DIM), keys)
        scores = torch.where(
            visible[:, None, :],
            scores / math.sqrt(HEAD_DIM),
            torch.full((), float("-inf"), device=dev),
        )
        probs = scores.softmax(-1)
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=dev))
        attn = torch.einsum("thc,tchd->thd", probs, values).reshape(R, Q, HIDDEN) @ w["o"]

        x = x + attn + r
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        last = (inp.qlens - 1).clamp(min=0)
        x_last = torch.gather(x, 1, last[:, None, None].expand(R, 1, HIDDEN))[:, 0]
        logits = _rms(x_last) @ w["head"]  # [R, vocab]
        last_pos = torch.gather(inp.positions, 1, last[:, None])[:, 0]
        return logits, self.sample(logits, inp, last_pos)

    @staticmethod
    def sample(logits: Tensor, inp: Inputs, pos: Tensor) -> Tensor:
        """Gumbel-max, noise from a hash of (seed, position, token id): no generator state."""
        key = _mix(_mix(inp.seeds) ^ ((pos * 0x9E3779B1) & M32))
        ids = torch.arange(logits.shape[-1], device=logits.device)
        bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
        uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = logits / inp.temperatures[:, None] - torch.log(-torch.log(uniform))
        return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))

    # -- host-side metadata -------------------------------------------------------------------
    def rows(self, batch: Batch, Q: int) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {n: [] for n in _PAD}
        for r in batch.requests:
            n = r.query_len
            pos = [r.context_len + i for i in range(n)] + [0] * (Q - n)
            out["tokens"].append(list(r.tokens) + [0] * (Q - n))
            out["positions"].append(pos)
            out["slots"].append([_slot(r, p) for p in pos[:n]] + [NULL_SLOT] * (Q - n))
            out["tables"].append(
                list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
            )
            out["qlens"].append(n)
            out["state_slot"].append(r.block_ids[0])
            out["has_init"].append(r.context_len > 0)
            out["row_valid"].append(True)
            greedy = r.seed is None
            out["seeds"].append(0 if greedy else r.seed & M32)
            out["temperatures"].append(1.0 if greedy else float(r.temperature))
            out["sampled"].append(not greedy)
        return out

    def build_metadata(self, has_init: list[bool]) -> None:
        # host summary of the step, as a metadata builder keeps it (no device read)
        self.all_continue = all(has_init)

    # -- graph mode ---------------------------------------------------------------------------
    def _allocate(self, rows: int) -> dict[str, Tensor]:
        d, i64 = self.device, torch.int64
        b = {n: torch.zeros(rows, 1, dtype=i64, device=d) for n in ("tokens", "positions", "slots")}
        b["tables"] = torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=d)
        for n in ("qlens", "state_slot", "seeds"):
            b[n] = torch.zeros(rows, dtype=i64, device=d)
        for n in ("has_init", "row_valid", "sampled"):
            b[n] = torch.zeros(rows, dtype=torch.bool, device=d)
        b["temperatures"] = torch.ones(rows, device=d)
        return b

    def static_inputs(self, size: int) -> Inputs:
        return Inputs(**{n: buf[:size] for n, buf in self.buffers.items()})

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = self.rows(batch, 1)
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[n:size].fill_(_PAD[name])
        self.build_metadata(rows["has_init"] + [bool(_PAD["has_init"])] * (size - n))

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)  # warm-up batch: padding rows only
            inputs = self.static_inputs(size)
            self.forward(inputs)  # warm-up outside the graph
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.forward(inputs)
            self.graphs[size] = graph

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ---------------------------------------------------------------------------
    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        Q = max(batch.query_lens)
        rows = self.rows(batch, Q)
        dtypes = {
            "temperatures": torch.float32,
            "has_init": torch.bool,
            "row_valid": torch.bool,
            "sampled": torch.bool,
        }
        inp = Inputs(
            **{
                n: torch.tensor(v, dtype=dtypes.get(n, torch.int64), device=self.device)
                for n, v in rows.items()
            }
        )
        self.build_metadata(rows["has_init"])
        logits, tokens = self.forward(inp)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "a row with more than one query token (prefill chunk)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache, "ssm": self.ssm, "conv": self.conv}

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


class BuggyHybridRunner(HybridRunner):
    buggy = True  # forward takes the host "all rows continue" fast path (frozen at capture)


_PAD: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "qlens": 1,
    "state_slot": PAD_STATE,
    "has_init": True,  # a padding row "continues" from the pad slot
    "row_valid": False,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(r: Request, p: int) -> int:
    return r.block_ids[p // SPEC.block_size] * SPEC.block_size + p % SPEC.block_size


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridRunner:
    return HybridRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridRunner:
    return BuggyHybridRunner(mode, seed=seed, backend=backend)
