"""A plain `torch.cuda` decode-graph runner whose graph runs on a forward thread, as overlap
schedulers do.

Written against `torch.cuda` only (the sim's drop-in makes it run on the CPU) and the target
contract. A one-layer decoder over a slot-major paged KV cache, counter-based sampling inside the
graph. Graph mode captures one decode graph per capture size (largest first, one shared pool). The
scheduling thread (the caller of `step`) writes a step's inputs into pinned staging buffers and
uploads them with non_blocking copies on its own stream, then hands the step to a forward thread,
which replays the graph on a forward stream, downloads the sampled ids into pinned memory and
waits for them, as engines that overlap the next batch's scheduling with the current forward do.

`make_buggy_target`'s forward stream does not wait for the scheduling stream's uploads (the
cross-stream ordering an overlap scheduler must add by hand): a replay may read the previous
step's inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec

SPEC = TargetSpec(
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=128,
    max_num_reqs=10,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
HIDDEN, HEADS, HEAD_DIM = 48, 3, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
M32 = 0xFFFFFFFF
# int columns of one input row: token, position, slot, seed, sampled flag, then the block table
TOK, POS, SLOT, SEED, FLAG, TABLE = 0, 1, 2, 3, 4, 5
WIDTH = TABLE + SPEC.max_blocks_per_req


# -- the model ----------------------------------------------------------------------------------


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes = {
            "wte": (SPEC.vocab_size, HIDDEN),
            "wpe": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "w1": (HIDDEN, 2 * HIDDEN),
            "w2": (2 * HIDDEN, HIDDEN),
            "lm": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        """In place, so captured graphs read the new weights."""
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_(
                (torch.randn(t.shape, generator=gen) * (1.5 / math.sqrt(t.shape[0]))).to(t.device)
            )

    def forward(
        self, ints: Tensor, temps: Tensor, k_cache: Tensor, v_cache: Tensor, last: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """ints: [T, WIDTH] one row per query token; temps: [R]; last: [R] rows to read (None: all)."""
        w = self.w
        pos = ints[:, POS]
        x = w["wte"][ints[:, TOK]] + w["wpe"][pos]
        h = norm(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, ints[:, SLOT], k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, ints[:, SLOT], v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        slots = (ints[:, TABLE:, None] * bs + torch.arange(bs, device=x.device)).flatten(1)
        keys, vals = k_cache[slots], v_cache[slots]  # [T, CONTEXT, H, D]
        seen = torch.arange(CONTEXT, device=x.device)[None, :] <= pos[:, None]  # [T, CONTEXT]
        att = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
        att = att.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        vals = torch.where(seen[:, :, None, None], vals, torch.zeros((), device=x.device))
        x = x + torch.einsum("thc,tchd->thd", att, vals).reshape(-1, HIDDEN) @ w["wo"]
        x = x + torch.relu(norm(x) @ w["w1"]) @ w["w2"]
        rows = ints if last is None else ints[last]
        if last is not None:
            x = x[last]
        logits = norm(x) @ w["lm"]
        return logits, pick(logits, rows, temps)


def norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & M32
    return x ^ (x >> 15)


def pick(logits: Tensor, rows: Tensor, temps: Tensor) -> Tensor:
    """Greedy, or Gumbel-max with noise hashed from (seed, position, token id)."""
    key = hash32(hash32(rows[:, SEED]) ^ ((rows[:, POS] * 0x632BE5AB) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = hash32(key[:, None] ^ ((ids * 0x7FEB352D) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(rows[:, FLAG] != 0, noisy.argmax(-1), logits.argmax(-1))


# -- host side ------------------------------------------------------------------------------------


def token_rows(r: Request) -> list[list[int]]:
    table = list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
    sampled = r.seed is not None
    seed = (r.seed & M32) if sampled else 0
    out = []
    for i, tok in enumerate(r.tokens):
        p = r.context_len + i
        slot = r.block_ids[p // SPEC.block_size] * SPEC.block_size + p % SPEC.block_size
        out.append([tok, p, slot, seed, int(sampled), *table])
    return out


def temperature(r: Request) -> float:
    return float(r.temperature) if r.seed is not None else 1.0


PAD_ROW = [0, 0, NULL_SLOT, 0, 0] + [SPEC.null_block] * SPEC.max_blocks_per_req


class Runner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, wait_for_uploads: bool
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.wait_for_uploads = wait_for_uploads
        self.device = torch.device("cuda")
        self.model = Model(seed, self.device)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        self.forward_thread: ThreadPoolExecutor | None = None
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            self.buffers = {
                "ints": torch.zeros(rows, WIDTH, dtype=torch.int64, device=self.device),
                "temps": torch.ones(rows, device=self.device),
            }
            self.staging = {
                "ints": torch.zeros(rows, WIDTH, dtype=torch.int64, pin_memory=True),
                "temps": torch.ones(rows, pin_memory=True),
            }
            self.host_tokens = torch.zeros(rows, dtype=torch.int64, pin_memory=True)
            self.forward_stream = torch.cuda.Stream()
            self.uploaded = torch.cuda.Event()
            self.forward_thread = ThreadPoolExecutor(1, thread_name_prefix="forward")
            self.capture()

    # -- graphs -------------------------------------------------------------------------------------

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.write_inputs([], size)
            ints, temps = self.buffers["ints"][:size], self.buffers["temps"][:size]
            self.model.forward(ints, temps, self.k_cache, self.v_cache, None)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model.forward(
                    ints, temps, self.k_cache, self.v_cache, None
                )
            self.graphs[size] = graph

    def write_inputs(self, requests: Sequence[Request], size: int) -> None:
        """Every row of the graph's inputs, valid or padding, staged and uploaded before each
        replay, on the current stream."""
        rows = [token_rows(r)[0] for r in requests] + [PAD_ROW] * (size - len(requests))
        temps = [temperature(r) for r in requests] + [1.0] * (size - len(requests))
        self.staging["ints"][:size].copy_(torch.tensor(rows, dtype=torch.int64))
        self.staging["temps"][:size].copy_(torch.tensor(temps, dtype=torch.float32))
        for name in ("ints", "temps"):
            self.buffers[name][:size].copy_(self.staging[name][:size], non_blocking=True)

    def replay(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        size = next(s for s in SPEC.capture_sizes if s >= n)
        self.write_inputs(batch.requests, size)
        self.uploaded.record()
        assert self.forward_thread is not None
        logits, tokens = self.forward_thread.submit(self.forward, size, n).result()
        return StepResult(logits, tokens, "full", ("decode", size))

    def forward(self, size: int, n: int) -> tuple[Tensor, Tensor]:
        """On the forward thread: the replay on the forward stream, the sampled ids downloaded."""
        torch.cuda.set_stream(self.forward_stream)
        if self.wait_for_uploads:
            self.forward_stream.wait_event(self.uploaded)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        kept = logits[:n].clone()
        self.host_tokens[:n].copy_(tokens[:n], non_blocking=True)
        downloaded = torch.cuda.Event()
        downloaded.record()
        downloaded.synchronize()
        return kept, self.host_tokens[:n].clone()

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "above the largest capture size"
        return None

    # -- eager ----------------------------------------------------------------------------------------

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        rows: list[list[int]] = []
        last: list[int] = []
        for r in batch.requests:
            rows.extend(token_rows(r))
            last.append(len(rows) - 1)
        ints = torch.tensor(rows, dtype=torch.int64, device=self.device).view(-1, WIDTH)
        temps = torch.tensor([temperature(r) for r in batch.requests], device=self.device)
        index = torch.tensor(last, dtype=torch.int64, device=self.device)
        logits, tokens = self.model.forward(ints, temps, self.k_cache, self.v_cache, index)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    # -- contract ---------------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        if self.forward_thread is not None:
            self.forward_thread.shutdown()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, wait_for_uploads=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Runner:
    return Runner(mode, seed=seed, wait_for_uploads=False)
