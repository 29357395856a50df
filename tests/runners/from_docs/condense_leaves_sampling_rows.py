"""A decode runner written the way vLLM v1's GPUModelRunner is written, against plain torch.cuda.

Idioms (all legal on a GPU): `CpuGpuBuffer` pairs (a pinned CPU tensor, its `.np` numpy view
written with vectorised numpy, and a device tensor uploaded with `copy_to_gpu(n)`); a persistent
`InputBatch` keeping per-request state in rows, condensed on removal (the last rows move into the
holes), with its block table a CpuGpuBuffer uploaded every step; `prepare_inputs_event` guarding
the pinned buffers across steps (vLLM's `synchronize_input_prep`); a `@dataclass` attention
metadata built per step and handed to attention through a forward context; FULL_AND_PIECEWISE
graphs as vLLM's default: FULL graphs for uniform single-token decode batches, PIECEWISE graphs
(split at attention, which runs eagerly on the actual tokens and writes into an output buffer the
previous piece allocated) for any other batch, both keyed by the padded token count (`bisect`
lookup), captured at start-up largest first on one capture stream into one shared pool, with
`gc.collect()` / `gc.freeze()` / `torch.cuda.empty_cache()` around capture; the block table is
committed for the live rows only and padded rows are never dereferenced; KV caches are bf16 views
of raw int8 allocations; the persistent batch reorders decodes first (`swap_states`); sampler run
eagerly after the replay
on a clone of the real rows; sampled ids downloaded on an output stream with
`.to("cpu", non_blocking=True)` plus an event, resolved before `step` returns. The model (bf16):
`F.embedding`, merged QKV / gate-up `nn.Linear`s (bias=False) whose weights are a custom
`nn.Parameter` subclass carrying a `weight_loader` that `narrow`s shards, neox rotary from a
cos/sin cache built with `torch.polar`, `index_copy_` / `index_put_` into a paged KV cache, and
`F.scaled_dot_product_attention` over the gathered context.

Bug (`make_buggy_target`): `InputBatch.condense` moves a request's tokens, counts and block-table
row into the hole, but not its per-row sampling parameters (temperature, seed): the moved request
samples with whatever the hole's departed request left there. Modelled on vLLM's persistent-batch
state movers forgetting a field: vllm-project/vllm-ascend#2961 (new per-request fields "not
handled in the swap_states and condense methods of the InputBatch", review comment) and
vllm-project/vllm#49613 (an asymmetric SWAP in the input batch leaves stale per-row sampling
state at the emptied index, so it "could apply to the wrong request").
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec

HIDDEN, HEADS, HEAD_DIM, LAYERS, INTER = 64, 4, 16, 2, 128
DTYPE = torch.bfloat16
SPEC = TargetSpec(
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=128,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8, 16),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=0,
)
MAX_MODEL_LEN = SPEC.max_blocks_per_req * SPEC.block_size


# ---------------------------------------------------------------------------------- buffers


class CpuGpuBuffer:
    def __init__(self, *size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu", pin_memory=True)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(*size, dtype=dtype, device=device)

    def copy_to_gpu(self, n: int | None = None) -> Tensor:
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class InputBatch:
    """Per-request state in persistent rows [0, num_reqs)."""

    def __init__(self, device: torch.device, *, move_sampling_on_condense: bool = True) -> None:
        R = SPEC.max_num_reqs
        self.req_ids: list[int | None] = [None] * R
        self.req_id_to_index: dict[int, int] = {}
        self.token_ids_cpu_tensor = torch.zeros(R, MAX_MODEL_LEN, dtype=torch.int32)
        self.token_ids_cpu = self.token_ids_cpu_tensor.numpy()
        self.num_computed_tokens_cpu = np.zeros(R, dtype=np.int32)
        self.num_scheduled = np.zeros(R, dtype=np.int32)
        self.num_blocks_per_row = np.zeros(R, dtype=np.int32)
        self.block_table = CpuGpuBuffer(
            R, SPEC.max_blocks_per_req, dtype=torch.int32, device=device
        )
        self.temperature = CpuGpuBuffer(R, dtype=torch.float32, device=device)
        self.seeds = CpuGpuBuffer(R, dtype=torch.int64, device=device)
        self.sampling_key: dict[int, tuple[int | None, float]] = {}
        self.move_sampling_on_condense = move_sampling_on_condense

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, r: Request, index: int) -> None:
        self.req_ids[index] = r.req_id
        self.req_id_to_index[r.req_id] = index
        self.sampling_key[r.req_id] = (r.seed, r.temperature)
        nb = len(r.block_ids)
        self.block_table.np[index, :nb] = r.block_ids
        self.num_blocks_per_row[index] = nb
        self.temperature.np[index] = r.temperature if r.seed is not None else 0.0
        self.seeds.np[index] = (r.seed or 0) & 0x7FFFFFFF
        self.update_request(r, index)

    def update_request(self, r: Request, index: int) -> None:
        self.num_computed_tokens_cpu[index] = r.context_len
        self.num_scheduled[index] = r.query_len
        self.token_ids_cpu[index, r.context_len : r.seq_len] = r.tokens
        nb, new = self.num_blocks_per_row[index], len(r.block_ids)
        if new > nb:  # BlockTable.append_row
            self.block_table.np[index, nb:new] = r.block_ids[nb:]
            self.num_blocks_per_row[index] = new

    def can_continue(self, r: Request, index: int) -> bool:
        nb = int(self.num_blocks_per_row[index])
        prev_ctx = int(self.num_computed_tokens_cpu[index])
        return (
            self.sampling_key.get(r.req_id) == (r.seed, r.temperature)
            and prev_ctx < r.context_len <= prev_ctx + int(self.num_scheduled[index])
            and len(r.block_ids) >= nb
            and tuple(self.block_table.np[index, :nb].tolist()) == tuple(r.block_ids[:nb])
        )

    def remove_request(self, req_id: int) -> int:
        index = self.req_id_to_index.pop(req_id)
        self.sampling_key.pop(req_id, None)
        self.req_ids[index] = None
        return index

    def swap_states(self, i1: int, i2: int) -> None:
        id1, id2 = self.req_ids[i1], self.req_ids[i2]
        assert id1 is not None and id2 is not None
        self.req_ids[i1], self.req_ids[i2] = id2, id1
        self.req_id_to_index[id1], self.req_id_to_index[id2] = i2, i1
        for arr in (
            self.num_computed_tokens_cpu,
            self.num_scheduled,
            self.num_blocks_per_row,
            self.temperature.np,
            self.seeds.np,
            self.token_ids_cpu,
            self.block_table.np,
        ):
            arr[[i1, i2]] = arr[[i2, i1]]

    def reorder_decodes_first(self) -> None:
        """reorder_batch_to_split_decodes_and_prefills: single-token rows first."""
        is_decode = list(self.num_scheduled[: self.num_reqs] == 1)
        i, j = 0, self.num_reqs - 1
        while True:
            while i < self.num_reqs and is_decode[i]:
                i += 1
            while j >= 0 and not is_decode[j]:
                j -= 1
            if i >= j:
                break
            self.swap_states(i, j)
            is_decode[i], is_decode[j] = True, False

    def condense(self, empty: list[int]) -> None:
        """Move the last live rows into the holes below num_reqs (vLLM's InputBatch.condense)."""
        num_reqs = self.num_reqs
        holes = sorted(i for i in empty if i < num_reqs)
        last = max((i for i, r in enumerate(self.req_ids) if r is not None), default=-1)
        for hole in holes:
            if hole >= last:
                break
            req_id = self.req_ids[last]
            assert req_id is not None
            self.req_ids[hole], self.req_ids[last] = req_id, None
            self.req_id_to_index[req_id] = hole
            n = self.num_computed_tokens_cpu[last] + self.num_scheduled[last]
            self.token_ids_cpu[hole, :n] = self.token_ids_cpu[last, :n]
            self.num_computed_tokens_cpu[hole] = self.num_computed_tokens_cpu[last]
            self.num_scheduled[hole] = self.num_scheduled[last]
            nb = self.num_blocks_per_row[last]
            self.block_table.np[hole, :nb] = self.block_table.np[last, :nb]  # move_row
            self.num_blocks_per_row[hole] = nb
            if self.move_sampling_on_condense:
                self.temperature.np[hole] = self.temperature.np[last]
                self.seeds.np[hole] = self.seeds.np[last]
            while last > 0 and self.req_ids[last] is None:
                last -= 1


@dataclass
class AttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    query_start_loc: Tensor
    seq_lens: Tensor
    slot_mapping: Tensor
    block_table: Tensor
    positions: Tensor


# ------------------------------------------------------------------------------------ model


class ModelWeightParameter(nn.Parameter):
    def __new__(cls, data: Tensor, weight_loader=None):  # type: ignore[no-untyped-def]
        return super().__new__(cls, data, requires_grad=False)

    def __init__(self, data: Tensor, weight_loader=None) -> None:  # type: ignore[no-untyped-def]
        self.weight_loader = weight_loader


def default_weight_loader(param: Tensor, loaded: Tensor, shard_id: int | None = None) -> None:
    param.data.copy_(loaded)


class MergedLinear(nn.Linear):
    def __init__(self, in_f: int, output_sizes: Sequence[int]) -> None:
        super().__init__(in_f, sum(output_sizes), bias=False, dtype=DTYPE)
        self.output_sizes = list(output_sizes)
        self.weight = ModelWeightParameter(self.weight.data, weight_loader=self.weight_loader)

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            param.data.copy_(loaded)
            return
        offset, size = sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]
        loaded = loaded.narrow(0, 0, size)  # tp_rank 0 of tp_size 1
        param.data.narrow(0, offset, size).copy_(loaded)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = ModelWeightParameter(torch.ones(dim, dtype=DTYPE), default_weight_loader)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return xf.to(x.dtype) * self.weight


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        freqs = torch.outer(torch.arange(MAX_MODEL_LEN, dtype=torch.float32), inv)
        cis = torch.polar(torch.ones_like(freqs), freqs)
        self.register_buffer("cos_sin_cache", torch.cat([cis.real, cis.imag], -1), persistent=False)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:  # x [T, heads, dim]
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, -1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


