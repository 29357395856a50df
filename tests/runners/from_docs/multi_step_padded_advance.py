"""A multi-step decode runner: between graph replays the inputs are advanced on the device.

What it is: a one-layer decoder (token embedding plus learned positions, attention over a
slot-major paged KV cache read through block tables, a SiLU MLP, an LM head) in float32, written
against the backend facade (`pytest_graphmode.runtime.backends.get`). Decode batches of one query
token per request run in multi-step windows of up to `NUM_STEPS` steps, as vLLM's old multi-step
scheduling did: the window's first step prepares every row on the host (positions, sequence
lengths, slot mapping; graph padding rows get position 0, sequence length 1 and the null slot);
each following step whose batch continues the last one (same requests in the same rows, each one
position further, its blocks extended) leaves positions, sequence lengths and slots on the device
and advances them there (`seq_len += 1`, `position = seq_len - 1`, the slot looked up in the
device block table), with no host round trip for them. The step's tokens, sampling values and
block table (the scheduler's lookahead blocks) are still written from the batch: the harness's
tokens are authoritative, where vLLM fed back its own samples. The host staging of the block table
is a persistent array whose rows the runner writes for the batch's requests only; the padding rows
keep what an earlier, larger batch left there, as vLLM's `graph_block_tables` did: a padding row's
slot is pinned to the null slot and its one visible context slot is masked out of nothing that is
returned, so the table row is never used for a write. Graph mode pads a window's rows to a capture
size (1, 2, 4) and replays one graph per size, captured at start-up (all-padding warm-up, then
capture, largest first, one shared pool); eager mode runs the same windows and advance, unpadded
and eagerly. Prefill, mixed, speculative and oversized batches run eagerly from host-built inputs
and end the window.

Correct runner (`make_target`): the advance touches the batch's rows only (vLLM's `num_queries`);
padding rows keep the null slot the window's first step gave them.

Buggy runner (`make_buggy_target`), exactly one bug: the advance runs over every row of the
graph, padding included (vLLM's padded `num_seqs`, as the first advance-step kernel did): a
padding row's sequence length and position grow and its slot is looked up in its stale block
table row, so from the window's second step on each padded replay stores the padding row's keys
and values in a block of whichever request last held that row: a departed request's block, or a
live request's context slot. Eager mode has no padding rows, so it never shows.

Modelled on: vLLM's `advance_step` kernel for GPU-side input preparation
(https://github.com/vllm-project/vllm/pull/6338), whose first version advanced all `num_seqs`
rows, and multi-step scheduling (https://github.com/vllm-project/vllm/pull/7000), where under
CUDA graphs `num_seqs` is the padded graph batch and `num_queries` the real requests: the kernel
advances only `cur_query_id < num_queries` and later also resets the padded rows' tokens,
positions and slot mapping (`PAD_SLOT_ID`) on every advance; the multi-step CUDA graph block
table fixes (https://github.com/vllm-project/vllm/pull/8340,
https://github.com/vllm-project/vllm/pull/8427) concern the same persistent
`graph_block_tables`. No code copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

VOCAB = 64
SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=VOCAB,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
BS = SPEC.block_size
MB = SPEC.max_blocks_per_req
CONTEXT = MB * BS
NULL = SPEC.null_block
NULL_SLOT = NULL * BS
NUM_STEPS = 4  # decode steps per multi-step window
ROWS = SPEC.max_num_reqs  # per-row buffers: the largest graph and the largest eager window
M32 = 0xFFFFFFFF


class Decoder:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (VOCAB, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, VOCAB),
        }
        self.device = device
        self.w = {n: torch.zeros(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            scale = 2.0 if name == "head" else 1.0
            t.copy_(
                (scale * torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(t.device)
            )

    def forward(self, x: Mapping[str, Tensor], k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """One row per query token: tokens, positions, slots, seq_lens [T], tables [T, MB]."""
        w = self.w
        dev = k_cache.device
        h0 = w["embed"][x["tokens"]] + w["pos"][x["positions"]]
        h = _norm(h0)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        k_cache.index_copy_(0, x["slots"], k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, x["slots"], v.view(-1, HEADS, HEAD_DIM))
        ctx = (x["tables"][:, :, None] * BS + torch.arange(BS, device=dev)).flatten(1)  # [T, C]
        seen = torch.arange(CONTEXT, device=dev)[None, :] < x["seq_lens"][:, None]
        keys = torch.where(seen[:, :, None, None], k_cache[ctx], torch.zeros((), device=dev))
        vals = torch.where(seen[:, :, None, None], v_cache[ctx], torch.zeros((), device=dev))
        s = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
        probs = s.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
        out = h0 + torch.einsum("thc,tchd->thd", probs, vals).flatten(1) @ w["wo"]
        out = out + torch.nn.functional.silu(_norm(out) @ w["up"]) @ w["down"]
        return _norm(out) @ w["head"]


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def sample(
    logits: Tensor, positions: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor
) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): nothing baked, no generator."""
    key = _hash(_hash(seeds) ^ ((positions * 0x27D4EB2F) & M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash(key[:, None] ^ ((ids * 0x165667B1) & M32)[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / temps[:, None] - torch.log(-torch.log(u))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _table_row(r: Request) -> list[int]:
    return list(r.block_ids) + [NULL] * (MB - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & M32, r.temperature, True


class MultiStepRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, advance_padding: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.advance_padding = advance_padding  # the bug: advance the graph's padded rows too
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.dev = dev
        self.model = Decoder(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        i64 = torch.int64
        # Inputs written from the batch at every multi-step step (all rows a replay reads).
        self.inputs = {
            "tokens": torch.zeros(ROWS, dtype=i64, device=dev),
            "tables": torch.full((ROWS, MB), NULL, dtype=i64, device=dev),
            "seeds": torch.zeros(ROWS, dtype=i64, device=dev),
            "temps": torch.ones(ROWS, device=dev),
            "sampled": torch.zeros(ROWS, dtype=torch.bool, device=dev),
        }
        # Carried on the device through a window and advanced there (per-row state of the
        # window: written by its first step, not by the host afterwards).
        self.carried = {
            "positions": torch.zeros(ROWS, dtype=i64, device=dev),
            "seq_lens": torch.ones(ROWS, dtype=i64, device=dev),
            "slots": torch.full((ROWS,), NULL_SLOT, dtype=i64, device=dev),
        }
        # Host staging of the block table: rows written for the batch's requests only.
        self.table_host = torch.full((ROWS, MB), NULL, dtype=i64)
        self.window: tuple[tuple[Request, ...], int, int] | None = None  # (requests, rows, steps)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            with torch.inference_mode():
                self._capture()

    # -- graphs -----------------------------------------------------------------------------------

    def _views(self, rows: int) -> dict[str, Tensor]:
        return {n: b[:rows] for n, b in {**self.inputs, **self.carried}.items()}

    def _run(self, x: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(x, self.k_cache, self.v_cache)
        tokens = sample(logits, x["positions"], x["seeds"], x["temps"], x["sampled"])
        return logits, tokens

    def _capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._pad_rows(0, size)
            x = self._views(size)
            self._run(x)  # warm-up: every row is padding and writes the null slot
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self._run(x)
            self.graphs[size] = graph

    def _pad_rows(self, n: int, size: int) -> None:
        if size <= n:
            return
        self.inputs["tokens"][n:size].fill_(0)
        self.inputs["seeds"][n:size].fill_(0)
        self.inputs["temps"][n:size].fill_(1.0)
        self.inputs["sampled"][n:size].fill_(False)
        self.carried["positions"][n:size].fill_(0)
        self.carried["seq_lens"][n:size].fill_(1)
        self.carried["slots"][n:size].fill_(NULL_SLOT)

    # -- the multi-step window --------------------------------------------------------------------

    def _rows(self, batch: Batch) -> int:
        n = batch.num_reqs
        if self.mode == "eager":
            return n
        return next(s for s in SPEC.capture_sizes if s >= n)

    def _continues(self, batch: Batch, rows: int) -> bool:
        if self.window is None:
            return False
        last, last_rows, steps = self.window
        if steps >= NUM_STEPS or rows != last_rows or len(last) != batch.num_reqs:
            return False
        for r, p in zip(batch.requests, last, strict=True):
            if r.req_id != p.req_id or r.context_len != p.seq_len:
                return False
            if r.block_ids[: len(p.block_ids)] != p.block_ids:
                return False
        return True

    def _write_batch_inputs(self, batch: Batch, rows: int) -> None:
        """Tokens, sampling values and the block table, from the batch (every step)."""
        n = batch.num_reqs
        dev = self.dev
        for i, r in enumerate(batch.requests):
            self.table_host[i] = torch.tensor(_table_row(r), dtype=torch.int64)
        samp = [_sampling(r) for r in batch.requests]
        self.inputs["tokens"][:n].copy_(
            torch.tensor([r.tokens[0] for r in batch.requests], dtype=torch.int64).to(dev)
        )
        self.inputs["seeds"][:n].copy_(
            torch.tensor([s[0] for s in samp], dtype=torch.int64).to(dev)
        )
        self.inputs["temps"][:n].copy_(
            torch.tensor([s[1] for s in samp], dtype=torch.float32).to(dev)
        )
        self.inputs["sampled"][:n].copy_(
            torch.tensor([s[2] for s in samp], dtype=torch.bool).to(dev)
        )
        # The whole table of the graph's rows goes up: the padding rows as the staging holds them.
        self.inputs["tables"][:rows].copy_(self.table_host[:rows].to(dev))
        if rows > n:
            self.inputs["tokens"][n:rows].fill_(0)
            self.inputs["seeds"][n:rows].fill_(0)
            self.inputs["temps"][n:rows].fill_(1.0)
            self.inputs["sampled"][n:rows].fill_(False)

    def _prepare_window(self, batch: Batch, rows: int) -> None:
        """The window's first step: positions, lengths and slots from the host."""
        n = batch.num_reqs
        dev = self.dev
        reqs = batch.requests
        self.carried["positions"][:n].copy_(
            torch.tensor([r.context_len for r in reqs], dtype=torch.int64).to(dev)
        )
        self.carried["seq_lens"][:n].copy_(
            torch.tensor([r.seq_len for r in reqs], dtype=torch.int64).to(dev)
        )
        self.carried["slots"][:n].copy_(
            torch.tensor(
                [kv_slot(r.block_ids, r.context_len, BS) for r in reqs], dtype=torch.int64
            ).to(dev)
        )
        if rows > n:
            self.carried["positions"][n:rows].fill_(0)
            self.carried["seq_lens"][n:rows].fill_(1)
            self.carried["slots"][n:rows].fill_(NULL_SLOT)

    def _advance(self, n: int, rows: int) -> None:
        """On the device: one position further for each advanced row, its slot from the table."""
        end = rows if self.advance_padding else n
        seq = self.carried["seq_lens"][:end] + 1
        pos = seq - 1
        table = self.inputs["tables"][:end]
        block = table.gather(1, (pos // BS)[:, None]).squeeze(1)
        self.carried["seq_lens"][:end].copy_(seq)
        self.carried["positions"][:end].copy_(pos)
        self.carried["slots"][:end].copy_(block * BS + pos % BS)

    def _multi_step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        rows = self._rows(batch)
        go_on = self._continues(batch, rows)
        self._write_batch_inputs(batch, rows)
        if go_on:
            self._advance(n, rows)
            assert self.window is not None
            steps = self.window[2] + 1
        else:
            self._prepare_window(batch, rows)
            steps = 1
        self.window = (batch.requests, rows, steps)
        how = "advanced on the device" if go_on else "window start, prepared on the host"
        if self.mode == "graph":
            self.graphs[rows].replay()
            logits, tokens = self.outputs[rows]
            return StepResult(
                logits[:n].clone(), tokens[:n].clone(), "full", ("decode", rows), reason=how
            )
        logits, tokens = self._run(self._views(n))
        return StepResult(logits, tokens, "eager", None, reason=f"eager twin, {how}")

    # -- everything else, eagerly from the host -----------------------------------------------------

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        self.window = None
        cols: dict[str, list[Any]] = {
            n: [] for n in ("tokens", "positions", "slots", "seq_lens", "tables")
        }
        last: list[int] = []
        samp: list[tuple[int, float, bool]] = []
        for r in batch.requests:
            for pos in range(r.context_len, r.seq_len):
                cols["tokens"].append(r.tokens[pos - r.context_len])
                cols["positions"].append(pos)
                cols["slots"].append(kv_slot(r.block_ids, pos, BS))
                cols["seq_lens"].append(pos + 1)
                cols["tables"].append(_table_row(r))
            last.append(len(cols["tokens"]) - 1)
            samp.append(_sampling(r))
        dev = self.dev
        x = {n: torch.tensor(v, dtype=torch.int64).to(dev) for n, v in cols.items()}
        x["tables"] = x["tables"].view(-1, MB)
        logits = self.model.forward(x, self.k_cache, self.v_cache)
        idx = torch.tensor(last, dtype=torch.int64).to(dev)
        logits = logits[idx]
        tokens = sample(
            logits,
            x["positions"][idx],
            torch.tensor([s[0] for s in samp], dtype=torch.int64).to(dev),
            torch.tensor([s[1] for s in samp], dtype=torch.float32).to(dev),
            torch.tensor([s[2] for s in samp], dtype=torch.bool).to(dev),
        )
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def _fallback(self, batch: Batch) -> str | None:
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.query_len != 1 or r.context_len == 0 for r in batch.requests):
            return "not a one-token decode batch"
        if self.mode == "graph" and batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    # -- the contract -----------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self._fallback(batch)
            return self._multi_step(batch) if reason is None else self._eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.inputs if self.mode == "graph" else {}

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
        self.window = None


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> MultiStepRunner:
    return MultiStepRunner(mode, seed=seed, backend=backend, advance_padding=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> MultiStepRunner:
    return MultiStepRunner(mode, seed=seed, backend=backend, advance_padding=True)
