"""Hybrid (SSM + attention) bf16 decoder whose graph and eager paths run the recurrence differently.

Runner: a bfloat16 two-layer hybrid decoder in the style of Jamba / Mamba-2 / Qwen3-Next as
vLLM, SGLang and TensorRT-LLM serve them. Layer 0 is a recurrent (gated linear-attention / SSD
style) layer: a causal depthwise conv (width 4) over the input projection, then per head a
scalar-decay recurrence S_t = a_t S_{t-1} + k_t^T v_t, o_t = q_t S_t. Layer 1 is attention over a
slot-major paged KV cache. Per request the recurrent layer keeps a conv window (the last 3 inputs)
and a state matrix per head in a *state pool* indexed by a per-request slot that the runner hands
out (a table keyed by req_id, checked against the request before it is trusted; a slot is taken
back when another request is given one of its blocks). The pool holds one extra, hidden row: the
padding sentinel (vLLM's PAD_SLOT_ID row), which `state()` does not show.

Graph mode captures one decode graph per capture size (1, 2, 4). Decode replays update the state
with a fused one-step formula in float32 (o = a (q S) + (q.k) v, S' = a S + k^T v), as a
selective_state_update / fused recurrent kernel does. Prefill, chunked prefill and mixed batches
(and every step of the eager twin) run a chunked scan (chunk of 4 tokens, cumulative log-decays,
bf16 matmuls for the intra-chunk and inter-chunk terms, as the FLA / SSD chunk kernels do with
tensor cores), which is the same mathematics rounded otherwise. The state pool is bfloat16, as
engines keep it by default.

Bug (make_buggy_target): CUDA-graph padding rows are given "free" state slots, namely the lowest
pool slots that no request of *this batch* uses (distinct, so that padding indices are "not
repeated"), instead of one reserved sentinel slot. Slots of live requests parked outside the
batch (sitting out this step), and slots of departed ones, are overwritten by the padding rows'
recurrent update. Modelled on TensorRT-LLM's mamba cache manager with cuda_graph_padding:
https://github.com/NVIDIA/TensorRT-LLM/pull/9873 ("When there exists padded requests, the state
indices should not be repeated": padding dummies took other slots) and the later fix
https://github.com/NVIDIA/TensorRT-LLM/pull/13151 ("Allocate a permanent slot for the CUDA-graph
sentinel ... Prevents aliasing with live requests parked outside the current batch under the
overlap scheduler"). No code was copied from either engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
    null_block=0,
)
D, DI, H, DK = 32, 32, 2, 16  # hidden, SSM inner width, heads (SSM and attention), head dim
CONV = 4  # conv width: the conv window keeps CONV - 1 inputs
CHUNK = 4  # chunk length of the eager scan
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
POOL = SPEC.num_blocks - 1  # visible state slots: live requests own disjoint non-null blocks
PAD_SLOT = POOL  # the hidden padding row of the pool
NULL_SLOT = SPEC.null_block * SPEC.block_size
BF16 = torch.bfloat16
M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# model


class HybridModel:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes = {
            "embed": (SPEC.vocab_size, D),
            "ssm_in": (D, 2 * DI),
            "conv_w": (DI, CONV),
            "wq": (DI, H * DK),
            "wk": (DI, H * DK),
            "wv": (DI, H * DK),
            "wdt": (D, H),
            "ssm_out": (DI, D),
            "aq": (D, H * DK),
            "ak": (D, H * DK),
            "av": (D, H * DK),
            "ao": (H * DK, D),
            "up": (D, 2 * D),
            "down": (2 * D, D),
            "head": (D, SPEC.vocab_size),
        }
        fp32 = {"conv_b": (DI,), "dt_bias": (H,), "a_log": (H,)}
        self.w = {n: torch.empty(s, device=device, dtype=BF16) for n, s in shapes.items()}
        self.w.update({n: torch.empty(s, device=device) for n, s in fp32.items()})
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            if name == "a_log":
                fresh = torch.rand(t.shape, generator=gen) * 1.5 - 1.0
            elif name == "dt_bias":
                fresh = torch.rand(t.shape, generator=gen) - 0.5
            elif name == "conv_b":
                fresh = torch.randn(t.shape, generator=gen) * 0.1
            else:
                fresh = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])
            t.copy_(fresh.to(device=self.device, dtype=t.dtype))  # in place: graphs read these


def _rms(x: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16)


def _qkv_gate(m: HybridModel, xc: Tensor, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """From conv outputs xc [T, DI] (float) and normed hidden h [T, D]: q, k, v [T, H, DK] float32
    (q, k L2-normalised) and the log-decay g [T, H]."""
    xb = xc.to(BF16)
    q = (xb @ m.w["wq"]).float().view(-1, H, DK)
    k = (xb @ m.w["wk"]).float().view(-1, H, DK)
    v = (xb @ m.w["wv"]).float().view(-1, H, DK)
    q = F.normalize(q, dim=-1)
    k = F.normalize(k, dim=-1)
    g = -torch.exp(m.w["a_log"]) * F.softplus((h @ m.w["wdt"]).float() + m.w["dt_bias"])
    return q, k, v, g


def attention(
    m: HybridModel,
    h: Tensor,
    kc: Tensor,
    vc: Tensor,
    slots: Tensor,
    tables: Tensor,
    positions: Tensor,
) -> Tensor:
    q = (h @ m.w["aq"]).view(-1, H, DK)
    kc.index_copy_(0, slots, (h @ m.w["ak"]).view(-1, H, DK))
    vc.index_copy_(0, slots, (h @ m.w["av"]).view(-1, H, DK))
    offs = torch.arange(SPEC.block_size, device=h.device)
    ctx = (tables[:, :, None] * SPEC.block_size + offs).flatten(1)  # [T, CONTEXT]
    keys, values = kc[ctx].float(), vc[ctx].float()
    visible = torch.arange(CONTEXT, device=h.device)[None, :] <= positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.float(), keys) / math.sqrt(DK)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=h.device))
    out = torch.einsum("thc,tchd->thd", probs, values).flatten(1).to(BF16)
    return out @ m.w["ao"]


def tail(
    m: HybridModel,
    x: Tensor,
    y: Tensor,
    z: Tensor,
    kc: Tensor,
    vc: Tensor,
    slots: Tensor,
    tables: Tensor,
    positions: Tensor,
    last: Tensor | None,
) -> Tensor:
    """Everything after the recurrence: gate, out-projection, attention, MLP, LM head."""
    x = x + (y.to(BF16) * F.silu(z)) @ m.w["ssm_out"]
    x = x + attention(m, _rms(x), kc, vc, slots, tables, positions)
    x = x + F.silu(_rms(x) @ m.w["up"]) @ m.w["down"]
    if last is not None:
        x = x[last]
    return (_rms(x) @ m.w["head"]).float()


def fused_decode_recurrence(
    m: HybridModel, xin: Tensor, h: Tensor, conv_pool: Tensor, ssm_pool: Tensor, idx: Tensor
) -> Tensor:
    """Graph path: one token per row, state read and written in the pool at `idx`."""
    full = torch.cat([conv_pool[idx], xin[:, None, :]], dim=1)  # [R, CONV, DI]
    conv_pool.index_copy_(0, idx, full[:, 1:])
    xc = F.silu((full.float() * m.w["conv_w"].float().t()[None]).sum(1) + m.w["conv_b"])
    q, k, v, g = _qkv_gate(m, xc, h)
    a = torch.exp(g)  # [R, H]
    s = ssm_pool[idx].float()  # [R, H, DK, DK]
    o = a[..., None] * torch.einsum("rhk,rhkv->rhv", q, s) + (q * k).sum(-1, keepdim=True) * v
    s_new = a[..., None, None] * s + k[..., :, None] * v[..., None, :]
    ssm_pool.index_copy_(0, idx, s_new.to(ssm_pool.dtype))
    return o.flatten(1)


def chunk_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """Eager path: chunked scan over one sequence. q, k, v [L, H, DK], g [L, H], s [H, DK, DK]."""
    outs = []
    for c0 in range(0, q.shape[0], CHUNK):
        qc, kc, vc, gc = (
            q[c0 : c0 + CHUNK],
            k[c0 : c0 + CHUNK],
            v[c0 : c0 + CHUNK],
            g[c0 : c0 + CHUNK],
        )
        n = qc.shape[0]
        cum = gc.cumsum(0)  # [n, H]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = (cum[:, None, :] - cum[None, :, :]).permute(2, 0, 1)  # [H, t, s]
        decay = diff.masked_fill(~causal[None], float("-inf")).exp()
        att = torch.einsum("thk,shk->hts", qc.to(BF16), kc.to(BF16)).float() * decay
        intra = torch.einsum("hts,shv->thv", att.to(BF16), vc.to(BF16)).float()
        inter = torch.einsum("thk,hkv->thv", qc.to(BF16), s.to(BF16)).float()
        outs.append(intra + inter * torch.exp(cum)[..., None])
        to_end = torch.exp(cum[-1][None] - cum)  # [n, H]
        contrib = torch.einsum("shk,shv->hkv", (kc * to_end[..., None]).to(BF16), vc.to(BF16))
        s = torch.exp(cum[-1])[:, None, None] * s + contrib.float()
    return torch.cat(outs), s


# ---------------------------------------------------------------------------------------------
# sampling


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def sample(
    logits: Tensor, seeds: Tensor, positions: Tensor, temps: Tensor, sampled: Tensor
) -> Tensor:
    key = _hash(_hash(seeds) ^ ((positions * 0x632BE5AB) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x1B873593) & M32)[None, :])
    u = ((bits >> 8).float() + 0.5) * 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, float(r.temperature), True


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


# ---------------------------------------------------------------------------------------------
# runner


@dataclass
class SlotEntry:
    slot: int
    next_len: int
    blocks: tuple[int, ...]


class HybridRunner:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, buggy: bool = False) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.buggy = buggy
        self.device = torch.device("cuda")
        dev = self.device
        with torch.inference_mode():
            self.model = HybridModel(seed, dev)
            self.k_cache = torch.zeros(SPEC.num_slots, H, DK, device=dev, dtype=BF16)
            self.v_cache = torch.zeros(SPEC.num_slots, H, DK, device=dev, dtype=BF16)
            # state pools: POOL request slots + 1 hidden padding row
            self.conv_pool = torch.zeros(POOL + 1, CONV - 1, DI, device=dev, dtype=BF16)
            self.ssm_pool = torch.zeros(POOL + 1, H, DK, DK, device=dev, dtype=BF16)
        self.views = {
            "k": self.k_cache,
            "v": self.v_cache,
            "conv_state": self.conv_pool[:POOL],  # the padding row stays hidden
            "ssm_state": self.ssm_pool[:POOL],
        }
        self.table: dict[int, SlotEntry] = {}
        self.owner: dict[int, int] = {}  # block -> req_id
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buf: dict[str, Tensor] = {}
        if mode == "graph":
            n = SPEC.capture_sizes[-1]
            i64 = torch.int64
            with torch.inference_mode():
                self.buf = {
                    "tokens": torch.zeros(n, dtype=i64, device=dev),
                    "positions": torch.zeros(n, dtype=i64, device=dev),
                    "kv_slots": torch.zeros(n, dtype=i64, device=dev),
                    "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                    "state_idx": torch.zeros(n, dtype=i64, device=dev),
                    "seeds": torch.zeros(n, dtype=i64, device=dev),
                    "temps": torch.ones(n, device=dev),
                    "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
                }
                self.capture()

    # -- per-request state slots --------------------------------------------------------------

    def _evict(self, req_id: int) -> None:
        entry = self.table.pop(req_id)
        for b in entry.blocks:
            if self.owner.get(b) == req_id:
                del self.owner[b]

    def assign_slots(self, batch: Batch) -> list[int]:
        for r in batch.requests:  # a block handed to another request: its old owner is gone
            for b in r.block_ids:
                old = self.owner.get(b)
                if old is not None and old != r.req_id and old in self.table:
                    self._evict(old)
        slots = []
        for r in batch.requests:
            entry = self.table.get(r.req_id)
            if r.context_len == 0:
                if entry is not None:
                    self._evict(r.req_id)
                used = {e.slot for e in self.table.values()}
                free = next((s for s in range(POOL) if s not in used), None)
                if free is None:
                    raise RuntimeError("state pool exhausted")
                entry = SlotEntry(free, 0, ())
                self.table[r.req_id] = entry
            elif (
                entry is None
                or entry.next_len != r.context_len
                or tuple(r.block_ids[: len(entry.blocks)]) != entry.blocks
            ):
                raise RuntimeError(f"request {r.req_id} does not continue its recurrent state")
            entry.next_len = r.seq_len
            entry.blocks = tuple(r.block_ids)
            for b in r.block_ids:
                self.owner[b] = r.req_id
            slots.append(entry.slot)
        return slots

    # -- graph path ---------------------------------------------------------------------------

    def run_decode(self, size: int) -> tuple[Tensor, Tensor]:
        b, m = self.buf, self.model
        tok, pos = b["tokens"][:size], b["positions"][:size]
        x = m.w["embed"][tok]
        h = _rms(x)
        xin, z = (h @ m.w["ssm_in"]).split(DI, dim=-1)
        y = fused_decode_recurrence(m, xin, h, self.conv_pool, self.ssm_pool, b["state_idx"][:size])
        logits = tail(
            m,
            x,
            y,
            z,
            self.k_cache,
            self.v_cache,
            b["kv_slots"][:size],
            b["tables"][:size],
            pos,
            None,
        )
        tokens = sample(logits, b["seeds"][:size], pos, b["temps"][:size], b["sampled"][:size])
        return logits, tokens

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), [], size)
            self.run_decode(size)  # warm-up: padding rows only (null block, hidden pad row)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.run_decode(size)
            self.graphs[size] = graph

    def padding_slots(self, slots: list[int], count: int) -> list[int]:
        if not self.buggy or not slots:  # capture and warm-up: every row is the sentinel
            return [PAD_SLOT] * count
        # BUG: "distinct free slots" for the padding dummies, free as far as this batch can tell
        taken = set(slots)
        return [s for s in range(POOL) if s not in taken][:count]

    def prepare(self, batch: Batch, slots: list[int], size: int) -> None:
        reqs, n = batch.requests, batch.num_reqs
        samp = [_sampling(r) for r in reqs]
        pad = size - n
        rows = {
            "tokens": [r.tokens[0] for r in reqs] + [0] * pad,
            "positions": [r.context_len for r in reqs] + [0] * pad,
            "kv_slots": [kv_slot(r.block_ids, r.context_len, SPEC.block_size) for r in reqs]
            + [NULL_SLOT] * pad,
            "tables": [_table(r) for r in reqs]
            + [[SPEC.null_block] * SPEC.max_blocks_per_req] * pad,
            "state_idx": slots + self.padding_slots(slots, pad),
            "seeds": [s[0] for s in samp] + [0] * pad,
            "temps": [s[1] for s in samp] + [1.0] * pad,
            "sampled": [s[2] for s in samp] + [False] * pad,
        }
        for name, values in rows.items():
            dst = self.buf[name]
            dst[:size].copy_(torch.tensor(values, dtype=dst.dtype))

    def replay(self, batch: Batch, slots: list[int]) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, slots, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager path ---------------------------------------------------------------------------

    def run_eager(self, batch: Batch, slots: list[int], reason: str) -> StepResult:
        m, dev = self.model, self.device
        toks, pos, kvs, tabs, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                toks.append(t)
                pos.append(r.context_len + i)
                kvs.append(kv_slot(r.block_ids, r.context_len + i, SPEC.block_size))
                tabs.append(_table(r))
            last.append(len(toks) - 1)
        i64 = torch.int64
        tok = torch.tensor(toks, dtype=i64, device=dev)
        positions = torch.tensor(pos, dtype=i64, device=dev)
        x = m.w["embed"][tok]
        h = _rms(x)
        xin, z = (h @ m.w["ssm_in"]).split(DI, dim=-1)
        ys, start = [], 0
        for r, slot in zip(batch.requests, slots, strict=True):
            n = r.query_len
            xr, hr = xin[start : start + n], h[start : start + n]
            start += n
            if r.context_len > 0:
                window, s0 = self.conv_pool[slot], self.ssm_pool[slot].float()
            else:
                window = torch.zeros(CONV - 1, DI, device=dev, dtype=BF16)
                s0 = torch.zeros(H, DK, DK, device=dev)
            full = torch.cat([window, xr], dim=0)  # [CONV - 1 + n, DI]
            conv = F.conv1d(
                full.float().t()[None], m.w["conv_w"].float()[:, None, :], m.w["conv_b"], groups=DI
            )[0].t()  # [n, DI]
            self.conv_pool[slot] = full[-(CONV - 1) :]
            q, k, v, g = _qkv_gate(m, F.silu(conv), hr)
            o, s_end = chunk_scan(q, k, v, g, s0)
            self.ssm_pool[slot] = s_end.to(self.ssm_pool.dtype)
            ys.append(o.flatten(1))
        y = torch.cat(ys)
        logits = tail(
            m,
            x,
            y,
            z,
            self.k_cache,
            self.v_cache,
            torch.tensor(kvs, dtype=i64, device=dev),
            torch.tensor(tabs, dtype=i64, device=dev),
            positions,
            torch.tensor(last, dtype=i64, device=dev),
        )
        samp = [_sampling(r) for r in batch.requests]
        tokens = sample(
            logits,
            torch.tensor([s[0] for s in samp], dtype=i64, device=dev),
            positions[torch.tensor(last, dtype=i64, device=dev)],
            torch.tensor([s[1] for s in samp], device=dev),
            torch.tensor([s[2] for s in samp], dtype=torch.bool, device=dev),
        )
        return StepResult(logits, tokens, "eager", None, reason=reason)

    # -- contract -----------------------------------------------------------------------------

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.context_len == 0 or r.query_len != 1 for r in batch.requests):
            return f"{batch.phase} batch (chunked scan)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            if batch.num_reqs == 0:
                empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
                return StepResult(
                    empty,
                    torch.zeros(0, dtype=torch.int64, device=self.device),
                    "eager",
                    None,
                    reason="empty batch",
                )
            slots = self.assign_slots(batch)
            reason = self.fallback_reason(batch)
            if reason is None:
                return self.replay(batch, slots)
            return self.run_eager(batch, slots, reason)

    def state(self) -> Mapping[str, Tensor]:
        return self.views

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buf

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridRunner:
    return HybridRunner(mode, seed=seed)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> HybridRunner:
    return HybridRunner(mode, seed=seed, buggy=True)