_forward_context: list[AttentionMetadata] = []


@contextlib.contextmanager
def set_forward_context(md: AttentionMetadata):  # type: ignore[no-untyped-def]
    _forward_context.append(md)
    try:
        yield
    finally:
        _forward_context.pop()


def unified_attention_with_output(
    q: Tensor, k: Tensor, v: Tensor, output: Tensor, kv: Tensor
) -> None:
    """Attention over the first num_actual_tokens rows (the split point of piecewise graphs)."""
    md = _forward_context[-1]
    T = md.num_actual_tokens
    if T == 0:
        return  # dummy run: nothing to attend
    q, k, v = q[:T], k[:T], v[:T]
    key_cache, value_cache = kv[0].view(-1, HEADS, HEAD_DIM), kv[1].view(-1, HEADS, HEAD_DIM)
    key_cache.index_copy_(0, md.slot_mapping, k)
    value_cache.index_put_((md.slot_mapping,), v)
    tok = torch.arange(T, device=q.device)
    req = torch.searchsorted(md.query_start_loc[1 : md.num_reqs + 1], tok, right=True)
    seq = md.seq_lens[req]
    cols = torch.arange(SPEC.max_blocks_per_req, device=q.device)[None, :]
    # a row's columns past its sequence (and every column of a padded row) are never dereferenced
    tables = torch.where(
        cols * SPEC.block_size < seq[:, None], md.block_table[req], SPEC.null_block
    ).long()
    offs = torch.arange(SPEC.block_size, device=q.device)
    ctx = (tables[:, :, None] * SPEC.block_size + offs).flatten(1)  # [T, C]
    cpos = torch.arange(MAX_MODEL_LEN, device=q.device)[None, :]
    visible = (cpos <= md.positions[:, None]) & (cpos < seq[:, None])
    keys = torch.where(visible[:, :, None, None], key_cache[ctx], 0.0).transpose(1, 2)
    vals = torch.where(visible[:, :, None, None], value_cache[ctx], 0.0).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, vals, attn_mask=visible[:, None, None, :]
    )
    output[:T].copy_(out.reshape(T, HEADS * HEAD_DIM))


