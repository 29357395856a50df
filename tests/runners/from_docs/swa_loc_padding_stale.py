"""SGLang-style decode graphs for a hybrid sliding-window model, whose SWA write slots are padded.

Modelled on SGLang's `CudaGraphRunner` / `ForwardBatch` for hybrid-SWA models (Gemma, gpt-oss,
MiMo): one full-attention layer and one sliding-window layer, each with a KV pool of its own. A
`ForwardBatch` carries `req_pool_indices` (rows of a `req_to_token` table), `seq_lens`, the full
pool's write slots `out_cache_loc` and the SWA pool's `out_cache_loc_swa` (the full slots
translated through `full_to_swa`, once per forward). Graphs are captured per batch size, largest
first, into one pool; `replay_prepare` pads a batch up to the next captured size: `seq_lens`
filled with the backend's fill value (1), `req_pool_indices` and `out_cache_loc` zeroed (slot 0
is the reserved padding slot: the null block), then the batch copied into the prefix. The
attention backend's `init_forward_metadata_replay_cuda_graph` then gathers each row's page
indices out of `req_to_token` (and translates them for the SWA layer) into the graph's metadata
buffers. Anything but a batch of one-token queries, or a batch past the largest size, runs eager.

The bug (`make_buggy_target`): SGLang PR 23552 ("Pre-set SWA cache location in CudaGraphRunner",
https://github.com/sgl-project/sglang/pull/23552) added an `out_cache_loc_swa` buffer to the decode
graph's input buffers so the SWA layers' KV store takes its fast path inside the graph. Its replay
path copied the batch's SWA slots into the buffer's prefix, but the padding branch that zeroes
`out_cache_loc` never cleared `out_cache_loc_swa`. A padded replay's padding rows therefore store
their keys and values (NaN here: a padding row attends to the null slot) into whatever SWA slots
the buffer last held: a slot of a request from an earlier, larger batch, which may have finished,
sat out this step, or moved on to later positions. The SWA cache is silently corrupted, and
accuracy dropped on MiMo-V2.5-Pro; fixed by SGLang PR 24743 ("fix(cuda_graph): zero
out_cache_loc_swa on pad and use int32 (hybrid-SWA accuracy fix)",
https://github.com/sgl-project/sglang/pull/24743).

The contract needs slot-major state, so the SWA pool here is as large as the full pool and
`full_to_swa` is the identity: the bug lives in the second write-slot buffer, not in the mapping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
WINDOW = 5  # the sliding-window layer sees the last WINDOW positions
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size  # SGLang's reserved padding slot 0
POOL_ROWS = SPEC.max_num_reqs + 1  # req_to_token row 0 is the padding requests' row
SEQ_LEN_FILL_VALUE = 1  # what the attention backend asks padding rows' seq_lens to hold


@dataclass
class ForwardBatch:
    """One forward's device tensors. T tokens (bs for decode), R requests."""

    input_ids: Tensor  # [T]
    positions: Tensor  # [T]
    token_pool_rows: Tensor  # [T] req_to_token row of each token's request
    kv_lens: Tensor  # [T] keys a token sees (its position + 1; a decode row's seq_len)
    out_cache_loc: Tensor  # [T] full-pool slot each token writes
    out_cache_loc_swa: Tensor  # [T] SWA-pool slot each token writes
    last: Tensor | None = None  # [R] each request's last token; None for decode (T == R)


@dataclass
class AttnMetadata:
    kv_indices: Tensor  # [T, CONTEXT] full-pool slots of each token's context
    swa_kv_indices: Tensor  # [T, CONTEXT] the same, translated into the SWA pool


