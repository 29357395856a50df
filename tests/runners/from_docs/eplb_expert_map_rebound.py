"""A small MoE decoder with expert-parallel load balancing (EPLB), captured per decode size.

The model: token embedding + learned positions, one attention layer over a slot-major paged KV
cache (read through block tables), then a mixture-of-experts MLP: a router picks the top-2 of 4
*logical* experts per token, and the experts' weights live stacked in one tensor of 6 *physical*
expert slots (4 logical experts plus 2 redundant replicas of the hottest ones), indexed through a
logical->physical map `l2p` [logical, max_replicas] and a replica count per logical expert, as an
EPLB engine keeps them (vLLM's `logical_to_physical_map` / `logical_replica_count`, SGLang's
`ExpertLocationMetadata`). A token picks among an expert's replicas by its position.

The forward counts each logical expert's load (padding rows masked out) on the device. Every
`REBALANCE_EVERY` steps the runner reads the loads (outside any capture), computes a new
placement (hottest experts first get the redundant slots; the placement is rotated by the
rebalance count, as a packer spreading experts over EP ranks would move them) and rearranges:
it permutes the physical expert weights in place and writes the new map. `update_weights(seed)`
loads new logical weights through the current placement and then rebalances as well. The eager
twin runs the very same (deterministic) rebalancing, and the placement never changes results.

Graph mode captures one decode graph per capture size at start-up into one shared pool; every
other batch (prefill, mixed, speculative, too many rows) runs eagerly.

Correct runner: the rearrangement copies the new weights AND the new map into the same tensors
(`copy_`), so the captured graphs see both.

Bug (`make_buggy_target`): `_install_map` rebinds `self.l2p = new_map` (a freshly built tensor)
while the weights are permuted in place. Graphs captured before the rebalance keep reading the old
map's memory (freed, or still holding the old placement) against the new weight layout, so every
replay after a rebalance routes tokens to the wrong physical experts; eager steps use the new map
and stay right.

Modelled on: SGLang's EPLB design note in https://github.com/sgl-project/sglang/pull/4957 ("to
avoid breaking cuda graphs when updating experts, we need to use the same tensor address, thus we
need to keep shape unchanged to allow copying": the logical->physical map is padded to a fixed
shape precisely so that a rebalance can `copy_` into it), and the symptom of
https://github.com/sgl-project/sglang/pull/18213 ("model output corruption caused by EPLB
rebalance (Eager and CUDA Graph modes)": outputs degrade right after the rebalancing phase when
the forward does not read the current logical->physical mapping). See also vLLM's RFC
https://github.com/vllm-project/vllm/issues/48941 (captured graphs burn in the addresses of every
tensor; after a reload every address a graph references must keep the updated values). No code
was copied from those engines.
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
HIDDEN, HEADS, HEAD_DIM, FFN = 32, 2, 16, 32
NUM_LOGICAL, NUM_PHYSICAL, MAX_REPLICAS, TOP_K = 4, 6, 2, 2
REBALANCE_EVERY = 3  # steps between two rebalances
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF


@dataclass
class Inputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks]
    valid: Tensor  # [T] float: 1 for a real token, 0 for padding (load statistics only)
    seeds: Tensor  # [R]
    temps: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] each request's last token (None: T == R)


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def sample(logits: Tensor, positions: Tensor, inp: Inputs) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): company-independent."""
    key = _hash(_hash(inp.seeds) ^ ((positions * 0x61C88647) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x7FEB352D) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / inp.temps[:, None] - torch.log(-torch.log(u))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


class MoEDecoder:
    """Weights, the EPLB placement tensors and the forward (no host reads)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        dense = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "router": (HIDDEN, NUM_LOGICAL),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {n: torch.empty(s, device=device) for n, s in dense.items()}
        # physical expert slots, indexed by physical id
        self.w_up = torch.empty(NUM_PHYSICAL, HIDDEN, FFN, device=device)
        self.w_down = torch.empty(NUM_PHYSICAL, FFN, HIDDEN, device=device)
        # EPLB placement: physical slot -> logical expert (host), and the device map the forward reads
        self.phys2log: list[int] = []
        self.l2p = torch.zeros(NUM_LOGICAL, MAX_REPLICAS, dtype=torch.int64, device=device)
        self.replicas = torch.ones(NUM_LOGICAL, dtype=torch.int64, device=device)
        self.load = torch.zeros(NUM_LOGICAL, device=device)  # tokens routed per logical expert
        self.rebalances = 0
        self.set_placement([*range(NUM_LOGICAL), 0, 1])
        self.load_weights(seed)

    # -- placement ---------------------------------------------------------------------------

    @staticmethod
    def map_of(phys2log: list[int]) -> tuple[list[list[int]], list[int]]:
        table, counts = [], []
        for e in range(NUM_LOGICAL):
            slots = [p for p, log in enumerate(phys2log) if log == e][:MAX_REPLICAS]
            counts.append(len(slots))
            table.append(slots + [slots[0]] * (MAX_REPLICAS - len(slots)))
        return table, counts

    def set_placement(self, phys2log: list[int]) -> None:
        """Initial placement: fill the map in place (weights are loaded after)."""
        table, counts = self.map_of(phys2log)
        self.phys2log = list(phys2log)
        self.l2p.copy_(torch.tensor(table, dtype=torch.int64).to(self.device))
        self.replicas.copy_(torch.tensor(counts, dtype=torch.int64).to(self.device))

    def rearrange(self, phys2log: list[int]) -> None:
        """Move expert weights to the new placement (in place) and install the new map."""
        if phys2log == self.phys2log:
            return
        old_first = {}
        for p, log in enumerate(self.phys2log):
            old_first.setdefault(log, p)
        src = torch.tensor([old_first[log] for log in phys2log], dtype=torch.int64).to(self.device)
        self.w_up.copy_(self.w_up[src])  # stands in for the all-to-all weight exchange
        self.w_down.copy_(self.w_down[src])
        table, counts = self.map_of(phys2log)
        self._install_map(
            torch.tensor(table, dtype=torch.int64).to(self.device),
            torch.tensor(counts, dtype=torch.int64).to(self.device),
        )
        self.phys2log = list(phys2log)

    def _install_map(self, new_map: Tensor, new_counts: Tensor) -> None:
        self.l2p.copy_(new_map)
        self.replicas.copy_(new_counts)

    def rebalance(self) -> None:
        """EPLB step: hottest logical experts get the redundant slots; placement rotates."""
        loads = self.load.tolist()  # host read, between steps only
        self.load.zero_()
        order = sorted(range(NUM_LOGICAL), key=lambda e: (-loads[e], e))
        packed = order + order[: NUM_PHYSICAL - NUM_LOGICAL]
        self.rebalances += 1
        shift = self.rebalances % NUM_PHYSICAL
        self.rearrange(packed[shift:] + packed[:shift])

    # -- weights -----------------------------------------------------------------------------

    def load_weights(self, seed: int) -> None:
        """New logical weights, written through the current placement into the same tensors."""
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=g) / math.sqrt(t.shape[0])).to(self.device))
        up = torch.randn(NUM_LOGICAL, HIDDEN, FFN, generator=g) / math.sqrt(HIDDEN)
        down = torch.randn(NUM_LOGICAL, FFN, HIDDEN, generator=g) / math.sqrt(FFN)
        idx = torch.tensor(self.phys2log, dtype=torch.int64)
        self.w_up.copy_(up[idx].to(self.device))
        self.w_down.copy_(down[idx].to(self.device))

    # -- forward -----------------------------------------------------------------------------

    def forward(self, inp: Inputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        x = w["embed"][inp.tokens] + w["pos"][inp.positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, inp.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, inp.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + _attend(q, k_cache, v_cache, inp.tables, inp.positions) @ w["o"]
        x = x + self.moe(_rms(x), inp)
        if inp.last is not None:
            x = x[inp.last]
        return _rms(x) @ w["head"]

    def moe(self, h: Tensor, inp: Inputs) -> Tensor:
        probs = (h @ self.w["router"]).softmax(-1)  # [T, logical]
        top_w, top_e = probs.topk(TOP_K, dim=-1)  # [T, K]
        top_w = top_w / top_w.sum(-1, keepdim=True)
        replica = inp.positions[:, None] % self.replicas[top_e]  # which copy serves the token
        phys = self.l2p[top_e, replica]  # [T, K] physical slot ids
        up = torch.einsum("th,tkhf->tkf", h, self.w_up[phys])
        down = torch.einsum("tkf,tkfh->tkh", torch.nn.functional.silu(up), self.w_down[phys])
        weight = inp.valid[:, None].expand(-1, TOP_K).reshape(-1)
        self.load.index_add_(0, top_e.reshape(-1), weight)  # expert load statistics
        return (down * top_w[..., None]).sum(1)


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, qpos: Tensor) -> Tensor:
    bs = SPEC.block_size
    ctx = (tables[:, :, None] * bs + torch.arange(bs, device=q.device)).flatten(1)  # [T, CONTEXT]
    keys, vals = k_cache[ctx], v_cache[ctx]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= qpos[:, None]
    s = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    p = s.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", p, vals).flatten(1)


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _samp(r: Request) -> tuple[int, float, bool]:
    return (0, 1.0, False) if r.seed is None else (r.seed & M32, r.temperature, True)


PAD = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "valid": 0.0,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
}


class EplbRunner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        decoder: type[MoEDecoder] = MoEDecoder,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec, self.mode = SPEC, mode
        self.be: Any = get_backend(backend)
        dev = self.be.device
        with torch.inference_mode():
            self.model = decoder(seed, dev)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.k_cache = torch.zeros(shape, device=dev)
            self.v_cache = torch.zeros(shape, device=dev)
            self.steps = 0
            self.graphs: dict[int, Any] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            if mode == "graph":
                n, i64 = SPEC.capture_sizes[-1], torch.int64
                self.buffers = {
                    "tokens": torch.zeros(n, dtype=i64, device=dev),
                    "positions": torch.zeros(n, dtype=i64, device=dev),
                    "slots": torch.zeros(n, dtype=i64, device=dev),
                    "tables": torch.zeros(n, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                    "valid": torch.zeros(n, device=dev),
                    "seeds": torch.zeros(n, dtype=i64, device=dev),
                    "temps": torch.ones(n, device=dev),
                    "sampled": torch.zeros(n, dtype=torch.bool, device=dev),
                }
                self.capture()

    # -- graph mode --------------------------------------------------------------------------

    def static_inputs(self, size: int) -> Inputs:
        return Inputs(**{k: b[:size] for k, b in self.buffers.items()})

    def run(self, inp: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, self.k_cache, self.v_cache)
        pos = inp.positions if inp.last is None else inp.positions[inp.last]
        return logits, sample(logits, pos, inp)

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inp = self.static_inputs(size)
            self.run(inp)  # warm-up (padding only: adds no load)
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[size] = self.run(inp)
            self.graphs[size] = g

    def prepare(self, batch: Batch, size: int) -> None:
        reqs, n = batch.requests, batch.num_reqs
        rows: dict[str, list[Any]] = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "valid": [1.0] * n,
            "seeds": [_samp(r)[0] for r in reqs],
            "temps": [_samp(r)[1] for r in reqs],
            "sampled": [_samp(r)[2] for r in reqs],
        }
        for name, vals in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(vals, dtype=buf.dtype))
            buf[n:size].fill_(PAD[name])

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, toks = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), toks[:n].clone(), "full", ("decode", size))

    # -- eager -------------------------------------------------------------------------------

    def eager(self, batch: Batch, reason: str) -> StepResult:
        tokens, pos, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                tokens.append(t)
                pos.append(r.context_len + i)
                slots.append(_slot(r, r.context_len + i))
                tables.append(_table(r))
            last.append(len(tokens) - 1)
        dev, i64 = self.be.device, torch.int64
        samp = [_samp(r) for r in batch.requests]
        inp = Inputs(
            tokens=torch.tensor(tokens, dtype=i64, device=dev),
            positions=torch.tensor(pos, dtype=i64, device=dev),
            slots=torch.tensor(slots, dtype=i64, device=dev),
            tables=torch.tensor(tables, dtype=i64, device=dev).view(-1, SPEC.max_blocks_per_req),
            valid=torch.ones(len(tokens), device=dev),
            seeds=torch.tensor([s[0] for s in samp], dtype=i64, device=dev),
            temps=torch.tensor([s[1] for s in samp], dtype=torch.float32, device=dev),
            sampled=torch.tensor([s[2] for s in samp], dtype=torch.bool, device=dev),
            last=torch.tensor(last, dtype=i64, device=dev),
        )
        logits, toks = self.run(inp)
        return StepResult(logits, toks, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens) or batch.phase != "decode":
            return f"{batch.phase} batch / query length > 1"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    # -- contract ----------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            if self.steps and self.steps % REBALANCE_EVERY == 0:
                self.model.rebalance()  # EPLB: rearrange experts between steps
            self.steps += 1
            if batch.num_reqs == 0:
                empty = torch.zeros(0, SPEC.vocab_size, device=self.be.device)
                return StepResult(
                    empty,
                    torch.zeros(0, dtype=torch.int64, device=self.be.device),
                    "eager",
                    None,
                    reason="empty batch",
                )
            reason = self.fallback_reason(batch)
            return self.replay(batch) if reason is None else self.eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load_weights(seed)
            self.model.rebalance()

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


class BuggyMoEDecoder(MoEDecoder):
    def _install_map(self, new_map: Tensor, new_counts: Tensor) -> None:
        self.l2p = new_map  # BUG: rebinds the map; graphs captured earlier keep the old one
        self.replicas.copy_(new_counts)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> EplbRunner:
    return EplbRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> EplbRunner:
    return EplbRunner(mode, seed=seed, backend=backend, decoder=BuggyMoEDecoder)
