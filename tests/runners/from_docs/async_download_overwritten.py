"""A decode-graph runner that downloads its sampled token ids asynchronously (vLLM "async output").

Written against plain `torch.cuda` (no harness import but the contract types); on sim it runs
inside the harness's drop-in.

What it does. A one-layer decoder over a slot-major paged KV cache; one decode graph per capture
size, captured at start-up (largest first, one shared pool); any batch whose requests all have
one query token replays a graph, anything else runs eagerly. After every replay a dedicated copy
stream waits on an event recorded on the main stream after the replay and downloads the graph's
static output ids into pinned host memory with `non_blocking=True`, so the device-to-host copy
overlaps the work that follows on the main stream; the host reads the downloaded ids only after
the copy's event is synchronized. `StepResult.next_tokens` is that pinned host tensor (fresh per
step, so it survives the next step), `logits` a device copy made on the main stream.

Where the overlap is. The contract asks that a step's host results be complete when `step()`
returns (docs/contract.md, "step() may be called again before the last result is read"), so the
host cannot return step N before its download lands, and the cross-step race (download of step N
vs. replay of step N+1) cannot happen in a contract-abiding runner: the host's wait for step N's
download orders it before step N+1. The same hazard exists inside one step whenever one graph is
replayed more than once: a decode batch with more requests than the largest graph runs as k
micro-batches of equal size on one graph (like micro-batched / dual-batch-overlap decode), and
micro-batch i's download overlaps micro-batch i+1's upload and replay. Only the last download is
waited for by the host, at the end of the step.

Correct runner: before each replay the main stream waits on the copy stream's "downloaded" event
(write-after-read ordering: the replay rewrites the static output ids the previous download reads).

Bug (`make_buggy_target`): that wait is missing, so micro-batch i+1's replay may overwrite the
static output ids while micro-batch i's download still reads them (a WAR race): micro-batch i
reports micro-batch i+1's tokens.

Modelled on vLLM's async output / async scheduling copy (`AsyncModelRunnerOutput`: the copy
stream `wait_stream`s the main stream and downloads `sampled_token_ids` into pinned memory,
synchronizing an event before the host reads them; and "We must retain references to the GPU
tensors, as the copy operations are performed on a different CUDA stream"):
https://github.com/vllm-project/vllm/pull/23569 and https://github.com/vllm-project/vllm/pull/19970.
vLLM avoids this WAR by downloading a fresh tensor per step; a runner that downloads a graph's
static output instead needs the wait this bug drops (cf. the vllm-rbln async-scheduling ring of
two sampled-token buffers, "because the output thread reads one while the next step writes the
other": https://github.com/RBLN-SW/vllm-rbln/pull/951).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
MASK32 = 0xFFFFFFFF
# int64 input columns: token, position, slot, seed, sampled, then the block table
TOK, POS, SLOT, SEED, SAMPLED, TABLE = 0, 1, 2, 3, 4, 5
WIDTH = TABLE + SPEC.max_blocks_per_req


# -- the model (no host reads: capturable) -------------------------------------------------------


def _hash(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & MASK32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


class Decoder:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        slots = SPEC.num_blocks * SPEC.block_size
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=device)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=device)
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def forward(self, rows: Tensor, temps: Tensor, last: Tensor | None) -> tuple[Tensor, Tensor]:
        """rows: [T, WIDTH] int64, temps: [T] float; results at `last` (None: every row)."""
        w = self.w
        tok, pos, slot = rows[:, TOK], rows[:, POS], rows[:, SLOT]
        x = w["embed"][tok] + w["pos"][pos]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        self.k_cache.index_copy_(0, slot, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slot, v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        ctx = (rows[:, TABLE:, None] * bs + torch.arange(bs, device=self.device)).flatten(1)
        keys, vals = self.k_cache[ctx], self.v_cache[ctx]  # [T, CONTEXT, H, D]
        visible = torch.arange(CONTEXT, device=self.device)[None, :] <= pos[:, None]
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(
            HEAD_DIM
        )
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(visible[:, :, None, None], vals, torch.zeros((), device=self.device))
        x = x + torch.einsum("thc,tchd->thd", probs, vals).flatten(1) @ w["wo"]
        x = x + torch.nn.functional.silu(x @ w["up"]) @ w["down"]
        if last is not None:
            x, rows, temps = x[last], rows[last], temps[last]
        logits = x @ w["head"]
        return logits, self.sample(logits, rows, temps)

    @staticmethod
    def sample(logits: Tensor, rows: Tensor, temps: Tensor) -> Tensor:
        """Gumbel-max with noise hashed from (seed, position, token id); greedy rows take argmax."""
        key = _hash(_hash(rows[:, SEED]) ^ ((rows[:, POS] * 0x27D4EB2F) & MASK32))
        ids = torch.arange(logits.shape[-1], device=logits.device)
        bits = _hash(key[:, None] ^ ((ids * 0x165667B1) & MASK32)[None, :])
        u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
        noisy = logits / temps[:, None] - torch.log(-torch.log(u))
        return torch.where(rows[:, SAMPLED] != 0, noisy.argmax(-1), logits.argmax(-1))


# -- host-side rows --------------------------------------------------------------------------------


def _request_rows(r: Request) -> tuple[list[list[int]], list[float]]:
    table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
    sampled = r.seed is not None
    seed = (r.seed & MASK32) if sampled else 0
    temp = float(r.temperature) if sampled else 1.0
    rows = []
    for i, t in enumerate(r.tokens):
        p = r.context_len + i
        rows.append([t, p, kv_slot(r.block_ids, p, SPEC.block_size), seed, int(sampled), *table])
    return rows, [temp] * len(rows)


PAD_ROW = [0, 0, SPEC.null_block * SPEC.block_size, 0, 0] + [
    SPEC.null_block
] * SPEC.max_blocks_per_req


# -- the runner ------------------------------------------------------------------------------------


class AsyncDownloadRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, war_wait: bool = True
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.war_wait = war_wait
        self.device = torch.device("cuda")
        self.model = Decoder(seed, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            c = SPEC.capture_sizes[-1]
            self.buffers = {
                "rows": torch.zeros(c, WIDTH, dtype=torch.int64, device=self.device),
                "temps": torch.ones(c, device=self.device),
            }
            self.copy_stream = torch.cuda.Stream()
            self.replayed = torch.cuda.Event()
            self.downloaded = torch.cuda.Event()
            self.download_pending = False
            self._capture()

    # graph mode ----------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._upload([], [], size)
            rows, temps = self.buffers["rows"][:size], self.buffers["temps"][:size]
            self.model.forward(rows, temps, None)  # warm-up
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[size] = self.model.forward(rows, temps, None)
            self.graphs[size] = g

    def _upload(self, rows: list[list[int]], temps: list[float], size: int) -> None:
        """Write rows plus padding rows up to `size` into the static inputs (current stream)."""
        pad = size - len(rows)
        host_rows = torch.tensor(rows + [PAD_ROW] * pad, dtype=torch.int64)
        host_temps = torch.tensor(temps + [1.0] * pad, dtype=torch.float32)
        self.buffers["rows"][:size].copy_(host_rows)
        self.buffers["temps"][:size].copy_(host_temps)

    def _bucket(self, n: int) -> int:
        return next(s for s in SPEC.capture_sizes if s >= n)

    def replay(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        largest = SPEC.capture_sizes[-1]
        k = -(-n // largest)  # micro-batches
        per = -(-n // k)  # rows per micro-batch: every micro-batch fits one graph
        size = self._bucket(per)
        main = torch.cuda.current_stream()
        all_rows, all_temps = [], []
        for r in batch.requests:
            rr, tt = _request_rows(r)
            all_rows += rr
            all_temps += tt
        logits = torch.empty(n, SPEC.vocab_size, device=self.device)
        host_ids = torch.empty(n, dtype=torch.int64, pin_memory=True)
        static_logits, static_ids = self.outputs[size]
        for start in range(0, n, per):
            end = min(n, start + per)
            if self.war_wait and self.download_pending:
                # WAR: the replay rewrites static_ids, which the last download may still read.
                main.wait_event(self.downloaded)
            self._upload(all_rows[start:end], all_temps[start:end], size)
            self.graphs[size].replay()
            logits[start:end].copy_(static_logits[: end - start])
            self.replayed.record(main)
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.replayed)
                host_ids[start:end].copy_(static_ids[: end - start], non_blocking=True)
                self.downloaded.record(self.copy_stream)
            self.download_pending = True
        self.downloaded.synchronize()  # host result complete before step() returns
        reason = None if k == 1 else f"{k} micro-batches of {per} on one graph"
        return StepResult(logits, host_ids, "full", ("decode", size), reason=reason)

    # both modes ----------------------------------------------------------------------------------

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens):
            return "a request with more than one query token"
        return None

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        rows, temps, last = [], [], []
        for r in batch.requests:
            rr, tt = _request_rows(r)
            rows += rr
            temps += tt
            last.append(len(rows) - 1)
        if not rows:
            empty = torch.empty(0, SPEC.vocab_size, device=self.device)
            return StepResult(
                empty,
                torch.empty(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason=reason,
            )
        d_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        d_temps = torch.tensor(temps, dtype=torch.float32, device=self.device)
        d_last = torch.tensor(last, dtype=torch.int64, device=self.device)
        logits, ids = self.model.forward(d_rows, d_temps, d_last)
        return StepResult(logits, ids, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.model.k_cache, "v": self.model.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        if self.mode == "graph":
            torch.cuda.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> AsyncDownloadRunner:
    return AsyncDownloadRunner(mode, seed=seed)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> AsyncDownloadRunner:
    return AsyncDownloadRunner(mode, seed=seed, war_wait=False)
