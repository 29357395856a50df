"""Parallel sampling (n = 2) with siblings that share their parent's KV blocks, decoded on graphs.

What it is
----------
A one-layer decoder (token + learned position embedding, single-head attention over a paged KV
cache read through block tables, GELU MLP, LM head, Gumbel sampling from hashed noise) that
serves every request as a parallel-sampling group of two: the request the harness schedules (the
*parent*, whose logits and token are reported) and a *sibling* sequence the runner keeps itself,
as an engine serving ``n=2`` does for the second completion.

The contract gives every block to exactly one request, so siblings cannot be expressed as two
harness requests listing the same blocks; the sharing lives inside the runner:

- **Fork.** After a parent's step that starts or restarts it (context 0, a prefill chunk, or a
  parent whose bookkeeping no longer matches), the runner forks a sibling: the sibling's block
  table points at the parent's physical blocks (the same harness block ids: reference count 2),
  its first token is drawn from the parent's logits with the sibling's own seed. Each sibling
  holds a *sequence slot* (0 .. NUM_SLOTS-1) and, per slot, a fixed range of private blocks placed
  after the harness's ``num_blocks`` in one cache tensor (``state()`` exposes only the harness's
  part, as a view).
- **Copy-on-write.** The sibling decodes beside its parent, one token a step at the same position.
  When that position falls in a block still shared with the parent, the step first copies the
  whole block into the sibling's private block for that column (a (src, dst) pair) and the
  sibling's table is repointed; a position that opens a new block takes a private block directly.
  The parent keeps writing its own (harness) blocks, as the contract requires.
- **Per-slot device state.** Sibling block tables live in a device table indexed by sequence slot
  (a host mirror uploaded whole each step), sibling tokens in a device token store indexed by slot
  (written by the step's sampler: never read on the host). A step's sibling rows gather their
  table and token from these by a per-row slot index, the way an engine gathers a beam's cache
  indirection by sequence slot. Row ``NUM_SLOTS`` of each is a dummy slot: all null block.

Correct runner
--------------
Graph mode captures one decode graph per capture size ``s`` at start-up (largest first, one pool):
``s`` parent rows plus ``s`` sibling rows (the graph is sized by batch x width, like a beam-search
graph). Before each replay the host rewrites every row of every static buffer: parent rows from
the batch, padding parent rows as token 0 / position 0 / the null block; sibling rows with their
slot, position, seed and CoW pair, and every sibling row without a live sibling (a request that
forks this step, a padding row) with the dummy slot and the pair (null, null), so padding reads and
writes the null block only. Batches with a longer query, no requests or more requests than the
largest graph run eagerly, through the same forward with exactly the rows they have. The eager
twin runs every step that way.

Buggy runner: exactly one bug
-----------------------------
The per-row slot index that the graph's sibling gather reads is built over the *padded* rows, and
a row without a sequence slot of its own (a padding row of the graph, a parent that only forks
this step) is given index 0 instead of the dummy slot. Such a row then gathers the block table
(and token) of whichever sibling holds slot 0 and, at its padding position 0, writes keys and
values into that sibling's first block, which is its parent's shared prompt block wherever the
prompt filled it (or the parent's tail before its first copy-on-write); its sampled token is
scattered over slot 0's token. The eager path has no padding rows and is unaffected.

Modelled on: TensorRT-LLM's beam search under CUDA graphs, where the graph reads a static
cache-indirection buffer gathered per step by sequence slot from the sampler's buffer
(https://github.com/NVIDIA/TensorRT-LLM/pull/6217), and the CUDA-graph padding dummies were not
excluded from that gather: PR #6665 "Enhance CUDA graph + Beam search to correctly handle padding"
(https://github.com/NVIDIA/TensorRT-LLM/pull/6665) makes the engine skip dummy requests when it
builds the slot list (there the dummy's slot was None, so the gather raised); the silent form,
padding requests defaulting to sequence slot 0 and corrupting the real request that holds it, is
TensorRT-LLM PR #16548 (https://github.com/NVIDIA/TensorRT-LLM/pull/16548). Copy-on-write of a
shared tail block for forked sequences: vLLM's block copy for beam search / parallel sampling,
https://github.com/vllm-project/vllm/pull/32. No code copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

VOCAB = 64
HIDDEN = 32
SPEC = TargetSpec(
    num_blocks=20,
    block_size=4,
    max_blocks_per_req=4,
    vocab_size=VOCAB,
    max_num_reqs=4,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "sampling"}),
)
BS = SPEC.block_size
MB = SPEC.max_blocks_per_req
CONTEXT = MB * BS
NULL = SPEC.null_block
NUM_SLOTS = 4 * SPEC.max_num_reqs  # sibling sequence slots (the harness keeps <= 2x live)
DUMMY = NUM_SLOTS  # the dummy slot: all null block
TOTAL_BLOCKS = SPEC.num_blocks + NUM_SLOTS * MB
M32 = 0xFFFFFFFF
SIB_SALT = 0x5BD1E995


def private_block(slot: int, col: int) -> int:
    return SPEC.num_blocks + slot * MB + col


def _mix(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & M32
    return x ^ (x >> 16)


def draw(logits: Tensor, seeds: Tensor, pos: Tensor, temps: Tensor, sampled: Tensor) -> Tensor:
    """Gumbel-max with noise from (seed, position, token id); argmax where not sampled."""
    key = _mix(_mix(seeds & M32) ^ ((pos * 0x9E3779B1) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


@dataclass
class Rows:
    """One forward's inputs: parent rows (tables from the batch), then sibling rows (tables and
    tokens gathered on the device by slot)."""

    tokens: Tensor  # [P]
    positions: Tensor  # [P]
    slots: Tensor  # [P] write slot
    tables: Tensor  # [P, MB]
    seeds: Tensor  # [R] per parent
    temps: Tensor  # [R]
    sampled: Tensor  # [R] bool
    fork_idx: Tensor  # [R] slot whose first token this parent's logits give (DUMMY: none)
    sib_idx: Tensor  # [S] slot each sibling row gathers
    sib_pos: Tensor  # [S]
    sib_seed: Tensor  # [S]
    sib_temp: Tensor  # [S]
    fork_seed: Tensor  # [R] the forked sibling's seed
    fork_temp: Tensor  # [R]
    cow_src: Tensor  # [S] block copied from (NULL: none)
    cow_dst: Tensor  # [S] block copied to
    last: Tensor | None = None  # [R] last parent row of each request (eager)


PARENT_PAD: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL * BS,
    "tables": NULL,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
    "fork_idx": DUMMY,
    "fork_seed": 0,
    "fork_temp": 1.0,
}
SIB_PAD: dict[str, Any] = {
    "sib_idx": DUMMY,
    "sib_pos": 0,
    "sib_seed": 0,
    "sib_temp": 1.0,
    "cow_src": NULL,
    "cow_dst": NULL,
}
DTYPES = {
    "temps": torch.float32,
    "sampled": torch.bool,
    "sib_temp": torch.float32,
    "fork_temp": torch.float32,
}


@dataclass
class Sibling:
    slot: int
    seed: int
    temp: float
    table: list[int]
    ctx: int  # the parent's seq_len after the sibling's last step (or its fork)
    parent_blocks: tuple[int, ...]
    last_seen: int = 0


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(seed)
        shapes = {
            "embed": (VOCAB, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "w1": (HIDDEN, 2 * HIDDEN),
            "w2": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, VOCAB),
        }
        self.w = {
            name: (torch.randn(shape, generator=gen) / math.sqrt(shape[0])).to(device)
            for name, shape in shapes.items()
        }
        self.w["head"] = self.w["head"] * 2.0

    def layer(
        self,
        tokens: Tensor,
        positions: Tensor,
        slots: Tensor,
        tables: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        w = self.w
        x = w["embed"][tokens] + w["pos"][positions]
        h = _rms(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        cols = (tables[:, :, None] * BS + torch.arange(BS, device=x.device)).flatten(1)
        keys, vals = k_cache[cols], v_cache[cols]  # [T, CONTEXT, H]
        visible = torch.arange(CONTEXT, device=x.device)[None, :] <= positions[:, None]
        keys = torch.where(visible[:, :, None], keys, torch.zeros((), device=x.device))
        vals = torch.where(visible[:, :, None], vals, torch.zeros((), device=x.device))
        scores = torch.einsum("th,tch->tc", q, keys) / math.sqrt(HIDDEN)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        x = x + torch.einsum("tc,tch->th", probs, vals) @ w["wo"]
        x = x + torch.nn.functional.gelu(_rms(x) @ w["w1"]) @ w["w2"]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class SiblingRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, pad_slot: int) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.pad_slot = pad_slot  # DUMMY (correct) or 0 (the bug)
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.dev = dev
        with torch.inference_mode():
            self.model = Model(seed, dev)
            self.k_all = torch.zeros(TOTAL_BLOCKS * BS, HIDDEN, device=dev)
            self.v_all = torch.zeros(TOTAL_BLOCKS * BS, HIDDEN, device=dev)
            self.k_view = self.k_all[: SPEC.num_slots]
            self.v_view = self.v_all[: SPEC.num_slots]
            # per-slot device state of the siblings (row DUMMY: the dummy slot)
            self.tab_store = torch.full((NUM_SLOTS + 1, MB), NULL, dtype=torch.int64, device=dev)
            self.tok_store = torch.zeros(NUM_SLOTS + 1, dtype=torch.int64, device=dev)
        self.mirror = [[NULL] * MB for _ in range(NUM_SLOTS + 1)]
        self.sibs: dict[int, Sibling] = {}
        self.free = list(range(NUM_SLOTS))
        self.clock = 0
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            with torch.inference_mode():
                self._capture_all()

    # -- sibling bookkeeping (host) -----------------------------------------------------------

    def _release(self, req_id: int) -> None:
        sib = self.sibs.pop(req_id)
        self.mirror[sib.slot] = [NULL] * MB
        self.free.append(sib.slot)
        self.free.sort()

    def _take_slot(self, in_batch: set[int]) -> int | None:
        if not self.free:
            idle = [s for r, s in self.sibs.items() if r not in in_batch]
            if not idle:
                return None
            victim = min(idle, key=lambda s: (s.last_seen, s.slot))
            self._release(next(r for r, s in self.sibs.items() if s is victim))
        return self.free.pop(0)

    def _plan(self, batch: Batch) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Decide forks, sibling rows and copy-on-write pairs; update the host mirror.

        Returns per-request fork info and the live sibling rows."""
        self.clock += 1
        in_batch = {r.req_id for r in batch.requests}
        forks: list[dict[str, Any]] = []
        sib_rows: list[dict[str, Any]] = []
        for r in batch.requests:
            sib = self.sibs.get(r.req_id)
            ok = (
                sib is not None
                and r.context_len > 0
                and r.query_len == 1
                and r.context_len == sib.ctx
                and tuple(r.block_ids[: len(sib.parent_blocks)]) == sib.parent_blocks
            )
            if ok:
                assert sib is not None
                pos = r.context_len
                col = pos // BS
                src = dst = NULL
                if sib.table[col] == NULL:  # a new block: private from the start
                    sib.table[col] = private_block(sib.slot, col)
                elif sib.table[col] < SPEC.num_blocks:  # still the parent's: copy on write
                    src, dst = sib.table[col], private_block(sib.slot, col)
                    sib.table[col] = dst
                self.mirror[sib.slot] = list(sib.table)
                sib.ctx = r.seq_len
                sib.parent_blocks = tuple(r.block_ids[: -(-r.seq_len // BS)])
                sib.last_seen = self.clock
                sib_rows.append(
                    {
                        "sib_idx": sib.slot,
                        "sib_pos": pos,
                        "sib_seed": sib.seed,
                        "sib_temp": sib.temp,
                        "cow_src": src,
                        "cow_dst": dst,
                    }
                )
                forks.append({"fork_idx": DUMMY, "fork_seed": 0, "fork_temp": 1.0})
                continue
            if sib is not None:
                self._release(r.req_id)
            slot = self._take_slot(in_batch)
            if slot is None:
                forks.append({"fork_idx": DUMMY, "fork_seed": 0, "fork_temp": 1.0})
                continue
            shared = list(r.block_ids[: -(-r.seq_len // BS)])
            seed = ((r.seed if r.seed is not None else r.req_id) ^ SIB_SALT) & M32
            temp = r.temperature if r.seed is not None else 1.0
            new = Sibling(
                slot=slot,
                seed=seed,
                temp=temp,
                table=shared + [NULL] * (MB - len(shared)),
                ctx=r.seq_len,
                parent_blocks=tuple(shared),
                last_seen=self.clock,
            )
            self.sibs[r.req_id] = new
            self.mirror[slot] = list(new.table)
            forks.append({"fork_idx": slot, "fork_seed": seed, "fork_temp": temp})
        return forks, sib_rows

    # -- the forward (both modes) -------------------------------------------------------------

    def _forward(self, x: Rows) -> tuple[Tensor, Tensor]:
        kb = self.k_all.view(TOTAL_BLOCKS, BS, HIDDEN)
        vb = self.v_all.view(TOTAL_BLOCKS, BS, HIDDEN)
        # 1. copy-on-write of shared blocks the siblings append into
        kb.index_copy_(0, x.cow_dst, kb.index_select(0, x.cow_src))
        vb.index_copy_(0, x.cow_dst, vb.index_select(0, x.cow_src))
        # 2. sibling rows: table and token gathered by sequence slot
        s_tables = self.tab_store.index_select(0, x.sib_idx)
        s_tokens = self.tok_store.index_select(0, x.sib_idx)
        s_cols = (x.sib_pos // BS)[:, None]
        s_slots = s_tables.gather(1, s_cols).squeeze(1) * BS + x.sib_pos % BS
        tokens = torch.cat([x.tokens, s_tokens])
        positions = torch.cat([x.positions, x.sib_pos])
        slots = torch.cat([x.slots, s_slots])
        tables = torch.cat([x.tables, s_tables])
        logits = self.model.layer(tokens, positions, slots, tables, self.k_all, self.v_all)
        n_parent_rows = x.tokens.shape[0]
        p_logits, s_logits = logits[:n_parent_rows], logits[n_parent_rows:]
        p_pos = x.positions
        if x.last is not None:
            p_logits, p_pos = p_logits[x.last], p_pos[x.last]
        p_tokens = draw(p_logits, x.seeds, p_pos, x.temps, x.sampled)
        # 3. the siblings' next tokens: a fork draws from its parent's logits, a live sibling
        # from its own; both are stored by slot on the device
        always = torch.ones_like(x.sampled)
        fork_tok = draw(p_logits, x.fork_seed, p_pos + 1, x.fork_temp, always)
        every = torch.ones_like(x.sib_idx, dtype=torch.bool)
        s_next = draw(s_logits, x.sib_seed, x.sib_pos + 1, x.sib_temp, every)
        self.tok_store.index_copy_(0, x.fork_idx, fork_tok)
        self.tok_store.index_copy_(0, x.sib_idx, s_next)
        return p_logits, p_tokens

    # -- eager path ---------------------------------------------------------------------------

    def _tensor(self, name: str, values: list[Any]) -> Tensor:
        return torch.tensor(values, dtype=DTYPES.get(name, torch.int64), device=self.dev)

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        forks, sib_rows = self._plan(batch)
        self.tab_store.copy_(torch.tensor(self.mirror, dtype=torch.int64))
        cols: dict[str, list[Any]] = {n: [] for n in ("tokens", "positions", "slots", "tables")}
        per_req: dict[str, list[Any]] = {
            n: [] for n in ("seeds", "temps", "sampled", "fork_idx", "fork_seed", "fork_temp")
        }
        last: list[int] = []
        for r, fork in zip(batch.requests, forks, strict=True):
            table = list(r.block_ids) + [NULL] * (MB - len(r.block_ids))
            for i, pos in enumerate(range(r.context_len, r.seq_len)):
                cols["tokens"].append(r.tokens[i])
                cols["positions"].append(pos)
                cols["slots"].append(kv_slot(r.block_ids, pos, BS))
                cols["tables"].append(table)
            last.append(len(cols["tokens"]) - 1)
            for n, v in _sampling(r).items():
                per_req[n].append(v)
            for n, v in fork.items():
                per_req[n].append(v)
        sib: dict[str, list[Any]] = {n: [row[n] for row in sib_rows] for n in SIB_PAD}
        t = {n: self._tensor(n, v) for n, v in {**cols, **per_req, **sib}.items()}
        t["tables"] = t["tables"].view(-1, MB)
        x = Rows(**t, last=self._tensor("last", last))
        logits, tokens = self._forward(x)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    # -- graph path ---------------------------------------------------------------------------

    def _capture_all(self) -> None:
        top = SPEC.capture_sizes[-1]
        self.buffers = {}
        for name, value in {**PARENT_PAD, **SIB_PAD}.items():
            shape = (top, MB) if name == "tables" else (top,)
            self.buffers[name] = torch.full(
                shape, value, dtype=DTYPES.get(name, torch.int64), device=self.dev
            )
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._stage(Batch(()), [], [], size)
            inputs = self._static(size)
            self._forward(inputs)  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self._forward(inputs)
            self.graphs[size] = graph

    def _static(self, size: int) -> Rows:
        return Rows(**{n: b[:size] for n, b in self.buffers.items()})

    def _stage(
        self, batch: Batch, forks: list[dict[str, Any]], sib_rows: list[dict[str, Any]], size: int
    ) -> None:
        self.tab_store.copy_(torch.tensor(self.mirror, dtype=torch.int64))
        parent_rows = []
        for r, fork in zip(batch.requests, forks, strict=True):
            table = list(r.block_ids) + [NULL] * (MB - len(r.block_ids))
            pos = r.context_len
            parent_rows.append(
                {
                    "tokens": r.tokens[0],
                    "positions": pos,
                    "slots": kv_slot(r.block_ids, pos, BS),
                    "tables": table,
                    **_sampling(r),
                    **fork,
                }
            )
        n, m = len(parent_rows), len(sib_rows)
        for name, pad in PARENT_PAD.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(self._tensor(name, [row[name] for row in parent_rows]))
            buf[n:size].fill_(pad)
        for name, pad in SIB_PAD.items():
            buf = self.buffers[name]
            if m:
                buf[:m].copy_(self._tensor(name, [row[name] for row in sib_rows]))
            # rows without a live sibling: the dummy slot (the bug: slot `pad_slot`)
            buf[m:size].fill_(self.pad_slot if name == "sib_idx" else pad)

    def _replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        forks, sib_rows = self._plan(batch)
        self._stage(batch, forks, sib_rows, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def _fallback(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.query_len != 1 for r in batch.requests):
            return "a request with more than one query token"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest graph"
        return None

    # -- contract -----------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self._fallback(batch)
            return self._replay(batch) if reason is None else self._eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_view, "v": self.v_view}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode == "eager":
            return {}
        return {**self.buffers, "sib_tables": self.tab_store}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        raise NotImplementedError("no weight_update feature")

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def _sampling(r: Request) -> dict[str, Any]:
    sampled = r.seed is not None
    return {
        "seeds": (r.seed & M32) if sampled else 0,
        "temps": r.temperature if sampled else 1.0,
        "sampled": sampled,
    }


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SiblingRunner:
    return SiblingRunner(mode, seed=seed, backend=backend, pad_slot=DUMMY)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SiblingRunner:
    return SiblingRunner(mode, seed=seed, backend=backend, pad_slot=0)
