"""An engine-style decode model runner written against plain `torch.cuda`, with a wide API surface.

The runner is shaped like a serving engine's GPU model runner (vLLM / SGLang style), using only
public torch APIs:

- device set-up: `torch.cuda.set_device(local_rank)`, `torch.device("cuda",
  torch.cuda.current_device())`, `torch.cuda.get_device_properties(...).multi_processor_count`,
  `torch.cuda.mem_get_info()` for a KV-cache budget check, `torch.cuda.empty_cache()`,
  `torch.cuda.synchronize()`, `x.to(local_rank)` for weights;
- an `nn.Module` (two decoder layers, GQA attention through
  `F.scaled_dot_product_attention(..., enable_gqa=True)` over a slot-major paged KV cache, RMSNorm,
  SiLU MLP, rotary embeddings from a `register_buffer(..., persistent=False)` cos/sin cache) whose
  weights are `WeightParameter`s, an `nn.Parameter` subclass carrying a `weight_loader` (fused
  QKV / gate-up weights loaded shard by shard), moved with `model.to(device=..., dtype=bf16)`;
- steps under `torch.inference_mode()` and `torch.cuda.nvtx.range_push/pop`;
- per-step host inputs staged in a reused pinned buffer (written through a numpy view), uploaded
  with a `non_blocking` copy on a copy stream into a FRESH device tensor (allocated on the copy
  stream), consumed on the compute (current) stream after `wait_event`, then released with
  `Tensor.record_stream(current_stream)` so the caching allocator does not hand its block to the
  next step's upload while the compute stream may still read it;
- graph capture as vLLM does it: one graph per capture size, largest first, one
  `torch.cuda.graph_pool_handle()`, warm-up iterations on a side stream
  (`s.wait_stream(current)`, `with torch.cuda.stream(s)`, `current.wait_stream(s)`), capture with
  `torch.cuda.graph(g, pool=pool, stream=capture_stream, capture_error_mode="thread_local")`,
  `torch.cuda.is_current_stream_capturing()` in the forward, one replay per graph timed with
  `torch.cuda.Event(enable_timing=True).elapsed_time`;
- Gumbel-max sampling with noise hashed from (seed, position, token id), and an asynchronous
  sampled-token download (`.to("cpu", non_blocking=True)` + event) that the runner collects lazily
  (`Event.query()`), like vLLM's async output copy, so a step returns while its work is queued.

BUG (`make_buggy_target`): the fresh device staging tensor is dropped without `record_stream` (and
without the copy stream waiting for the compute stream). It was allocated on the copy stream, so
the caching allocator gives its block to the next step's upload on the copy stream as soon as it is
freed, while the compute stream of the previous step may still be about to read it: the next
step's inputs overwrite the previous step's before its `static.copy_` / eager forward ran.
Public sources: the PyTorch docs of `Tensor.record_stream` (a tensor used on a stream other than
its allocation stream may be reused unexpectedly); vLLM PR #23569 review
(https://github.com/vllm-project/vllm/pull/23569: record_stream suggested "for (re)allocation
safety" of a tensor consumed on the async output copy stream); torchrec PR #4231
(https://github.com/meta-pytorch/torchrec/pull/4231: NaN corruption from a missing record_stream
on a side-stream copy)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, FFN, NUM_LAYERS = 32, 4, 2, 8, 48, 2
DTYPE = torch.bfloat16
NULL_BLOCK = 0
SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=NULL_BLOCK,
)
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
# Int staging columns. Token columns describe row r as a query token; request columns describe
# request r (rows 0..num_reqs-1): which token row gives its logits, and how it samples.
C_TOKEN, C_POS, C_SLOT, C_LAST, C_SEED, C_GREEDY, C_TABLE = range(7)
WIDTH = C_TABLE + SPEC.max_blocks_per_req


# -- parameters and model ------------------------------------------------------------------------


class WeightParameter(nn.Parameter):
    """A parameter that knows how to load itself (shard by shard for fused weights)."""

    def __new__(cls, data: Tensor, weight_loader=None):
        return super().__new__(cls, data, requires_grad=False)

    def __init__(self, data: Tensor, weight_loader=None) -> None:
        self._weight_loader = weight_loader or default_weight_loader

    @property
    def weight_loader(self):
        return self._weight_loader


def default_weight_loader(param: Tensor, loaded: Tensor, shard: tuple[int, int] | None = None):
    """Copy a host tensor into `param` (rows `shard` = (start, size) of a fused weight)."""
    target = param.data if shard is None else param.data.narrow(0, shard[0], shard[1])
    target.copy_(loaded.to(dtype=target.dtype).to(torch.cuda.current_device()))


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = WeightParameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (x32 * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_pos: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        self.register_buffer(
            "cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False
        )

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:  # x: [T, heads, head_dim]
        cos, sin = self.cos_sin_cache[positions].float().chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_size = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        self.qkv_proj = WeightParameter(torch.empty(self.qkv_size, HIDDEN))
        self.o_proj = WeightParameter(torch.empty(HIDDEN, NUM_HEADS * HEAD_DIM))
        self.rotary = RotaryEmbedding(HEAD_DIM, MAX_POS)

    def forward(self, x, positions, slots, tables, k_cache, v_cache) -> Tensor:
        t = x.shape[0]
        q, k, v = F.linear(x, self.qkv_proj).split(
            [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1
        )
        q = self.rotary(positions, q.view(t, NUM_HEADS, HEAD_DIM))
        k = self.rotary(positions, k.view(t, NUM_KV_HEADS, HEAD_DIM))
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v.view(t, NUM_KV_HEADS, HEAD_DIM))
        bs = SPEC.block_size
        offsets = torch.arange(bs, device=x.device)
        context = (tables[:, :, None] * bs + offsets).flatten(1)  # [T, MAX_POS] slots
        visible = torch.arange(MAX_POS, device=x.device)[None, :] <= positions[:, None]
        zero = torch.zeros((), dtype=k_cache.dtype, device=x.device)
        # masked slots may hold NaN (the null block): replace, do not multiply by zero.
        keys = torch.where(visible[:, :, None, None], k_cache[context], zero).transpose(1, 2)
        values = torch.where(visible[:, :, None, None], v_cache[context], zero).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], keys, values, attn_mask=visible[:, None, None, :], enable_gqa=True
        )
        return F.linear(out.reshape(t, NUM_HEADS * HEAD_DIM), self.o_proj)


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_norm = RMSNorm(HIDDEN)
        self.attn = Attention()
        self.post_norm = RMSNorm(HIDDEN)
        self.gate_up_proj = WeightParameter(torch.empty(2 * FFN, HIDDEN))
        self.down_proj = WeightParameter(torch.empty(HIDDEN, FFN))

    def forward(self, x, positions, slots, tables, k_cache, v_cache) -> Tensor:
        x = x + self.attn(self.input_norm(x), positions, slots, tables, k_cache, v_cache)
        gate, up = F.linear(self.post_norm(x), self.gate_up_proj).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, self.down_proj)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = WeightParameter(torch.empty(SPEC.vocab_size, HIDDEN))
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(NUM_LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = WeightParameter(torch.empty(SPEC.vocab_size, HIDDEN))

    def forward(self, tokens, positions, slots, tables, kv_caches) -> Tensor:
        x = self.embed_tokens[tokens]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=False):
            x = layer(x, positions, slots, tables, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.lm_head).float()

    @torch.no_grad()
    def load_weights(self, seed: int) -> None:
        """Host checkpoint tensors (seeded) through each parameter's weight_loader."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                param.weight_loader(param, 1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("qkv_proj"):  # q, k, v checkpoint shards into one fused weight
                start = 0
                for rows in (
                    NUM_HEADS * HEAD_DIM,
                    NUM_KV_HEADS * HEAD_DIM,
                    NUM_KV_HEADS * HEAD_DIM,
                ):
                    shard = torch.randn(rows, HIDDEN, generator=gen) / HIDDEN**0.5
                    param.weight_loader(param, shard, (start, rows))
                    start += rows
            elif name.endswith("gate_up_proj"):
                for i in range(2):
                    shard = torch.randn(FFN, HIDDEN, generator=gen) / HIDDEN**0.5
                    param.weight_loader(param, shard, (i * FFN, FFN))
            else:
                scale = 1.0 if name == "embed_tokens" else param.shape[1] ** -0.5
                param.weight_loader(param, torch.randn(param.shape, generator=gen) * scale)


