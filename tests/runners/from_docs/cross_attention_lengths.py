"""Encoder-decoder (Whisper / BART style) decode runner with a per-row cross-attention length.

What it is
----------
A one-layer decoder with self-attention over a slot-major paged KV cache (read through block
tables) and cross-attention over per-request encoder states, then a SiLU MLP and an LM head;
counter-based Gumbel sampling (hash of seed, position, token id). Every request owns encoder
states of its own length (MIN_ENC..MAX_ENC), derived deterministically from its `req_id` (the
stand-in for "its audio clip"), so every twin agrees. Their projected cross keys and values live in
a persistent per-slot cross-attention cache (`cross_k` / `cross_v`, [NUM_CROSS, MAX_ENC, H, D]),
filled eagerly the first time a request is seen (slot table keyed by req_id, least recently used
slot reused, slot 0 the null slot of zeros) and refilled after a weight update. Because the
contents are a pure function of (req_id, weights), the cache is a runner-owned shortcut: not part
of `state()`.

Graph mode captures one decode graph per capture size (1, 2, 4) at start-up into one shared pool.
Each decode step writes every row of the static buffers it replays (tokens, positions, slots,
tables, sampling values, `cross_slot` and `enc_lens`, the per-row encoder length in a static
max-shape buffer the graph reads); padding rows point at the null block, the null cross slot and
encoder length 1. Cross-attention reads `max_enc` encoder positions, a host int (FlashAttention's
varlen `max_seqlen_k`), masked per row by `enc_lens`. Eager steps take it from the batch; a graph
bakes it at capture, so the capture must use the largest encoder length a replay can have
(MAX_ENC): the dummy capture batch's encoder lengths are set to MAX_ENC. Prefill, mixed,
speculative and over-large batches run eagerly.

The bug (make_buggy_target)
---------------------------
The dummy capture batch keeps the padding encoder length (1) when the graphs are captured, and the
same metadata builder that eager steps use computes `max_enc = max(encoder lengths of the rows)`
from it. The captured graphs therefore read only the first encoder position of every request on
every replay, whatever `enc_lens` says; eager steps are right. Modelled on:

- vLLM #33360 "[BugFix] Fix whisper FA2 + full cudagraphs" (fixes issue #33091):
  https://github.com/vllm-project/vllm/pull/33360 -- `CrossAttentionBuilder.build()` set
  `max_seq_len = max(encoder_seq_lens_cpu)`, which during CUDA-graph capture was 0, so the graph
  was captured with the wrong cross-attention length.
- SGLang #21190 "[Whisper] Enable CUDA graph support ...":
  https://github.com/sgl-project/sglang/pull/21190 -- `encoder_len_fill_value` used at capture
  was 0, so cross-attention was skipped in the captured graph; fixed by filling with
  `max_source_positions`. (Also #21161: replay padding initialised with valid encoder lengths.)
No code was copied from either engine.
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
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
MIN_ENC, MAX_ENC = 3, 12  # encoder states per request
NULL_CROSS = 0  # cross-cache slot of zeros that padding rows read
NUM_CROSS = 2 * SPEC.max_num_reqs + 2  # the harness keeps at most 2 * max_num_reqs live
PAD_ENC_LEN = 1  # a padding row attends to the null cross slot's first (zero) position
M32 = 0xFFFFFFFF


def _hash32(x: int) -> int:
    x &= M32
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def encoder_len(req_id: int) -> int:
    return MIN_ENC + _hash32(req_id * 7919 + 17) % (MAX_ENC - MIN_ENC + 1)


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    cross_slot: Tensor  # [T] the cross-cache slot of each token's request
    enc_lens: Tensor  # [T] encoder length of each token's request
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] index of each request's last token (None: T == R)


class EncDecModel:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            **{n: (HIDDEN, HIDDEN) for n in ("q", "k", "v", "o", "cq", "ck", "cv", "co")},
        }
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):  # in place: captured graphs keep these tensors
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(self.device))

    def encode(self, req_id: int) -> tuple[Tensor, Tensor]:
        """The request's encoder output, projected to cross keys and values: [L, H, D] each."""
        g = torch.Generator().manual_seed(_hash32(req_id * 2654435761 + 1))
        states = torch.randn(encoder_len(req_id), HIDDEN, generator=g).to(self.device)
        states = _rms(states)
        k = (states @ self.w["ck"]).view(-1, HEADS, HEAD_DIM)
        v = (states @ self.w["cv"]).view(-1, HEADS, HEAD_DIM)
        return k, v

    def forward(
        self,
        x_in: StepInputs,
        kv: tuple[Tensor, Tensor],
        cross: tuple[Tensor, Tensor],
        max_enc: int,
    ) -> Tensor:
        w = self.w
        k_cache, v_cache = kv
        x = w["embed"][x_in.tokens] + w["pos"][x_in.positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, x_in.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x_in.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + _self_attention(q, k_cache, v_cache, x_in) @ w["o"]
        cq = _rms(x) @ w["cq"]
        x = x + _cross_attention(cq, cross, x_in, max_enc) @ w["co"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if x_in.last is not None:
            x = x[x_in.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _masked_attention(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor) -> Tensor:
    """q [T, H*D], keys/values [T, C, H, D], visible [T, C]; masked values may be anything."""
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
    scores = scores / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def _self_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, x_in: StepInputs) -> Tensor:
    offsets = torch.arange(SPEC.block_size, device=q.device)
    context = (x_in.tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, CONTEXT]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= x_in.positions[:, None]
    return _masked_attention(q, k_cache[context], v_cache[context], visible)


def _cross_attention(
    q: Tensor, cross: tuple[Tensor, Tensor], x_in: StepInputs, max_enc: int
) -> Tensor:
    """Attend to the first `max_enc` encoder positions of each row's cross slot, masked by the
    row's encoder length (`max_enc` is a kernel argument: a graph keeps its capture value)."""
    cross_k, cross_v = cross
    keys = cross_k[x_in.cross_slot, :max_enc]  # [T, max_enc, H, D]
    values = cross_v[x_in.cross_slot, :max_enc]
    visible = torch.arange(max_enc, device=q.device)[None, :] < x_in.enc_lens[:, None]
    return _masked_attention(q, keys, values, visible)


def sample(logits: Tensor, x_in: StepInputs) -> Tensor:
    pos = x_in.positions if x_in.last is None else x_in.positions[x_in.last]
    key = _mix(_mix(x_in.seeds) ^ ((pos * 0x9E3779B1) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / x_in.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(x_in.sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def cross_max_len(enc_lens_host: Sequence[int]) -> int:
    """The metadata builder's max_seqlen_k for cross-attention, from host encoder lengths."""
    return max(enc_lens_host) if enc_lens_host else PAD_ENC_LEN


class CrossAttnRunner:
    buggy = False

    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, backend: str) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec, self.mode = SPEC, mode
        self.backend: Any = get_backend(backend)
        dev = self.backend.device
        with torch.inference_mode():
            self.model = EncDecModel(seed, dev)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.kv = (torch.zeros(shape, device=dev), torch.zeros(shape, device=dev))
            cshape = (NUM_CROSS, MAX_ENC, HEADS, HEAD_DIM)
            self.cross = (torch.zeros(cshape, device=dev), torch.zeros(cshape, device=dev))
            self.cross_of: dict[int, int] = {}  # req_id -> cross slot
            self.owner: list[int | None] = [None] * NUM_CROSS
            self.last_used = [0] * NUM_CROSS
            self.clock = 0
            self.graphs: dict[int, Any] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            if mode == "graph":
                self.buffers = self._allocate(SPEC.capture_sizes[-1])
                self.capture()

    # -- cross-attention cache --------------------------------------------------------------

    def ensure_cross(self, batch: Batch) -> None:
        """Give every request of the batch a filled cross slot (eager work, current stream)."""
        self.clock += 1
        wanted = {r.req_id for r in batch.requests}
        for req_id in wanted:
            slot = self.cross_of.get(req_id)
            if slot is not None and self.owner[slot] == req_id:
                self.last_used[slot] = self.clock
                continue
            candidates = [s for s in range(1, NUM_CROSS) if self.owner[s] not in wanted]
            slot = min(candidates, key=lambda s: (self.owner[s] is not None, self.last_used[s]))
            if self.owner[slot] is not None:
                self.cross_of.pop(self.owner[slot], None)
            k, v = self.model.encode(req_id)
            for cache, new in zip(self.cross, (k, v), strict=True):
                cache[slot].zero_()
                cache[slot, : new.shape[0]].copy_(new)
            self.owner[slot], self.cross_of[req_id] = req_id, slot
            self.last_used[slot] = self.clock

    # -- graph mode -------------------------------------------------------------------------

    def _allocate(self, rows: int) -> dict[str, Tensor]:
        dev, i64 = self.backend.device, torch.int64
        z = lambda *s, dtype=i64: torch.zeros(*s, dtype=dtype, device=dev)  # noqa: E731
        return {
            "tokens": z(rows),
            "positions": z(rows),
            "slots": z(rows),
            "tables": z(rows, SPEC.max_blocks_per_req),
            "cross_slot": z(rows),
            "enc_lens": z(rows),
            "seeds": z(rows),
            "temperatures": z(rows, dtype=torch.float32),
            "sampled": z(rows, dtype=torch.bool),
        }

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{n: b[:size] for n, b in self.buffers.items()})

    def capture_enc_lens(self, size: int) -> list[int]:
        """Encoder lengths of the dummy capture batch, as the metadata builder sees them."""
        if self.buggy:
            return [PAD_ENC_LEN] * size  # BUG: the padding fill value, so max_enc bakes as 1
        return [MAX_ENC] * size  # the longest a replay can meet

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            x_in = self.static_inputs(size)
            max_enc = cross_max_len(self.capture_enc_lens(size))
            self.run_model(x_in, max_enc)  # warm-up
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(x_in, max_enc)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = self._decode_rows(batch.requests)
        for name, buf in self.buffers.items():
            if n:
                buf[:n].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[n:size].fill_(_PADDING[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes -------------------------------------------------------------------------

    def run_model(self, x_in: StepInputs, max_enc: int) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(x_in, self.kv, self.cross, max_enc)
        return logits, sample(logits, x_in)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        x_in = self._eager_inputs(batch)
        max_enc = cross_max_len([encoder_len(r.req_id) for r in batch.requests])
        logits, tokens = self.run_model(x_in, max_enc)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode (query length > 1)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            self.ensure_cross(batch)
            reason = self.fallback_reason(batch)
            return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.kv[0], "v0": self.kv[1]}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load(seed)
            # Cached cross keys/values were projected with the old weights: refill on next use.
            self.cross_of.clear()
            self.owner = [None] * NUM_CROSS

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()

    # -- host-side inputs -------------------------------------------------------------------

    def _sampling(self, r: Request) -> tuple[int, float, bool]:
        if r.seed is None:
            return 0, 1.0, False
        return r.seed & M32, r.temperature, True

    def _decode_rows(self, requests: Sequence[Request]) -> dict[str, list[Any]]:
        smp = [self._sampling(r) for r in requests]
        return {
            "tokens": [r.tokens[0] for r in requests],
            "positions": [r.context_len for r in requests],
            "slots": [_slot(r, r.context_len) for r in requests],
            "tables": [_table(r) for r in requests],
            "cross_slot": [self.cross_of[r.req_id] for r in requests],
            "enc_lens": [encoder_len(r.req_id) for r in requests],
            "seeds": [s[0] for s in smp],
            "temperatures": [s[1] for s in smp],
            "sampled": [s[2] for s in smp],
        }

    def _eager_inputs(self, batch: Batch) -> StepInputs:
        cols: dict[str, list[Any]] = {
            k: []
            for k in ("tokens", "positions", "slots", "tables", "cross_slot", "enc_lens", "last")
        }
        for r in batch.requests:
            for i, tok in enumerate(r.tokens):
                pos = r.context_len + i
                cols["tokens"].append(tok)
                cols["positions"].append(pos)
                cols["slots"].append(_slot(r, pos))
                cols["tables"].append(_table(r))
                cols["cross_slot"].append(self.cross_of[r.req_id])
                cols["enc_lens"].append(encoder_len(r.req_id))
            cols["last"].append(len(cols["tokens"]) - 1)
        smp = [self._sampling(r) for r in batch.requests]
        dev = self.backend.device

        def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        return StepInputs(
            tokens=t(cols["tokens"]),
            positions=t(cols["positions"]),
            slots=t(cols["slots"]),
            tables=t(cols["tables"]).view(-1, SPEC.max_blocks_per_req),
            cross_slot=t(cols["cross_slot"]),
            enc_lens=t(cols["enc_lens"]),
            seeds=t([s[0] for s in smp]),
            temperatures=t([s[1] for s in smp], torch.float32),
            sampled=t([s[2] for s in smp], torch.bool),
            last=t(cols["last"]),
        )


class BuggyCrossAttnRunner(CrossAttnRunner):
    buggy = True


_PADDING: dict[str, float | int | bool] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "cross_slot": NULL_CROSS,
    "enc_lens": PAD_ENC_LEN,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> CrossAttnRunner:
    return CrossAttnRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> CrossAttnRunner:
    return BuggyCrossAttnRunner(mode, seed=seed, backend=backend)
