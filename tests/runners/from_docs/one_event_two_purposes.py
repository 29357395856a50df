"""A decode-graph runner that splits every batch: one-token rows ride a captured graph, longer rows
(prefill chunks, speculative rows) run eagerly beside it in the same step.

Written against the backend facade (`pytest_graphmode.runtime.backends.get`) and the target
contract only. A one-layer decoder over a slot-major paged KV cache, counter-based sampling.

Graph mode captures one graph per capture size (largest first, one shared pool). Host inputs are
staged in pinned arenas (one for the graph rows, one for the eager rows, each with its own
"free" event that the host waits for before rewriting it) and uploaded on a copy stream; compute
(replay, eager forward) runs on the caller's current stream; the graph rows' sampled ids come back
through a pinned buffer, downloaded on an output stream, so the host prepares the eager rows of
the same step while the replay and its download run. Two more events carry data readiness:

- `uploaded`: recorded on the copy stream after every upload; the compute stream waits for it
  before it reads the uploaded inputs.
- `downloaded`: recorded on the output stream after the token download; the host waits for it
  before it reads the pinned tokens, the compute stream before the next replay rewrites the
  graph's token output.

`make_buggy_target` uses one event object for both ("the copies are done"). In a step holding
one-token rows and longer rows, the eager rows' upload re-records it on the copy stream after the
download recorded it on the output stream and before anyone waited for the download: the host's
final wait then waits for the eager upload, and reads the pinned tokens while the download may
still be writing them (and the next replay's wait no longer covers that download either). Steps
with one kind of row only are right either way: their last record is the one they need.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=48,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=96,
    max_num_reqs=8,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
D_MODEL, N_HEADS = 32, 2
D_HEAD = D_MODEL // N_HEADS
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
ARENA_ROWS = max(SPEC.max_num_tokens, SPEC.capture_sizes[-1])
MASK31 = (1 << 31) - 1
# staged int columns: token, position, kv slot, sampling key, do-sample flag, block table
C_TOK, C_POS, C_SLOT, C_KEY, C_SAMPLE, C_TAB = range(6)
NCOL = C_TAB + SPEC.max_blocks_per_req


# -- model ----------------------------------------------------------------------------------------


def mix31(x: Tensor) -> Tensor:
    """A 31-bit integer mixer (stays inside int64 without overflow)."""
    x = ((x ^ (x >> 13)) * 0x5BD1E99) & MASK31
    x = ((x ^ (x >> 11)) * 0x2F0B3A5) & MASK31
    return x ^ (x >> 16)


def rms(x: Tensor) -> Tensor:
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)


class TinyDecoder:
    NAMES = ("tok", "pos", "q", "k", "v", "o", "up", "down", "head")

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "tok": (SPEC.vocab_size, D_MODEL),
            "pos": (MAX_POS, D_MODEL),
            "q": (D_MODEL, D_MODEL),
            "k": (D_MODEL, D_MODEL),
            "v": (D_MODEL, D_MODEL),
            "o": (D_MODEL, D_MODEL),
            "up": (D_MODEL, 3 * D_MODEL),
            "down": (3 * D_MODEL, D_MODEL),
            "head": (D_MODEL, SPEC.vocab_size),
        }
        self.p = {n: torch.zeros(shapes[n], device=device) for n in self.NAMES}
        self.set_weights(seed)

    def set_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(1000 + seed)
        for n in self.NAMES:
            w = self.p[n]
            w.copy_((torch.randn(w.shape, generator=g) / math.sqrt(w.shape[0]) * 1.3).to(w.device))

    def __call__(
        self, rows: Tensor, temps: Tensor, kc: Tensor, vc: Tensor, pick_rows: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """rows [T, NCOL] int64, temps [R]; pick_rows: which token rows give logits (None: all)."""
        p = self.p
        pos = rows[:, C_POS]
        x = p["tok"][rows[:, C_TOK]] + p["pos"][pos]
        h = rms(x)
        q = (h @ p["q"]).view(-1, N_HEADS, D_HEAD)
        kc.index_copy_(0, rows[:, C_SLOT], (h @ p["k"]).view(-1, N_HEADS, D_HEAD))
        vc.index_copy_(0, rows[:, C_SLOT], (h @ p["v"]).view(-1, N_HEADS, D_HEAD))
        offs = torch.arange(SPEC.block_size, device=x.device)
        ctx_slots = (rows[:, C_TAB:, None] * SPEC.block_size + offs).reshape(rows.shape[0], -1)
        visible = torch.arange(MAX_POS, device=x.device)[None, :] <= pos[:, None]  # [T, MAX_POS]
        keys = kc[ctx_slots]  # [T, MAX_POS, H, D]
        vals = torch.where(
            visible[:, :, None, None], vc[ctx_slots], torch.zeros((), device=x.device)
        )
        score = torch.einsum("thd,tphd->thp", q, keys) * (1.0 / math.sqrt(D_HEAD))
        score = score.masked_fill(~visible[:, None, :], float("-inf"))
        att = torch.einsum("thp,tphd->thd", score.softmax(-1), vals).reshape(-1, D_MODEL)
        x = x + att @ p["o"]
        x = x + torch.nn.functional.silu(rms(x) @ p["up"]) @ p["down"]
        if pick_rows is not None:
            x, rows = x[pick_rows], rows[pick_rows]
        logits = rms(x) @ p["head"]
        return logits, sample(logits, rows, temps)


def sample(logits: Tensor, rows: Tensor, temps: Tensor) -> Tensor:
    """Greedy, or Gumbel-max whose noise hashes (request key, position, token id)."""
    base = mix31(rows[:, C_KEY] ^ mix31(rows[:, C_POS] + 77))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    u = (mix31(base[:, None] * 31 + ids[None, :]).to(torch.float64) + 0.5) / float(MASK31 + 1)
    gumbel = -torch.log(-torch.log(u)).to(logits.dtype)
    drawn = (logits / temps[:, None] + gumbel).argmax(-1)
    return torch.where(rows[:, C_SAMPLE] != 0, drawn, logits.argmax(-1))


# -- host-side packing ----------------------------------------------------------------------------


def pack(r: Request) -> list[list[int]]:
    table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
    key = 0 if r.seed is None else (r.seed * 2654435761) & MASK31
    out = []
    for i, t in enumerate(r.tokens):
        at = r.context_len + i
        slot = r.block_ids[at // SPEC.block_size] * SPEC.block_size + at % SPEC.block_size
        out.append([t, at, slot, key, int(r.seed is not None), *table])
    return out


def temp_of(r: Request) -> float:
    return 1.0 if r.seed is None else float(r.temperature)


PAD = [0, 0, NULL_SLOT, 0, 0] + [SPEC.null_block] * SPEC.max_blocks_per_req


# -- runner ---------------------------------------------------------------------------------------


class SplitStepRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, shared_fence: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.be: Any = get_backend(backend)
        dev = self.dev = self.be.device
        self.model = TinyDecoder(seed, dev)
        self.kc = torch.zeros(SPEC.num_slots, N_HEADS, D_HEAD, device=dev)
        self.vc = torch.zeros(SPEC.num_slots, N_HEADS, D_HEAD, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outs: dict[int, tuple[Tensor, Tensor]] = {}
        self.inputs: dict[str, Tensor] = {}
        if mode == "eager":
            return
        big = SPEC.capture_sizes[-1]
        self.inputs = {
            "graph_rows": torch.zeros(big, NCOL, dtype=torch.int64, device=dev),
            "graph_temps": torch.ones(big, device=dev),
            "eager_rows": torch.zeros(ARENA_ROWS, NCOL, dtype=torch.int64, device=dev),
            "eager_temps": torch.ones(SPEC.max_num_reqs, device=dev),
        }
        # pinned arenas (graph rows, eager rows), each guarded by its own "free" event
        self.arenas = {
            part: (
                self.be.empty_pinned((rows, NCOL), dtype=torch.int64),
                self.be.empty_pinned(rows, dtype=torch.float32),
                self.be.Event(),
            )
            for part, rows in (("graph", big), ("eager", ARENA_ROWS))
        }
        self.host_tokens = self.be.empty_pinned(big, dtype=torch.int64)
        self.copy_stream = self.be.Stream()
        self.out_stream = self.be.Stream()
        self.uploaded = self.be.Event()
        self.downloaded = self.uploaded if shared_fence else self.be.Event()
        self.capture()

    # -- capture ----------------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        rows, temps = self.inputs["graph_rows"], self.inputs["graph_temps"]
        for size in sorted(SPEC.capture_sizes, reverse=True):
            rows[:size].copy_(torch.tensor([PAD] * size, dtype=torch.int64))
            temps[:size].fill_(1.0)
            self.model(rows[:size], temps[:size], self.kc, self.vc, None)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outs[size] = self.model(rows[:size], temps[:size], self.kc, self.vc, None)
            self.graphs[size] = g
        self.be.synchronize()

    # -- staging ----------------------------------------------------------------------------------

    def upload(self, part: str, rows: list[list[int]], temps: list[float]) -> None:
        """Arena -> device on the copy stream; the compute stream waits for it."""
        compute = self.be.current_stream()
        a_rows, a_temps, free = self.arenas[part]
        free.synchronize()  # the last upload out of this arena has run
        n, m = len(rows), len(temps)
        a_rows[:n].copy_(torch.tensor(rows, dtype=torch.int64))
        a_temps[:m].copy_(torch.tensor(temps, dtype=torch.float32))
        self.copy_stream.wait_stream(compute)  # the work that read the device inputs is done
        with self.be.stream(self.copy_stream):
            self.inputs[f"{part}_rows"][:n].copy_(a_rows[:n], non_blocking=True)
            self.inputs[f"{part}_temps"][:m].copy_(a_temps[:m], non_blocking=True)
            free.record()
            self.uploaded.record()
        compute.wait_event(self.uploaded)

    # -- graph part -------------------------------------------------------------------------------

    def run_graph_rows(self, reqs: list[Request]) -> tuple[Tensor, int]:
        g = len(reqs)
        size = next(s for s in SPEC.capture_sizes if s >= g)
        rows = [pack(r)[0] for r in reqs] + [PAD] * (size - g)
        temps = [temp_of(r) for r in reqs] + [1.0] * (size - g)
        self.upload("graph", rows, temps)
        compute = self.be.current_stream()
        compute.wait_event(self.downloaded)  # the last download has read the token output
        self.graphs[size].replay()
        logits, tokens = self.outs[size]
        self.out_stream.wait_stream(compute)
        with self.be.stream(self.out_stream):
            self.host_tokens[:g].copy_(tokens[:g], non_blocking=True)
            self.downloaded.record()
        return logits[:g].clone(), size

    # -- eager part -------------------------------------------------------------------------------

    def run_eager_rows(self, reqs: list[Request]) -> tuple[Tensor, Tensor]:
        rows: list[list[int]] = []
        last: list[int] = []
        for r in reqs:
            rows += pack(r)
            last.append(len(rows) - 1)
        temps = [temp_of(r) for r in reqs]
        pick = torch.tensor(last, dtype=torch.int64, device=self.dev)
        if self.mode == "eager":
            t_rows = torch.tensor(rows, dtype=torch.int64, device=self.dev)
            t_temps = torch.tensor(temps, dtype=torch.float32, device=self.dev)
        else:
            self.upload("eager", rows, temps)
            t_rows = self.inputs["eager_rows"][: len(rows)]
            t_temps = self.inputs["eager_temps"][: len(temps)]
        return self.model(t_rows, t_temps, self.kc, self.vc, pick)

    # -- contract ---------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        if n == 0:
            return StepResult(
                torch.zeros(0, SPEC.vocab_size, device=self.dev),
                torch.zeros(0, dtype=torch.int64),
                "eager",
                None,
                reason="empty batch",
            )
        if self.mode == "eager":
            logits, tokens = self.run_eager_rows(list(batch.requests))
            return StepResult(logits, tokens, "eager", None, reason="eager twin")
        g_idx = [i for i, r in enumerate(batch.requests) if r.query_len == 1]
        e_idx = [i for i, r in enumerate(batch.requests) if r.query_len != 1]
        logits = torch.empty(n, SPEC.vocab_size, device=self.dev)
        next_tokens = torch.empty(n, dtype=torch.int64)
        size = None
        if g_idx:
            g_logits, size = self.run_graph_rows([batch.requests[i] for i in g_idx])
            logits.index_copy_(0, torch.tensor(g_idx, device=self.dev), g_logits)
        if e_idx:
            e_logits, e_tokens = self.run_eager_rows([batch.requests[i] for i in e_idx])
            logits.index_copy_(0, torch.tensor(e_idx, device=self.dev), e_logits)
            next_tokens[e_idx] = e_tokens.cpu()
        if g_idx:
            self.downloaded.synchronize()  # the download of the graph rows' tokens has landed
            next_tokens[g_idx] = self.host_tokens[: len(g_idx)].clone()
        if not e_idx:
            return StepResult(logits, next_tokens, "full", ("decode", size))
        if not g_idx:
            return StepResult(logits, next_tokens, "eager", None, reason="no one-token rows")
        return StepResult(
            logits,
            next_tokens,
            "piecewise",
            ("decode", size),
            reason="multi-token rows ran eagerly",
        )

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.kc, "v": self.vc}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.inputs

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.set_weights(seed)

    def close(self) -> None:
        if self.mode == "graph":
            self.be.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SplitStepRunner:
    return SplitStepRunner(mode, seed=seed, backend=backend, shared_fence=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> SplitStepRunner:
    return SplitStepRunner(mode, seed=seed, backend=backend, shared_fence=True)
