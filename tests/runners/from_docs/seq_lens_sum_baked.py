"""An SGLang-style decode runner over plain `torch.cuda`, written with the idioms real engines use.

The runner (`SglStyleRunner`) is shaped like SGLang's `CudaGraphRunner` driving a torch-native,
FlashInfer/Triton-style attention backend:

* A two-layer bf16 decoder (GQA attention with rotary on the fly, RMSNorm, SiLU-gated MLP), no
  torch.compile; logits come back as float32.
* Attention metadata is rebuilt on the device every step from int32 tensors: `kv_indptr =
  F.pad(cumsum(seq_lens, dtype=int32), (1, 0))`, a flattened token-level `kv_indices` buffer
  (SGLang's `req_to_token` layout) built with `searchsorted` + `gather` from the block tables,
  `repeat_interleave(..., output_size=...)` mapping query tokens to requests, index arithmetic in
  int32 then `.long()` to index.
* The length of the flattened `kv_indices` is `kv_total`: in eager mode it is the batch's
  `seq_lens_sum` (a Python int), as SGLang's triton backend sizes it; a captured graph instead
  uses the static maximum (`size * max_context`), the tail belonging to an extra padding "row".
* Static inputs are allocated once at the largest capture size; host rows are written through a
  numpy view of a pinned int32 tensor and uploaded with `copy_(torch.from_numpy(...),
  non_blocking=True)`; seeds and temperatures go through
  `torch.tensor(..., device="cpu", pin_memory=True).to("cuda", non_blocking=True)`.
* Work runs on a high-priority side stream (`torch.cuda.Stream(priority=-1)`, made current with
  `torch.cuda.set_stream`), which waits for the caller's stream and is waited for by it.
* Graphs are captured for capture sizes largest first, into one pool, on that stream, under
  `torch.no_grad()`. Padding rows use SGLang's `seq_len_fill_value` (1) and
  point at the null block.
* Graphs are keyed by (query length, padded size): decode (1) and EAGLE-style target verify (2).
* Sampling is in the graph: top-k (`topk` + `scatter_`) then Gumbel-max with noise hashed from
  (seed, position, token id). Tokens come back through a non_blocking copy into pinned host memory
  waited on with an event (SGLang's overlap-scheduler `copy_done`); replays are timed with
  `Event(enable_timing=True)`.

Bug (`make_buggy_target`): the captured forward receives `kv_total = seq_lens_sum` computed on the
host from the batch, like the eager path, instead of the static maximum. The Python int is baked
into the graph at capture (where every row is padding with seq_len 1, so it is `size`): on replay
the flattened `kv_indices` only holds the first `size` entries and longer contexts read clamped,
wrong slots. Modelled on SGLang's `seq_lens_sum` handling in the cuda-graph runner,
https://github.com/sgl-project/sglang/pull/1789 ("Fix seq_lens_sum for cuda graph runner in
padded cases": the host sum sized the attention indices wrongly for padded graphs).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 64, 4, 2, 16, 128, 2
NULL_BLOCK = 0
SEQ_LEN_FILL_VALUE = 1  # SGLang pads graph rows with this sequence length
DTYPE = torch.bfloat16

SPEC = TargetSpec(
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=NULL_BLOCK,
)
MAX_CTX = SPEC.max_blocks_per_req * SPEC.block_size
MAX_BS = max(SPEC.capture_sizes)
GRAPH_QUERY_LENS = (1, 2)  # decode, and target-verify with one draft token (EAGLE style)
TOP_K = 16


def _fold_seed(seed: int) -> int:
    return (seed ^ (seed >> 31) ^ (seed >> 62)) & 0x7FFFFFFF


class SglStyleRunner:
    def __init__(self, *, graphs: bool, seed: int, frozen_seq_lens_sum: bool = False) -> None:
        self.device = torch.device("cuda")
        self.frozen_seq_lens_sum = frozen_seq_lens_sum
        self.weights = self._make_weights()
        self.load_weights(seed)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.inv_freq = inv_freq.to(self.device)
        slots = SPEC.num_blocks * SPEC.block_size
        self.k_caches = [
            torch.zeros(slots, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
            for _ in range(LAYERS)
        ]
        self.v_caches = [
            torch.zeros(slots, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
            for _ in range(LAYERS)
        ]
        self.stream = torch.cuda.Stream(priority=-1)
        # static inputs at the largest capture size (SGLang's CudaGraphRunner buffers)
        max_tok = SPEC.max_num_tokens
        self.input_ids = torch.zeros(max_tok, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(max_tok, dtype=torch.int64, device=self.device)
        self.out_cache_loc = torch.zeros(max_tok, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.full(
            (MAX_BS,), SEQ_LEN_FILL_VALUE, dtype=torch.int32, device=self.device
        )
        self.block_tables = torch.zeros(
            MAX_BS, SPEC.max_blocks_per_req, dtype=torch.int32, device=self.device
        )
        self.seeds = torch.full((MAX_BS,), -1, dtype=torch.int64, device=self.device)
        self.temps = torch.ones(MAX_BS, dtype=torch.float32, device=self.device)
        # raw int32 rows uploaded from pinned, numpy-backed staging
        self.tok_pinned = torch.zeros(max_tok, 3, dtype=torch.int32, pin_memory=True)
        self.req_pinned = torch.zeros(
            MAX_BS, 1 + SPEC.max_blocks_per_req, dtype=torch.int32, pin_memory=True
        )
        self.tok_np, self.req_np = self.tok_pinned.numpy(), self.req_pinned.numpy()
        self.raw_tok = torch.zeros(max_tok, 3, dtype=torch.int32, device=self.device)
        self.raw_req = torch.zeros(
            MAX_BS, 1 + SPEC.max_blocks_per_req, dtype=torch.int32, device=self.device
        )
        self.staged = torch.cuda.Event(blocking=True)
        self.copy_done = torch.cuda.Event()
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.last_replay_ms = 0.0
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        if graphs:
            with torch.no_grad():
                self.capture()

    # -- weights ------------------------------------------------------------------------------
    def _make_weights(self) -> dict[str, Tensor]:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "final_norm": (HIDDEN,),
            "lm_head": (SPEC.vocab_size, HIDDEN),
        }
        qkv = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
        for i in range(LAYERS):
            shapes |= {
                f"{i}.in_norm": (HIDDEN,),
                f"{i}.qkv": (qkv, HIDDEN),
                f"{i}.o": (Q_HEADS, HEAD_DIM, HIDDEN),
                f"{i}.post_norm": (HIDDEN,),
                f"{i}.gate_up": (2 * INTER, HIDDEN),
                f"{i}.down": (HIDDEN, INTER),
            }
        return {n: torch.empty(s, dtype=DTYPE, device="cuda") for n, s in shapes.items()}

    def load_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            w = self.weights[name]
            if name.endswith("norm"):
                fresh = 1.0 + 0.1 * torch.randn(w.shape, generator=gen)
            else:
                fresh = torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[-1])
            w.copy_(fresh.to(DTYPE).to(self.device))  # in place: graphs keep the address

    # -- metadata & model ---------------------------------------------------------------------
    def _metadata(
        self, qo_lens: Tensor, seq_lens: Tensor, tables: Tensor, kv_total: int, num_tokens: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """FlashInfer-style ragged metadata, all int32 on the device."""
        bs = seq_lens.shape[0]
        kv_indptr = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
        entry = torch.arange(kv_total, dtype=torch.int32, device=self.device)
        row = torch.searchsorted(kv_indptr[1:], entry, right=True)  # == bs past the last row
        row = row.to(torch.int32).clamp_(max=bs)
        indptr_ext = torch.cat([kv_indptr, kv_indptr[-1:]])
        pos_in_req = entry - torch.gather(indptr_ext, 0, row.long())
        null_row = torch.full(
            (1, tables.shape[1]), NULL_BLOCK, dtype=torch.int32, device=self.device
        )
        tables_ext = torch.cat([tables, null_row], 0)
        col = torch.div(pos_in_req, SPEC.block_size, rounding_mode="floor")
        col = col.clamp_(0, SPEC.max_blocks_per_req - 1)
        block = tables_ext.index_select(0, row.long()).gather(1, col.long().unsqueeze(1))
        slot = block.squeeze(1) * SPEC.block_size + pos_in_req % SPEC.block_size
        kv_indices = torch.where(row < bs, slot, NULL_BLOCK * SPEC.block_size)
        req_of_token = torch.repeat_interleave(
            torch.arange(bs, dtype=torch.int32, device=self.device), qo_lens, output_size=num_tokens
        )
        return kv_indptr, kv_indices, req_of_token

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, D/2]
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        x1, x2 = torch.chunk(x.float(), 2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def _attention(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        out_cache_loc: Tensor,
        ctx_slots: Tensor,
        visible: Tensor,
    ) -> Tensor:
        kc, vc = self.k_caches[layer], self.v_caches[layer]
        kc[out_cache_loc] = k  # write before read
        vc[out_cache_loc] = v
        t = q.shape[0]
        keys = kc[ctx_slots].float()  # [T, C, KV, D]
        values = vc[ctx_slots].float()
        mask4 = visible[:, :, None, None]
        keys = torch.where(mask4, keys, 0.0)  # masked slots may hold NaN
        values = torch.where(mask4, values, 0.0)
        group = Q_HEADS // KV_HEADS
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2).flatten(0, 1)  # [T*H, C, D]
        values = values.repeat_interleave(group, dim=2).transpose(1, 2).flatten(0, 1)
        bias = torch.zeros(t, Q_HEADS, 1, MAX_CTX, dtype=torch.float32, device=self.device)
        bias.masked_fill_(~visible[:, None, None, :], float("-inf"))
        qf = q.float().reshape(t * Q_HEADS, 1, HEAD_DIM)
        scores = torch.baddbmm(
            bias.flatten(0, 1), qf, keys.transpose(1, 2), alpha=1.0 / math.sqrt(HEAD_DIM)
        )
        out = torch.bmm(scores.softmax(-1), values)  # [T*H, 1, D]
        return out.view(t, Q_HEADS, HEAD_DIM).to(q.dtype)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        qo_lens: Tensor,
        seq_lens: Tensor,
        out_cache_loc: Tensor,
        tables: Tensor,
        seeds: Tensor,
        temps: Tensor,
        kv_total: int,
        num_tokens: int,
    ) -> tuple[Tensor, Tensor]:
        """All integer inputs int32 on the device. Returns float32 logits and tokens of each
        request's last query token."""
        w = self.weights
        kv_indptr, kv_indices, req_of_token = self._metadata(
            qo_lens, seq_lens, tables, kv_total, num_tokens
        )
        # dense per-token context slots read out of the flattened kv_indices
        ctx = torch.arange(MAX_CTX, dtype=torch.int32, device=self.device)
        visible = ctx.unsqueeze(0) <= positions.unsqueeze(1)  # [T, C]
        flat = kv_indptr.index_select(0, req_of_token.long()).unsqueeze(1) + ctx
        flat = torch.where(visible, flat, 0).clamp_(0, kv_indices.numel() - 1)
        ctx_slots = kv_indices[flat.long()]
        ctx_slots = ctx_slots.masked_fill_(~visible, NULL_BLOCK * SPEC.block_size).long()
        loc = out_cache_loc.long()

        h = F.embedding(tokens.long(), w["embed"])
        for i in range(LAYERS):
            x = F.rms_norm(h, (HIDDEN,), w[f"{i}.in_norm"], eps=1e-6)
            qkv = F.linear(x, w[f"{i}.qkv"])
            q, k, v = torch.split(
                qkv, [Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1
            )
            q = self._rope(q.unflatten(-1, (Q_HEADS, HEAD_DIM)), positions)
            k = self._rope(k.reshape(-1, KV_HEADS, HEAD_DIM), positions)
            v = v.reshape(-1, KV_HEADS, HEAD_DIM).contiguous()
            attn = self._attention(i, q, k, v, positions, loc, ctx_slots, visible)
            h = h + torch.einsum("thd,hdo->to", attn, w[f"{i}.o"])
            x = F.rms_norm(h, (HIDDEN,), w[f"{i}.post_norm"], eps=1e-6)
            gate, up = torch.chunk(F.linear(x, w[f"{i}.gate_up"]), 2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w[f"{i}.down"])
        cu_qo = F.pad(torch.cumsum(qo_lens, 0, dtype=torch.int32), (1, 0))
        last = (cu_qo[1:] - 1).long()
        h_last = F.rms_norm(h.index_select(0, last), (HIDDEN,), w["final_norm"], eps=1e-6)
        logits = F.linear(h_last, w["lm_head"]).float()
        last_pos = positions.index_select(0, last).long()
        return logits, self._sample(logits, seeds, temps, last_pos)

    def _sample(self, logits: Tensor, seeds: Tensor, temps: Tensor, pos: Tensor) -> Tensor:
        """Gumbel-max with noise hashed from (seed, position, token id); seed < 0: greedy."""
        vocab = torch.arange(logits.shape[1], dtype=torch.int64, device=self.device)
        mask32 = 0xFFFFFFFF
        x = (
            seeds.clamp(min=0).unsqueeze(1) * 0x27D4EB2F
            + pos.unsqueeze(1) * 0x165667B1
            + vocab * 0x61C88647
        ) & mask32
        for mul in (0x7FEB352D, 0x846CA68B):
            x = ((x ^ (x >> 16)) * (mul & 0x7FFFFFFF)) & mask32
        x = x ^ (x >> 16)
        u = ((x >> 8).float() + 0.5) / float(1 << 24)
        gumbel = -torch.log(-torch.log(u))
        scaled = logits / temps.unsqueeze(1)
        top_vals, top_idx = torch.topk(scaled, TOP_K, dim=-1)
        filtered = torch.full_like(scaled, float("-inf")).scatter_(1, top_idx, top_vals)
        sampled = torch.argmax(filtered + gumbel, dim=-1)
        return torch.where(seeds >= 0, sampled, torch.argmax(logits, dim=-1))

    # -- graph mode ---------------------------------------------------------------------------
    def _graph_inputs(self, q: int, size: int, seq_lens_sum: int) -> tuple:
        t = size * q
        qo_lens = torch.full((size,), q, dtype=torch.int32, device=self.device)  # graph constant
        kv_total = seq_lens_sum if self.frozen_seq_lens_sum else size * MAX_CTX
        return (
            self.input_ids[:t],
            self.positions[:t],
            qo_lens,
            self.seq_lens[:size],
            self.out_cache_loc[:t],
            self.block_tables[:size],
            self.seeds[:size],
            self.temps[:size],
            kv_total,
            t,
        )

    def _reset_padding(self) -> None:
        """SGLang style: padding rows get seq_len_fill_value and point at the null block."""
        self.seq_lens.fill_(SEQ_LEN_FILL_VALUE)
        self.out_cache_loc.zero_()  # slot 0 = null block
        self.input_ids.zero_()
        self.positions.zero_()
        self.block_tables.fill_(NULL_BLOCK)
        self.seeds.fill_(-1)
        self.temps.fill_(1.0)

    def _stage_and_upload(
        self, toks: list[list[int]], reqs: list[list[int]], seeds: list[int], temps: list[float]
    ) -> None:
        """Runs on self.stream: pinned numpy staging -> raw int32 device rows -> static inputs."""
        self.staged.synchronize()  # the previous upload has read the pinned staging
        nt, nr = len(toks), len(reqs)
        self.tok_np[:nt] = np.asarray(toks, dtype=np.int32).reshape(nt, 3)
        self.req_np[:nr] = np.asarray(reqs, dtype=np.int32).reshape(nr, 1 + SPEC.max_blocks_per_req)
        self.raw_tok[:nt].copy_(torch.from_numpy(self.tok_np[:nt]), non_blocking=True)
        self.raw_req[:nr].copy_(torch.from_numpy(self.req_np[:nr]), non_blocking=True)
        s = torch.tensor(seeds, dtype=torch.int64, device="cpu", pin_memory=True)
        t = torch.tensor(temps, dtype=torch.float32, device="cpu", pin_memory=True)
        self.staged.record()
        self._reset_padding()
        cols = self.raw_tok[:nt].transpose(0, 1)  # [3, nt] int32
        self.input_ids[:nt].copy_(cols[0])
        self.positions[:nt].copy_(cols[1])
        self.out_cache_loc[:nt].copy_(cols[2])
        self.seq_lens[:nr].copy_(self.raw_req[:nr, 0])
        self.block_tables[:nr].copy_(self.raw_req[:nr, 1:])
        self.seeds[:nr].copy_(s.to("cuda", non_blocking=True))
        self.temps[:nr].copy_(t.to("cuda", non_blocking=True))

    def capture(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        assert free > 0 and total > 0
        pool = torch.cuda.graph_pool_handle()
        caller = torch.cuda.current_stream()
        for q in sorted(GRAPH_QUERY_LENS, reverse=True):
            for size in sorted(SPEC.capture_sizes, reverse=True):
                if size * q > SPEC.max_num_tokens:
                    continue
                seq_lens_sum = size * SEQ_LEN_FILL_VALUE
                self.stream.wait_stream(caller)
                torch.cuda.set_stream(self.stream)
                try:
                    self._stage_and_upload([], [], [], [])
                    for _ in range(2):  # warm-up, as SGLang does
                        self.forward(*self._graph_inputs(q, size, seq_lens_sum))
                    torch.cuda.current_stream().synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                        out = self.forward(*self._graph_inputs(q, size, seq_lens_sum))
                    self.outputs[(q, size)] = out
                    self.graphs[(q, size)] = graph
                finally:
                    torch.cuda.set_stream(caller)
                caller.wait_stream(self.stream)
        torch.cuda.synchronize()

    def graph_key(self, q: int, n: int) -> tuple[int, int] | None:
        size = next((s for s in SPEC.capture_sizes if s >= n), None)
        return None if size is None or (q, size) not in self.graphs else (q, size)

    def replay(
        self,
        key: tuple[int, int],
        toks: list[list[int]],
        reqs: list[list[int]],
        seeds: list[int],
        temps: list[float],
    ) -> tuple[Tensor, Tensor]:
        n = len(reqs)
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        torch.cuda.set_stream(self.stream)
        try:
            self._stage_and_upload(toks, reqs, seeds, temps)
            self.start.record()
            self.graphs[key].replay()
            self.end.record()
        finally:
            torch.cuda.set_stream(caller)
        caller.wait_stream(self.stream)
        logits, tokens = self.outputs[key]
        # SGLang overlap style: tokens go to pinned host memory; wait for that copy only
        host_tokens = tokens[:n].to("cpu", non_blocking=True)
        self.copy_done.record()
        self.copy_done.synchronize()
        self.last_replay_ms = self.start.elapsed_time(self.end)
        return logits[:n].clone(), host_tokens  # cloned on the caller's stream

    def eager(
        self,
        toks: list[list[int]],
        qo_lens: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        seeds: list[int],
        temps: list[float],
    ) -> tuple[Tensor, Tensor]:
        def up(values: list, dtype: torch.dtype) -> Tensor:
            host = torch.tensor(values, dtype=dtype, device="cpu", pin_memory=True)
            return host.to("cuda", non_blocking=True)

        cols = up(toks, torch.int32)  # [T, 3]: token, position, out_cache_loc
        return self.forward(
            cols[:, 0],
            cols[:, 1],
            up(qo_lens, torch.int32),
            up(seq_lens, torch.int32),
            cols[:, 2],
            up(tables, torch.int32),
            up(seeds, torch.int64),
            up(temps, torch.float32),
            kv_total=sum(seq_lens),
            num_tokens=len(toks),
        )

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


class SglTarget:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, buggy: bool) -> None:
        self.spec = SPEC
        self.mode = mode
        self.runner = SglStyleRunner(graphs=mode == "graph", seed=seed, frozen_seq_lens_sum=buggy)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.context_len == 0 for r in batch.requests):
            return "prefill in the batch"
        if not batch.uniform or batch.query_lens[0] not in GRAPH_QUERY_LENS:
            return f"query lengths {sorted(set(batch.query_lens))} have no graph"
        if self.runner.graph_key(batch.query_lens[0], batch.num_reqs) is None:
            return "no graph for this many requests and tokens"
        return None

    @staticmethod
    def _table(block_ids: Sequence[int]) -> list[int]:
        return list(block_ids) + [NULL_BLOCK] * (SPEC.max_blocks_per_req - len(block_ids))

    def step(self, batch: Batch) -> StepResult:
        seeds = [-1 if r.seed is None else _fold_seed(r.seed) for r in batch.requests]
        temps = [float(r.temperature) for r in batch.requests]
        toks = [
            [tok, r.context_len + i, kv_slot(r.block_ids, r.context_len + i, SPEC.block_size)]
            for r in batch.requests
            for i, tok in enumerate(r.tokens)
        ]
        reason = self.fallback_reason(batch)
        with torch.no_grad():
            if reason is None:
                key = self.runner.graph_key(batch.query_lens[0], batch.num_reqs)
                reqs = [[r.seq_len, *self._table(r.block_ids)] for r in batch.requests]
                logits, tokens = self.runner.replay(key, toks, reqs, seeds, temps)
                return StepResult(logits, tokens, "full", key)
            if batch.num_reqs == 0:
                return StepResult(
                    torch.empty(0, SPEC.vocab_size, device="cuda"),
                    torch.empty(0, dtype=torch.int64, device="cuda"),
                    "eager",
                    None,
                    reason=reason,
                )
            logits, tokens = self.runner.eager(
                toks,
                list(batch.query_lens),
                [r.seq_len for r in batch.requests],
                [self._table(r.block_ids) for r in batch.requests],
                seeds,
                temps,
            )
            return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        out = {}
        for i in range(LAYERS):
            out[f"k{i}"] = self.runner.k_caches[i]
            out[f"v{i}"] = self.runner.v_caches[i]
        return out

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode == "eager":
            return {}
        r = self.runner
        return {
            "input_ids": r.input_ids,
            "positions": r.positions,
            "out_cache_loc": r.out_cache_loc,
            "seq_lens": r.seq_lens,
            "block_tables": r.block_tables,
            "seeds": r.seeds,
            "temps": r.temps,
            "raw_tok": r.raw_tok,
            "raw_req": r.raw_req,
        }

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.load_weights(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SglTarget:
    return SglTarget(mode, seed=seed, buggy=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SglTarget:
    return SglTarget(mode, seed=seed, buggy=True)