class Model:
    """Embedding + learned positions, a full-attention layer, a sliding-window layer, LM head."""

    LAYERS = (None, WINDOW)  # window per layer: layer 0 full, layer 1 SWA

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        for i in range(len(self.LAYERS)):
            shapes.update({f"{n}{i}": (HIDDEN, HIDDEN) for n in "qkvo"})
            shapes.update({f"up{i}": (HIDDEN, 2 * HIDDEN), f"down{i}": (2 * HIDDEN, HIDDEN)})
        self.weights = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):  # in place: captured graphs keep these tensors
            w = self.weights[name]
            w.copy_(
                (torch.randn(w.shape, generator=generator) / math.sqrt(w.shape[0])).to(w.device)
            )

    def forward(
        self, fb: ForwardBatch, meta: AttnMetadata, pools: Sequence[tuple[Tensor, Tensor]]
    ) -> Tensor:
        w = self.weights
        x = w["embed"][fb.input_ids] + w["pos"][fb.positions]
        for i, window in enumerate(self.LAYERS):
            k_pool, v_pool = pools[i]
            loc = fb.out_cache_loc if window is None else fb.out_cache_loc_swa
            indices = meta.kv_indices if window is None else meta.swa_kv_indices
            h = _rms(x)
            q, k, v = (h @ w[f"{n}{i}"] for n in "qkv")
            k_pool.index_copy_(0, loc, k.view(-1, HEADS, HEAD_DIM))  # set_kv_buffer
            v_pool.index_copy_(0, loc, v.view(-1, HEADS, HEAD_DIM))
            x = x + _attend(q, k_pool, v_pool, indices, fb.kv_lens, window) @ w[f"o{i}"]
            x = x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        if fb.last is not None:
            x = x[fb.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attend(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, indices: Tensor, kv_lens: Tensor, window: int | None
) -> Tensor:
    keys, values = k_pool[indices], v_pool[indices]  # [T, CONTEXT, heads, dim]
    j = torch.arange(CONTEXT, device=q.device)[None, :]
    visible = j < kv_lens[:, None]
    if window is not None:
        visible = visible & (j >= kv_lens[:, None] - window)
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


class AttnBackend:
    """Fixed-shape paged attention metadata, FlashInfer-backend style: eager steps build it fresh,
    graphs read it from buffers that `init_forward_metadata_replay_cuda_graph` rewrites."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.graph_meta: AttnMetadata | None = None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return SEQ_LEN_FILL_VALUE

    def _gather(self, pool_rows: Tensor) -> tuple[Tensor, Tensor]:
        kv_indices = self.runner.req_to_token[pool_rows]
        return kv_indices, self.runner.full_to_swa[kv_indices]

    def init_forward_metadata(self, fb: ForwardBatch) -> AttnMetadata:
        return AttnMetadata(*self._gather(fb.token_pool_rows))

    def init_cuda_graph_state(self, max_bs: int) -> None:
        device = self.runner.device
        self.graph_meta = AttnMetadata(
            torch.zeros(max_bs, CONTEXT, dtype=torch.int64, device=device),
            torch.zeros(max_bs, CONTEXT, dtype=torch.int64, device=device),
        )

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: Tensor
    ) -> AttnMetadata:
        assert self.graph_meta is not None
        kv_indices, swa_kv_indices = self._gather(req_pool_indices[:bs])
        self.graph_meta.kv_indices[:bs].copy_(kv_indices)
        self.graph_meta.swa_kv_indices[:bs].copy_(swa_kv_indices)
        return AttnMetadata(self.graph_meta.kv_indices[:bs], self.graph_meta.swa_kv_indices[:bs])

    # capture sees the same buffers the replay rewrites
    init_forward_metadata_capture_cuda_graph = init_forward_metadata_replay_cuda_graph


class CudaGraphRunner:
    """One decode graph per batch size; padding rows point at the reserved row and slot."""

    def __init__(self, runner: ModelRunner, *, zero_swa_loc_on_pad: bool) -> None:
        self.runner = runner
        self.zero_swa_loc_on_pad = zero_swa_loc_on_pad  # False: SGLang before PR 24743
        self.capture_bs = list(SPEC.capture_sizes)
        self.max_bs = self.capture_bs[-1]
        self.fill = runner.attn_backend.get_cuda_graph_seq_len_fill_value()
        device, i64 = runner.device, torch.int64
        n = self.max_bs
        self.buffers = {
            "input_ids": torch.zeros(n, dtype=i64, device=device),
            "positions": torch.zeros(n, dtype=i64, device=device),
            "req_pool_indices": torch.zeros(n, dtype=i64, device=device),
            "seq_lens": torch.full((n,), self.fill, dtype=torch.int32, device=device),
            "out_cache_loc": torch.zeros(n, dtype=i64, device=device),
            "out_cache_loc_swa": torch.zeros(n, dtype=i64, device=device),
        }
        runner.attn_backend.init_cuda_graph_state(n)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, Tensor] = {}
        self.capture()

    def static_batch(self, bs: int) -> ForwardBatch:
        b = self.buffers
        return ForwardBatch(
            b["input_ids"][:bs],
            b["positions"][:bs],
            b["req_pool_indices"][:bs],
            b["seq_lens"][:bs],
            b["out_cache_loc"][:bs],
            b["out_cache_loc_swa"][:bs],
        )

    def capture(self) -> None:
        backend = self.runner.backend
        pool = backend.graph_pool_handle()
        for bs in reversed(self.capture_bs):
            self.runner.write_req_to_token([])  # every row is a padding row during capture
            self.pad(0, bs)
            meta = self.runner.attn_backend.init_forward_metadata_capture_cuda_graph(
                bs, self.buffers["req_pool_indices"]
            )
            fb = self.static_batch(bs)
            self.runner.model.forward(fb, meta, self.runner.pools)  # warm-up
            backend.synchronize()
            graph = backend.Graph()
            with backend.graph(graph, pool=pool):
                self.outputs[bs] = self.runner.model.forward(fb, meta, self.runner.pools)
            self.graphs[bs] = graph

    def can_run(self, batch: Batch) -> bool:
        return 0 < batch.num_reqs <= self.max_bs and all(q == 1 for q in batch.query_lens)

    def pad(self, raw_bs: int, bs: int) -> None:
        """Reset the rows raw_bs..bs of a padded replay to the padding request's values."""
        if bs == raw_bs:
            return
        b = self.buffers
        b["seq_lens"].fill_(self.fill)
        b["out_cache_loc"].zero_()
        if self.zero_swa_loc_on_pad:  # the line PR 24743 added
            b["out_cache_loc_swa"].zero_()
        b["req_pool_indices"][raw_bs:bs].zero_()
        b["input_ids"][raw_bs:bs].zero_()
        b["positions"][raw_bs:bs].zero_()

    def replay_prepare(self, fb: ForwardBatch, raw_bs: int) -> int:
        bs = next(s for s in self.capture_bs if s >= raw_bs)
        self.pad(raw_bs, bs)
        b = self.buffers
        b["input_ids"][:raw_bs].copy_(fb.input_ids)
        b["positions"][:raw_bs].copy_(fb.positions)
        b["req_pool_indices"][:raw_bs].copy_(fb.token_pool_rows)
        b["seq_lens"][:raw_bs].copy_(fb.kv_lens)
        b["out_cache_loc"][:raw_bs].copy_(fb.out_cache_loc)
        b["out_cache_loc_swa"][:raw_bs].copy_(fb.out_cache_loc_swa)
        self.runner.attn_backend.init_forward_metadata_replay_cuda_graph(bs, b["req_pool_indices"])
        return bs

    def replay(self, fb: ForwardBatch, raw_bs: int) -> tuple[Tensor, int]:
        bs = self.replay_prepare(fb, raw_bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:raw_bs].clone(), bs

    def static_buffers(self) -> dict[str, Tensor]:
        meta = self.runner.attn_backend.graph_meta
        assert meta is not None
        return {
            **self.buffers,
            "kv_indices": meta.kv_indices,
            "swa_kv_indices": meta.swa_kv_indices,
            "req_to_token": self.runner.req_to_token,
        }

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


class ModelRunner:
    """The target: builds a ForwardBatch from the harness's batch, replays or runs eagerly."""

    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        zero_swa_loc_on_pad: bool = True,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.backend: Any = get_backend(backend)
        self.device = self.backend.device
        self.model = Model(seed, self.device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.pools = [
            (torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))
            for _ in Model.LAYERS
        ]  # [full pool, SWA pool]
        self.req_to_token = torch.zeros(POOL_ROWS, CONTEXT, dtype=torch.int64, device=self.device)
        self.full_to_swa = torch.arange(SPEC.num_slots, dtype=torch.int64, device=self.device)
        self.attn_backend = AttnBackend(self)
        self.graph_runner: CudaGraphRunner | None = None
        if mode == "graph":
            self.graph_runner = CudaGraphRunner(self, zero_swa_loc_on_pad=zero_swa_loc_on_pad)

    def write_req_to_token(self, batch_requests: Sequence[Any]) -> None:
        """Row 0 for padding (all null slots); row i + 1 for the batch's i-th request."""
        rows = [[NULL_SLOT] * CONTEXT]
        for r in batch_requests:
            rows.append(
                [
                    kv_slot(r.block_ids, p, SPEC.block_size) if p < r.seq_len else NULL_SLOT
                    for p in range(CONTEXT)
                ]
            )
        self.req_to_token[: len(rows)].copy_(torch.tensor(rows, dtype=torch.int64))

    def forward_batch(self, batch: Batch) -> ForwardBatch:
        ids, pos, rows, locs, last = [], [], [], [], []
        for i, r in enumerate(batch.requests):
            for k, token in enumerate(r.tokens):
                p = r.context_len + k
                ids.append(token)
                pos.append(p)
                rows.append(i + 1)
                locs.append(kv_slot(r.block_ids, p, SPEC.block_size))
            last.append(len(ids) - 1)

        def dev(values: list[int], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        out_cache_loc = dev(locs)
        positions = dev(pos)
        return ForwardBatch(
            input_ids=dev(ids),
            positions=positions,
            token_pool_rows=dev(rows),
            kv_lens=(positions + 1).to(torch.int32),
            out_cache_loc=out_cache_loc,
            out_cache_loc_swa=self.full_to_swa[out_cache_loc],  # translated once per forward
            last=dev(last),
        )

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
            self.write_req_to_token(batch.requests)
            fb = self.forward_batch(batch)
            gr = self.graph_runner
            if gr is not None and gr.can_run(batch):
                logits, bs = gr.replay(fb, batch.num_reqs)
                return StepResult(logits, logits.argmax(-1), "full", ("decode", bs))
            if gr is None:
                reason = "eager twin"
            elif batch.num_reqs > gr.max_bs:
                reason = "more requests than the largest captured batch size"
            else:
                reason = "extend batch (a query longer than one token)"
            logits = self.model.forward(fb, self.attn_backend.init_forward_metadata(fb), self.pools)
            return StepResult(logits, logits.argmax(-1), "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        (k_full, v_full), (k_swa, v_swa) = self.pools
        return {"k_full": k_full, "v_full": v_full, "k_swa": k_swa, "v_swa": v_swa}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {} if self.graph_runner is None else self.graph_runner.static_buffers()

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load(seed)

    def close(self) -> None:
        if self.graph_runner is not None:
            self.graph_runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ModelRunner:
    return ModelRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ModelRunner:
    return ModelRunner(mode, seed=seed, backend=backend, zero_swa_loc_on_pad=False)