class DecoderLayer(nn.Module):
    def __init__(self, rotary: Rotary) -> None:
        super().__init__()
        self.rotary = [rotary]  # shared, not a submodule twice
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.qkv_proj = MergedLinear(HIDDEN, [HIDDEN] * 3)
        self.o_proj = MergedLinear(HIDDEN, [HIDDEN])
        self.gate_up_proj = MergedLinear(HIDDEN, [INTER, INTER])
        self.down_proj = MergedLinear(INTER, [HIDDEN])

    def pre_attn(self, positions: Tensor, x: Tensor) -> tuple[Tensor, ...]:
        q, k, v = self.qkv_proj(self.input_layernorm(x)).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        q, k = self.rotary[0](positions, q), self.rotary[0](positions, k)
        return q, k, v, torch.empty(q.shape[0], HEADS * HEAD_DIM, dtype=q.dtype, device=q.device)

    def post_attn(self, x: Tensor, attn_out: Tensor) -> Tensor:
        x = x + self.o_proj(attn_out)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, -1)
        return x + self.down_proj(F.silu(gate) * up)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        q, k, v, out = self.pre_attn(positions, x)
        unified_attention_with_output(q, k, v, out, self.kv_cache[0])
        return self.post_attn(x, out)


class TinyForCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        emb = torch.empty(SPEC.vocab_size, HIDDEN, dtype=DTYPE)
        self.embed_tokens = ModelWeightParameter(emb, default_weight_loader)
        self.rotary = Rotary()
        self.layers = nn.ModuleList(DecoderLayer(self.rotary) for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = ModelWeightParameter(
            torch.empty(SPEC.vocab_size, HIDDEN, dtype=DTYPE), default_weight_loader
        )

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)

    def piece(
        self, i: int, input_ids: Tensor, positions: Tensor, carry: tuple[Tensor, ...] | None
    ) -> tuple[Tensor, ...]:
        """Piece i of the forward split at attention: (residual, q, k, v, attn output) or (hidden,)."""
        if i == 0:
            x = F.embedding(input_ids, self.embed_tokens)
        else:
            assert carry is not None
            x = self.layers[i - 1].post_attn(carry[0], carry[4])
        if i == len(self.layers):
            return (self.norm(x),)
        return (x, *self.layers[i].pre_attn(positions, x))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.lm_head).float()

    def load_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        params = dict(self.named_parameters())
        for name in sorted(params):
            p = params[name]
            if name.endswith("layernorm.weight") or name == "norm.weight":
                shards = [(None, 1.0 + 0.1 * torch.randn(p.shape, generator=g))]
            elif (
                isinstance(owner := getattr(p.weight_loader, "__self__", None), MergedLinear)
                and len(owner.output_sizes) > 1
            ):
                shards = [
                    (i, torch.randn(s, p.shape[1], generator=g) / math.sqrt(p.shape[1]))
                    for i, s in enumerate(owner.output_sizes)
                ]
            else:
                shards = [(None, torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))]
            for shard_id, w in shards:
                p.weight_loader(p, w.to(DTYPE), shard_id)