def sample(
    logits: Tensor, seeds: Tensor, positions: Tensor, greedy: Tensor, temps: Tensor
) -> Tensor:
    """Gumbel-max with counter-based noise from (seed, position, token id): no generator state."""
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    h = seeds[:, None] * 2654435761 + positions[:, None] * 40503 + vocab[None, :] * 97 + 1
    for mult in (2246822519, 3266489917):
        h = (h ^ (h >> 15)) * mult
    u = (((h >> 16) & 0xFFFFFF).float() + 0.5) / float(1 << 24)
    gumbel = -torch.log(-torch.log(u))
    sampled = logits / temps[:, None] + gumbel
    return torch.where(greedy[:, None] != 0, logits, sampled).argmax(-1)


# -- the model runner ----------------------------------------------------------------------------


class ModelRunner:
    def __init__(
        self, *, use_cuda_graph: bool, seed: int, record_stream: bool = True, local_rank: int = 0
    ):
        self.local_rank = local_rank
        self.record_stream = record_stream
        torch.cuda.set_device(local_rank)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        model = TinyLM()
        self.model = model.to(device=self.device, dtype=DTYPE).eval()
        self.model.load_weights(seed)
        torch.cuda.default_stream(self.device).synchronize()  # weights have landed
        # KV cache budget: what is free after the weights must hold the cache.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        slots = SPEC.num_blocks * SPEC.block_size
        need = 2 * NUM_LAYERS * slots * NUM_KV_HEADS * HEAD_DIM * torch.finfo(DTYPE).bits // 8
        if need > 0.9 * free:
            raise RuntimeError(f"KV cache needs {need} bytes, {free} of {total} free")
        self.kv_caches = [
            (
                torch.zeros(slots, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=self.device),
                torch.zeros(slots, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=self.device),
            )
            for _ in range(NUM_LAYERS)
        ]
        rows = SPEC.max_num_tokens
        self.staging_i = torch.zeros(rows, WIDTH, dtype=torch.int64, pin_memory=True)
        self.staging_f = torch.ones(rows, dtype=torch.float32, pin_memory=True)
        self.staging_i_np, self.staging_f_np = self.staging_i.numpy(), self.staging_f.numpy()
        self.copy_stream = torch.cuda.Stream()
        self.upload_done = torch.cuda.Event()
        self.pending_downloads: list[tuple[Tensor, torch.cuda.Event]] = []
        self.num_tokens_out = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.replay_ms: dict[int, float] = {}
        self.static_i = self.static_f = None
        if use_cuda_graph:
            self.static_i = torch.zeros(
                max(SPEC.capture_sizes), WIDTH, dtype=torch.int64, device=self.device
            )
            self.static_f = torch.ones(
                max(SPEC.capture_sizes), dtype=torch.float32, device=self.device
            )
            self.capture_model()

    # -- inputs -----------------------------------------------------------------------------------

    def _stage(
        self,
        token_rows: Sequence[tuple[int, int, int, Sequence[int]]],
        req_rows: Sequence[tuple[int, int, int, float]],
        num_rows: int,
    ) -> None:
        """Write token rows (token, pos, slot, table) and request rows (last, seed, greedy, temp)
        into the pinned staging, padding up to num_rows (null block, greedy, temperature 1)."""
        self.upload_done.synchronize()  # the previous upload has read the pinned staging
        si, sf = self.staging_i_np, self.staging_f_np
        si[:num_rows] = 0
        si[:num_rows, C_TABLE:] = NULL_BLOCK
        si[:num_rows, C_SLOT] = NULL_BLOCK * SPEC.block_size
        si[:num_rows, C_GREEDY] = 1
        si[:num_rows, C_LAST] = range(num_rows)
        sf[:num_rows] = 1.0
        for r, (token, pos, slot, table) in enumerate(token_rows):
            si[r, C_TOKEN], si[r, C_POS], si[r, C_SLOT] = token, pos, slot
            si[r, C_TABLE : C_TABLE + len(table)] = table
        for r, (last, seed, greedy, temp) in enumerate(req_rows):
            si[r, C_LAST], si[r, C_SEED], si[r, C_GREEDY] = last, seed, greedy
            sf[r] = temp

    def _upload(self, num_rows: int) -> tuple[Tensor, Tensor]:
        """Non-blocking upload of the staged rows into fresh device tensors on the copy stream;
        the current stream waits for it."""
        with torch.cuda.stream(self.copy_stream):
            dev_i = self.staging_i[:num_rows].to(self.device, non_blocking=True)
            dev_f = self.staging_f[:num_rows].to(self.device, non_blocking=True)
            self.upload_done.record()
        torch.cuda.current_stream().wait_event(self.upload_done)
        return dev_i, dev_f

    def _release(self, *tensors: Tensor) -> None:
        """The fresh upload tensors were allocated on the copy stream and read on this one."""
        if self.record_stream:
            for t in tensors:
                t.record_stream(torch.cuda.current_stream())

    # -- forward ----------------------------------------------------------------------------------

    def _forward(self, ints: Tensor, floats: Tensor, num_out: int) -> tuple[Tensor, Tensor]:
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.nvtx.range_push("forward")
        hidden = self.model(
            ints[:, C_TOKEN], ints[:, C_POS], ints[:, C_SLOT], ints[:, C_TABLE:], self.kv_caches
        )
        req = ints[:num_out]
        last = req[:, C_LAST]
        logits = self.model.compute_logits(hidden[last])
        tokens = sample(
            logits, req[:, C_SEED], ints[:, C_POS][last], req[:, C_GREEDY], floats[:num_out]
        )
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.nvtx.range_pop()
        return logits, tokens

    # -- graphs -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_model(self) -> None:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        capture_stream = torch.cuda.Stream()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._stage([], [], size)  # all rows are padding for warm-up and capture
            dev_i, dev_f = self._upload(size)
            self.static_i[:size].copy_(dev_i)
            self.static_f[:size].copy_(dev_f)
            self._release(dev_i, dev_f)
            del dev_i, dev_f
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(self.static_i[:size], self.static_f[:size], size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=pool, stream=capture_stream, capture_error_mode="thread_local"
            ):
                self.graph_outputs[size] = self._forward(
                    self.static_i[:size], self.static_f[:size], size
                )
            self.graphs[size] = graph
        for size, graph in self.graphs.items():  # time one replay of each (padding rows only)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            self.replay_ms[size] = start.elapsed_time(end)
        torch.cuda.synchronize()
        self.graph_memory = free_before - torch.cuda.mem_get_info()[0]

    def graph_size(self, batch: Batch) -> int | None:
        if not self.graphs or batch.num_reqs == 0 or set(batch.query_lens) != {1}:
            return None
        return next((s for s in sorted(self.graphs) if s >= batch.num_reqs), None)

    # -- step -------------------------------------------------------------------------------------

    def _collect_downloads(self) -> None:
        """Host side of the async sampled-token copies: take those that have landed."""
        while self.pending_downloads and self.pending_downloads[0][1].query():
            host_tokens, _ = self.pending_downloads.pop(0)
            self.num_tokens_out += host_tokens.numel()

    def execute_model(self, batch: Batch) -> tuple[Tensor, Tensor, int | None]:
        torch.cuda.nvtx.range_push("execute_model")
        self._collect_downloads()
        token_rows, req_rows = [], []
        for request in batch.requests:
            for i, token in enumerate(request.tokens):
                pos = request.context_len + i
                token_rows.append(
                    (
                        token,
                        pos,
                        kv_slot(request.block_ids, pos, SPEC.block_size),
                        request.block_ids,
                    )
                )
            greedy = request.seed is None
            req_rows.append(
                (
                    len(token_rows) - 1,
                    0 if greedy else request.seed % (1 << 31),
                    int(greedy),
                    request.temperature,
                )
            )
        size = self.graph_size(batch)
        num_rows = size if size is not None else len(token_rows)
        self._stage(token_rows, req_rows, num_rows)
        dev_i, dev_f = self._upload(num_rows)
        n = batch.num_reqs
        if size is not None:
            self.static_i[:size].copy_(dev_i)
            self.static_f[:size].copy_(dev_f)
            self._release(dev_i, dev_f)
            del dev_i, dev_f
            self.graphs[size].replay()
            logits, tokens = self.graph_outputs[size]
            logits, tokens = logits[:n].clone(), tokens[:n].clone()
        else:
            logits, tokens = self._forward(dev_i, dev_f, n)
            self._release(dev_i, dev_f)
            del dev_i, dev_f
        host_tokens = tokens.to("cpu", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.pending_downloads.append((host_tokens, copied))
        torch.cuda.nvtx.range_pop()
        return logits, tokens, size

    def shutdown(self) -> None:
        for _, event in self.pending_downloads:
            event.synchronize()
        self.pending_downloads.clear()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_outputs.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- the harness adapter -------------------------------------------------------------------------


class EngineStyleTarget:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, record_stream: bool = True
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.runner = ModelRunner(
            use_cuda_graph=mode == "graph", seed=seed, record_stream=record_stream
        )

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            logits, tokens, size = self.runner.execute_model(batch)
        if size is not None:
            return StepResult(logits, tokens, "full", ("decode", size))
        reason = (
            "eager twin"
            if self.mode == "eager"
            else (
                "empty batch"
                if batch.num_reqs == 0
                else "query length > 1"
                if set(batch.query_lens) != {1}
                else "above the largest capture size"
            )
        )
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        out = {}
        for i, (k, v) in enumerate(self.runner.kv_caches):
            out[f"k{i}"], out[f"v{i}"] = k, v
        return out

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode == "eager":
            return {}
        return {"static_i": self.runner.static_i, "static_f": self.runner.static_f}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.model.load_weights(seed)

    def close(self) -> None:
        self.runner.shutdown()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> EngineStyleTarget:
    return EngineStyleTarget(mode, seed=seed)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> EngineStyleTarget:
    # The upload tensors are dropped without record_stream: their copy-stream blocks go back to
    # the allocator while the compute stream may not have read them yet.
    return EngineStyleTarget(mode, seed=seed, record_stream=False)