def gumbel_noise(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    tok = torch.arange(vocab, device=seeds.device)[None, :]
    x = (seeds[:, None] * 1000003 + positions[:, None].long() * 8191 + tok * 131071) & 0xFFFFFFFF
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    u = ((x >> 8).float() + 0.5) / 16777216.0
    return -torch.log(-torch.log(u))


def sample(logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    greedy = logits.argmax(-1)
    t = torch.where(temperature > 0, temperature, 1.0)
    noisy = logits / t[:, None] + gumbel_noise(seeds, positions, logits.shape[-1])
    return torch.where(temperature > 0, noisy.argmax(-1), greedy)


# ----------------------------------------------------------------------------------- runner


def async_tensor_h2d(
    data: list, dtype: torch.dtype, target_device: torch.device, pin_memory: bool
) -> Tensor:
    t = torch.tensor(data, dtype=dtype, pin_memory=pin_memory, device="cpu")
    return t.to(device=target_device, non_blocking=True)


class GPUModelRunner:
    def __init__(self, mode: str, *, seed: int, move_sampling_on_condense: bool = True) -> None:
        local_rank = 0
        self.device = torch.device(f"cuda:{local_rank}")
        self.mode = mode
        self.model = TinyForCausalLM()
        self.model.to(self.device)
        self.model.load_weights(seed)
        shape = (2, SPEC.num_blocks, SPEC.block_size, HEADS, HEAD_DIM)
        nbytes = math.prod(shape) * DTYPE.itemsize
        raw = [torch.zeros(nbytes, dtype=torch.int8, device=self.device) for _ in range(LAYERS)]
        self.kv_caches = [t.view(DTYPE).view(shape) for t in raw]  # _reshape_kv_cache_tensors
        for layer, kv in zip(self.model.layers, self.kv_caches, strict=False):  # bind_kv_cache
            layer.kv_cache = [kv]
        self.model.eval().requires_grad_(False)
        self.input_batch = InputBatch(
            self.device, move_sampling_on_condense=move_sampling_on_condense
        )
        T, R = SPEC.max_num_tokens, SPEC.max_num_reqs
        self.input_ids = CpuGpuBuffer(T, dtype=torch.int32, device=self.device)
        self.positions = CpuGpuBuffer(T, dtype=torch.int64, device=self.device)
        self.slot_mapping = CpuGpuBuffer(T, dtype=torch.int64, device=self.device)
        self.query_start_loc = CpuGpuBuffer(R + 1, dtype=torch.int32, device=self.device)
        self.seq_lens = CpuGpuBuffer(R, dtype=torch.int32, device=self.device)
        self.arange_np = np.arange(max(T, R) + 1, dtype=np.int64)
        self.prepare_inputs_event = torch.cuda.Event()
        self.async_output_copy_stream = torch.cuda.Stream()
        self.cudagraph_batch_sizes = sorted(SPEC.capture_sizes)
        self.cudagraphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.piecewise: dict[int, list[tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]]] = {}
        self.full_sizes = [s for s in self.cudagraph_batch_sizes if s <= SPEC.max_num_reqs]
        if mode == "graph":
            self.capture_model()

    # -- input prep ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def synchronize_input_prep(self):  # type: ignore[no-untyped-def]
        self.prepare_inputs_event.synchronize()
        try:
            yield
        finally:
            self.prepare_inputs_event.record()

    def update_states(self, batch: Batch) -> None:
        ib = self.input_batch
        scheduled = {r.req_id: r for r in batch.requests}
        removed = []
        for req_id, index in list(ib.req_id_to_index.items()):
            r = scheduled.get(req_id)
            if r is None or not ib.can_continue(r, index):
                removed.append(ib.remove_request(req_id))
            else:
                ib.update_request(r, index)
        removed.sort(reverse=True)
        for r in batch.requests:
            if r.req_id not in ib.req_id_to_index:
                index = removed.pop() if removed else ib.num_reqs
                ib.add_request(r, index)
        ib.condense(removed)
        ib.reorder_decodes_first()

    def prepare_inputs(self, num_reqs_padded: int, num_tokens_padded: int) -> AttentionMetadata:
        ib, bs = self.input_batch, SPEC.block_size
        n = ib.num_reqs
        sched = ib.num_scheduled[:n]
        T = int(sched.sum())
        req_indices = np.repeat(self.arange_np[:n], sched)
        cu = np.cumsum(sched, out=self.query_start_loc.np[1 : n + 1])
        offsets = self.arange_np[:T] - np.repeat(cu - sched, sched)
        pos = self.positions.np[:T]
        np.add(ib.num_computed_tokens_cpu[req_indices], offsets, out=pos)
        token_indices = pos + req_indices * MAX_MODEL_LEN
        torch.index_select(
            ib.token_ids_cpu_tensor.flatten(),
            0,
            torch.from_numpy(token_indices),
            out=self.input_ids.cpu[:T],
        )
        blocks = ib.block_table.np.ravel()[req_indices * SPEC.max_blocks_per_req + pos // bs]
        np.add(blocks * bs, pos % bs, out=self.slot_mapping.np[:T])
        self.query_start_loc.np[0] = 0
        self.seq_lens.np[:n] = ib.num_computed_tokens_cpu[:n] + sched
        # padding: one token per padded request, at position 0, writing the null block only
        self.input_ids.np[T:num_tokens_padded] = 0
        self.positions.np[T:num_tokens_padded] = 0
        self.slot_mapping.np[T:num_tokens_padded] = SPEC.null_block * bs
        last = cu[-1] if n else 0
        self.query_start_loc.np[n + 1 : num_reqs_padded + 1] = (
            last + self.arange_np[1 : num_reqs_padded - n + 1]
        )
        self.seq_lens.np[n:num_reqs_padded] = 0
        for buf in (self.input_ids, self.positions, self.slot_mapping):
            buf.copy_to_gpu(num_tokens_padded)
        self.query_start_loc.copy_to_gpu(num_reqs_padded + 1)
        for buf in (self.seq_lens, ib.temperature, ib.seeds):
            buf.copy_to_gpu(num_reqs_padded)
        ib.block_table.copy_to_gpu(n)  # commit_block_table(num_reqs): padded rows are never read
        return self.build_metadata(num_reqs_padded, num_tokens_padded)

    def build_metadata(self, R: int, T: int) -> AttentionMetadata:
        """R requests, T tokens: padded for FULL graphs, the actual ones otherwise."""
        return AttentionMetadata(
            num_actual_tokens=T,
            num_reqs=R,
            query_start_loc=self.query_start_loc.gpu[: R + 1],
            seq_lens=self.seq_lens.gpu[:R],
            slot_mapping=self.slot_mapping.gpu[:T],
            block_table=self.input_batch.block_table.gpu[:R],
            positions=self.positions.gpu[:T],
        )

    # -- forward and graphs -------------------------------------------------------------------

    def model_forward(self, md: AttentionMetadata) -> Tensor:
        T = md.num_actual_tokens
        with set_forward_context(md):
            hidden = self.model(self.input_ids.gpu[:T], self.positions.gpu[:T])
        logits_indices = (md.query_start_loc[1 : md.num_reqs + 1] - 1).long()
        return self.model.compute_logits(hidden[logits_indices])

    def run_pieces(self, size: int, md: AttentionMetadata, graphs: list | None = None) -> Tensor:
        ids, pos = self.input_ids.gpu[:size], self.positions.gpu[:size]
        carry = None
        for i in range(LAYERS + 1):
            if graphs is not None:
                graphs[i][0].replay()
                carry = graphs[i][1]
            else:
                carry = self.model.piece(i, ids, pos, carry)
            if i < LAYERS:
                with set_forward_context(md):
                    unified_attention_with_output(*carry[1:5], self.model.layers[i].kv_cache[0])
        return carry[0]

    def pad_for_cudagraph(self, n: int) -> int | None:
        i = bisect.bisect_left(self.cudagraph_batch_sizes, n)
        return self.cudagraph_batch_sizes[i] if i < len(self.cudagraph_batch_sizes) else None

    def capture_model(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()
        pool = torch.cuda.graph_pool_handle()
        capture_stream = torch.cuda.Stream()
        gc.freeze()
        with torch.inference_mode():
            for size in reversed(self.cudagraph_batch_sizes):  # PIECEWISE, keyed by num_tokens
                with self.synchronize_input_prep():
                    self.prepare_inputs(0, size)
                md = self.build_metadata(0, 0)
                self.run_pieces(size, md)  # warm-up
                torch.cuda.synchronize()
                pieces, carry = [], None
                ids, pos = self.input_ids.gpu[:size], self.positions.gpu[:size]
                for i in range(LAYERS + 1):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                        carry = self.model.piece(i, ids, pos, carry)
                    pieces.append((graph, carry))
                self.piecewise[size] = pieces
            for size in reversed(self.full_sizes):  # FULL, uniform decode
                with self.synchronize_input_prep():  # an empty batch: every row is padding
                    md = self.prepare_inputs(size, size)
                for _ in range(2):
                    self.model_forward(md)  # warm-up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                    logits = self.model_forward(md)
                self.cudagraphs[size] = (graph, logits)
        gc.unfreeze()
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()

    def dispatch(self, batch: Batch) -> tuple[str, int | None, str | None]:
        if self.mode != "graph":
            return "eager", None, "eager twin"
        size = self.pad_for_cudagraph(batch.num_tokens)
        if size is None:
            return "eager", None, "above the largest capture size"
        if batch.requests and all(q == 1 for q in batch.query_lens) and size in self.cudagraphs:
            return "full", size, None
        return "piecewise", size, "not a uniform single-token decode batch"

    @torch.inference_mode()
    def execute_model(self, batch: Batch) -> StepResult:
        path, size, reason = self.dispatch(batch)
        with self.synchronize_input_prep():
            self.update_states(batch)
            n = self.input_batch.num_reqs
            R, T = (size, size) if path == "full" else (n, size or batch.num_tokens)
            md = self.prepare_inputs(R, T)
        if path == "full":
            graph, out = self.cudagraphs[size]
            graph.replay()
            logits = out[:n].clone()
        elif path == "piecewise":
            hidden = self.run_pieces(
                size, self.build_metadata(n, batch.num_tokens), self.piecewise[size]
            )
            logits_indices = (self.query_start_loc.gpu[1 : n + 1] - 1).long()
            logits = self.model.compute_logits(hidden[logits_indices])
        else:
            logits = self.model_forward(md)
        ib = self.input_batch
        sampled = sample(
            logits, ib.temperature.gpu[:n], ib.seeds.gpu[:n], self.seq_lens.gpu[:n] - 1
        )
        # async output: download on a side stream, resolved before returning
        self.async_output_copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.async_output_copy_stream):
            sampled_cpu = sampled.to("cpu", non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        order_np = np.array([ib.req_id_to_index[r.req_id] for r in batch.requests], dtype=np.int64)
        order = async_tensor_h2d(order_np.tolist(), torch.int64, self.device, pin_memory=True)
        out_logits = logits.index_select(0, order)
        copied.synchronize()
        valid_sampled_token_ids = sampled_cpu.tolist()
        next_tokens = torch.tensor(
            [valid_sampled_token_ids[i] for i in order_np.tolist()], dtype=torch.int64
        )
        key = (path, size) if path != "eager" else None
        return StepResult(out_logits, next_tokens, path, key, reason=reason)


class VllmStyleTarget:
    def __init__(self, mode: Literal["graph", "eager"], *, seed: int, buggy: bool = False) -> None:
        self.spec = SPEC
        self.mode = mode
        self.runner = GPUModelRunner(mode, seed=seed, move_sampling_on_condense=not buggy)

    def step(self, batch: Batch) -> StepResult:
        return self.runner.execute_model(batch)

    def state(self) -> Mapping[str, Tensor]:
        out = {}
        for i, kv in enumerate(self.runner.kv_caches):
            out[f"k{i}"] = kv[0].view(-1, HEADS, HEAD_DIM)
            out[f"v{i}"] = kv[1].view(-1, HEADS, HEAD_DIM)
        return out

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode != "graph":
            return {}
        r, ib = self.runner, self.runner.input_batch
        return {
            "input_ids": r.input_ids.gpu,
            "positions": r.positions.gpu,
            "slot_mapping": r.slot_mapping.gpu,
            "query_start_loc": r.query_start_loc.gpu,
            "seq_lens": r.seq_lens.gpu,
            "block_table": ib.block_table.gpu,
            "temperature": ib.temperature.gpu,
            "seeds": ib.seeds.gpu,
            # The attention outputs between piecewise graphs are graph inputs rewritten every
            # step (their prefix); a capture in inference mode made them.
            **{
                f"attn_out{s}_{i}": p[i][1][4]
                for s, p in r.piecewise.items()
                for i in range(LAYERS)
            },
        }

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.no_grad():
            self.runner.model.load_weights(seed)

    def close(self) -> None:
        for graph, _ in self.runner.cudagraphs.values():
            graph.reset()
        for pieces in self.runner.piecewise.values():
            for graph, _ in pieces:
                graph.reset()
        self.runner.cudagraphs.clear()
        self.runner.piecewise.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> VllmStyleTarget:
    return VllmStyleTarget(mode, seed=seed)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> VllmStyleTarget:
    return VllmStyleTarget(mode, seed=seed, buggy=True)
