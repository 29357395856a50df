"""A decode runner for an online-FP8 MoE model whose RL weight sync is a layerwise reload.

The design follows vLLM's V1 runner serving a channel-wise FP8 MoE model (compressed-tensors
``FP8_DYNAMIC`` / online FP8) in an RL loop, where the trainer pushes new weights into the live
engine and the captured CUDA graphs are kept across the update:

- One decoder layer: learned token and position embeddings, paged attention over a slot-major KV
  cache, and a mixture of experts (top-2 of 4, float32 routing) whose expert weights are
  quantized to ``float8_e4m3fn`` with one scale per output channel.
- Weights reach the layer the way vLLM's loader brings them: ``create_weights`` makes
  checkpoint-layout tensors (float32, w1 and w3 stacked as w13), the weight loader fills them
  expert by expert and shard by shard, and ``process_weights_after_loading`` (PWAL) quantizes them
  and builds the experts' kernel object. That object, like ``CutlassExpertsFp8``, owns device
  tensors of its own: per-expert problem descriptors (where each expert's rows start in the
  grouped GEMM's weight operand) and the permute workspace the tokens are sorted into by expert,
  and a quant config that holds the scales it reads.
- Decode steps (one query token per request, up to 8 requests) replay full CUDA graphs captured at
  start-up for 1, 2, 4 and 8 rows, padded with rows that write the null block; every other step
  runs eagerly. Sampling is Gumbel-max with noise hashed from (seed, position, token).
- ``update_weights`` is vLLM's ``reload_weights``: layout-identical tensors (embeddings,
  attention, router, LM head) are copied in place; the MoE layer is reloaded layerwise: its
  runtime tensors are set aside, fresh checkpoint-layout tensors are made and loaded, PWAL runs
  on them again, and the processed values are copied back into the set-aside tensors, which the
  layer then holds again, so every address a graph captured still holds the new weights.

The bug (``make_buggy_target``): PWAL rebuilds the experts' kernel object on every call, as
vLLM's compressed-tensors and FP8 MoE methods did through ``make_fp8_moe_kernel``. The copy-back
restores the layer's weights and scales into the storage the graphs captured, but the kernel
object is new: its problem descriptors and permute workspace are fresh allocations, and its quant
config points at the fresh (orphaned) scales. The eager path calls the new kernel and is right;
the graphs still read the old kernel's descriptors and write its workspace, which were freed with
it. On a GPU the next replay after a reload reads freed memory that the allocator has handed out
again, and the engine dies with an illegal memory access (with ``enforce_eager=True`` every reload
passes): https://github.com/vllm-project/vllm/issues/41670 ("Layerwise reload crashes with CUDA
illegal memory access on compressed-tensors channel-wise FP8 MoE"), confirmed on an H200 in
https://github.com/vllm-project/vllm/pull/48902 (its "MoE kernel rebuild guard"), with the same
pattern for the unquantized AITER path fixed by https://github.com/vllm-project/vllm/pull/40390
(``if self.moe_kernel is None``). The correct runner builds the kernel once, at the first load,
and a reload refreshes only the tensors the kernel reads.

What the contract could not express: nothing this bug needs (a weight update and a replay after
it). Whether the old kernel's descriptors still hold the right numbers (the offsets are the same
after every reload) depends on what the allocator did with them, which the contract leaves to the
backend. Out of its reach is the sibling kind of reload bug that corrupts both twins alike (a
stale weight loader writing checkpoint layout into a kernel-layout buffer, vLLM #42821): no rule
compares a twin updated to new weights with one made with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import (
    AddressView,
    Batch,
    StepResult,
    TargetSpec,
    batch_problems,
    kv_slot,
)
from pytest_graphmode.runtime.backends import get as get_backend

VOCAB, HIDDEN, HEADS, HEAD_DIM = 64, 32, 2, 16
EXPERTS, TOP_K, INTER = 4, 2, 32
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 48, 8
MAX_POS = BLOCK_SIZE * MAX_BLOCKS
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

SPEC = TargetSpec(
    num_blocks=NUM_BLOCKS,
    block_size=BLOCK_SIZE,
    max_blocks_per_req=MAX_BLOCKS,
    vocab_size=VOCAB,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
    null_block=0,
)
NULL_SLOT = SPEC.null_block * BLOCK_SIZE
DIRECT = ("embed", "pos_embed", "wq", "wk", "wv", "wo", "router", "lm_head")


def checkpoint(seed: int) -> dict[str, Tensor]:
    """The trainer's weights for `seed`, on the host, in checkpoint layout (HF names per expert)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> Tensor:
        return torch.randn(*shape, generator=gen) * std

    ckpt = {
        "embed": normal(VOCAB, HIDDEN, std=1.0),
        "pos_embed": normal(MAX_POS, HIDDEN, std=0.5),
        "wq": normal(HIDDEN, HIDDEN, std=HIDDEN**-0.5),
        "wk": normal(HIDDEN, HIDDEN, std=HIDDEN**-0.5),
        "wv": normal(HIDDEN, HIDDEN, std=HIDDEN**-0.5),
        "wo": normal(HIDDEN, HIDDEN, std=HIDDEN**-0.5),
        "router": normal(EXPERTS, HIDDEN, std=1.0),
        "lm_head": normal(VOCAB, HIDDEN, std=2.0 * HIDDEN**-0.5),
    }
    for e in range(EXPERTS):
        ckpt[f"experts.{e}.w1"] = normal(INTER, HIDDEN, std=HIDDEN**-0.5)
        ckpt[f"experts.{e}.w3"] = normal(INTER, HIDDEN, std=HIDDEN**-0.5)
        ckpt[f"experts.{e}.w2"] = normal(HIDDEN, INTER, std=INTER**-0.5)
    return ckpt


def quantize_per_channel(weight: Tensor) -> tuple[Tensor, Tensor]:
    """float32 [E, out, in] -> float8 codes and float32 scales [E, out, 1] (one per channel)."""
    scale = weight.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (weight / scale).to(FP8), scale


class GroupedExperts:
    """The experts' grouped-GEMM kernel object PWAL builds (CUTLASS-style).

    It owns device tensors of its own, sized once: the row where each expert's operand starts in
    the stacked w13 and w2 weights (the grouped GEMM's problem descriptors), and the workspace the
    (token, expert) pairs are permuted into, sorted by expert. Its quant config holds the scales
    it applies; the weights themselves come from the layer at each call.
    """

    def __init__(self, quant_config: dict[str, Tensor], max_tokens: int, device: torch.device):
        self.quant_config = quant_config
        experts = torch.arange(EXPERTS, device=device)
        self.w13_rows = experts * (2 * INTER)
        self.w2_rows = experts * HIDDEN
        self.permuted = torch.zeros(max_tokens * TOP_K, HIDDEN, device=device)
        self.inter_offsets = torch.arange(2 * INTER, device=device)
        self.hidden_offsets = torch.arange(HIDDEN, device=device)

    def gather(self, weight: Tensor, starts: Tensor, offsets: Tensor) -> Tensor:
        """Rows `starts[p] + offsets` of `weight` [E, out, in] for every pair p, as float32."""
        rows = (starts.unsqueeze(1) + offsets.unsqueeze(0)).reshape(-1)
        flat = weight.reshape(-1, weight.shape[-1]).view(torch.uint8)
        picked = flat.index_select(0, rows).view(FP8).float()
        return picked.view(starts.shape[0], offsets.shape[0], weight.shape[-1])

    def __call__(
        self, x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor
    ) -> Tensor:
        tokens = x.shape[0]
        pairs = tokens * TOP_K
        experts = topk_ids.reshape(pairs)
        order = torch.argsort(experts, stable=True)  # pairs grouped by expert
        sorted_experts = experts.index_select(0, order)
        permuted = self.permuted[:pairs]
        permuted.copy_(x.index_select(0, order // TOP_K))
        starts = self.w13_rows.index_select(0, sorted_experts)
        scale13 = (
            self.quant_config["w13_scale"]
            .view(-1)
            .index_select(0, (starts.unsqueeze(1) + self.inter_offsets).reshape(-1))
        )
        gate_up = self.gather(w13, starts, self.inter_offsets)
        h = torch.bmm(gate_up, permuted.unsqueeze(2)).squeeze(2) * scale13.view(pairs, -1)
        act = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
        starts2 = self.w2_rows.index_select(0, sorted_experts)
        scale2 = (
            self.quant_config["w2_scale"]
            .view(-1)
            .index_select(0, (starts2.unsqueeze(1) + self.hidden_offsets).reshape(-1))
        )
        down = self.gather(w2, starts2, self.hidden_offsets)
        y = torch.bmm(down, act.unsqueeze(2)).squeeze(2) * scale2.view(pairs, -1)
        unpermuted = torch.zeros_like(y).index_copy_(0, order, y)
        return (unpermuted.view(tokens, TOP_K, HIDDEN) * topk_weights.unsqueeze(2)).sum(1)


class Fp8MoEMethod:
    """Channel-wise FP8 MoE quant method: checkpoint-layout weights, quantized after loading."""

    def __init__(self, *, rebuild_kernel: bool, max_tokens: int) -> None:
        self.rebuild_kernel = rebuild_kernel
        self.max_tokens = max_tokens
        self.moe_kernel: GroupedExperts | None = None

    def create_weights(self, layer: FusedMoE) -> None:
        layer.w13_weight = torch.empty(EXPERTS, 2 * INTER, HIDDEN, device=layer.device)
        layer.w2_weight = torch.empty(EXPERTS, HIDDEN, INTER, device=layer.device)

    def weight_loader(self, layer: FusedMoE, name: str, loaded: Tensor) -> None:
        expert, shard = int(name.split(".")[1]), name.split(".")[2]
        if shard == "w2":
            layer.w2_weight[expert].copy_(loaded)
        else:
            half = slice(0, INTER) if shard == "w1" else slice(INTER, 2 * INTER)
            layer.w13_weight[expert, half].copy_(loaded)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        layer.w13_weight, layer.w13_scale = quantize_per_channel(layer.w13_weight)
        layer.w2_weight, layer.w2_scale = quantize_per_channel(layer.w2_weight)
        if self.moe_kernel is None or self.rebuild_kernel:
            quant_config = {"w13_scale": layer.w13_scale, "w2_scale": layer.w2_scale}
            self.moe_kernel = GroupedExperts(quant_config, self.max_tokens, layer.device)


class FusedMoE:
    """The MoE layer: float32 router, top-2 softmax routing, FP8 experts through the kernel."""

    RUNTIME = ("w13_weight", "w13_scale", "w2_weight", "w2_scale")

    def __init__(self, device: torch.device, *, rebuild_kernel: bool) -> None:
        self.device = device
        self.quant_method = Fp8MoEMethod(
            rebuild_kernel=rebuild_kernel, max_tokens=SPEC.max_num_tokens
        )
        self.w13_weight = self.w13_scale = self.w2_weight = self.w2_scale = torch.empty(
            0, device=device
        )

    def load(self, ckpt: Mapping[str, Tensor]) -> None:
        self.quant_method.create_weights(self)
        for name, tensor in ckpt.items():
            if name.startswith("experts."):
                self.quant_method.weight_loader(self, name, tensor.to(self.device))
        self.quant_method.process_weights_after_loading(self)

    def reload(self, ckpt: Mapping[str, Tensor]) -> None:
        """Layerwise reload: load and process fresh tensors, then copy them back into the ones the
        graphs captured, and hold those again."""
        kept = {name: getattr(self, name) for name in self.RUNTIME}
        self.load(ckpt)
        for name, tensor in kept.items():
            tensor.copy_(getattr(self, name))
            setattr(self, name, tensor)

    def __call__(self, x: Tensor, router: Tensor) -> Tensor:
        # Routing logits as an elementwise product and sum: each row's value does not depend on
        # how many rows the step has, so a padded replay routes every token as eager does.
        logits = (x.unsqueeze(1) * router.unsqueeze(0)).sum(-1)
        topk_logits, topk_ids = torch.topk(logits, TOP_K, dim=-1)
        topk_weights = torch.softmax(topk_logits, dim=-1)
        kernel = self.quant_method.moe_kernel
        assert kernel is not None
        return kernel(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


def rms_norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class MoEDecoder:
    """One decoder layer over a paged KV cache; weights as the loader leaves them."""

    def __init__(self, device: torch.device, *, rebuild_kernel: bool) -> None:
        self.device = device
        self.params: dict[str, Tensor] = {}
        self.moe = FusedMoE(device, rebuild_kernel=rebuild_kernel)
        self.key_positions = torch.arange(MAX_POS, device=device)
        self.block_offsets = torch.arange(BLOCK_SIZE, device=device)

    def load_weights(self, ckpt: Mapping[str, Tensor]) -> None:
        self.params = {name: ckpt[name].to(self.device) for name in DIRECT}
        self.moe.load(ckpt)

    def reload_weights(self, ckpt: Mapping[str, Tensor]) -> None:
        for name in DIRECT:  # layout-identical: written straight into the live tensors
            self.params[name].copy_(ckpt[name].to(self.device))
        self.moe.reload(ckpt)

    def forward(
        self, tokens: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, kv: Tensor
    ) -> Tensor:
        """Hidden states [T, HIDDEN] of every query token; writes each token's K/V first."""
        p = self.params
        count = tokens.shape[0]
        x = p["embed"].index_select(0, tokens) + p["pos_embed"].index_select(0, positions)
        h = rms_norm(x)
        q = (h @ p["wq"].t()).view(count, HEADS, HEAD_DIM)
        k = (h @ p["wk"].t()).view(count, HEADS, HEAD_DIM)
        v = (h @ p["wv"].t()).view(count, HEADS, HEAD_DIM)
        kv.index_copy_(0, slots, torch.stack((k, v), dim=1))
        key_slots = (tables.unsqueeze(2) * BLOCK_SIZE + self.block_offsets).view(count, MAX_POS)
        cached = kv.index_select(0, key_slots.view(-1)).view(count, MAX_POS, 2, HEADS, HEAD_DIM)
        hidden_keys = self.key_positions.unsqueeze(0) > positions.unsqueeze(1)  # [T, MAX_POS]
        cached = cached.masked_fill(hidden_keys.view(count, MAX_POS, 1, 1, 1), 0.0)
        scores = torch.einsum("thd,tkhd->thk", q, cached[:, :, 0]) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(hidden_keys.unsqueeze(1), float("-inf"))
        attn = torch.einsum("thk,tkhd->thd", torch.softmax(scores, dim=-1), cached[:, :, 1])
        x = x + attn.reshape(count, HIDDEN) @ p["wo"].t()
        return x + self.moe(rms_norm(x), p["router"])

    def logits(self, hidden: Tensor) -> Tensor:
        return rms_norm(hidden) @ self.params["lm_head"].t()


_LANE = 0xFFFFFFFF


def _scramble(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _LANE
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _LANE
    return x ^ (x >> 15)


def sample(
    logits: Tensor, seeds: Tensor, temperatures: Tensor, sampled: Tensor, positions: Tensor
) -> Tensor:
    """Greedy rows take the argmax; sampled rows Gumbel-max with noise hashed from their 32-bit
    seed, the sampled token's position and the token id: nothing depends on the batch."""
    ids = torch.arange(logits.shape[1], device=logits.device)
    h = _scramble((ids.unsqueeze(0) * 0x61C88647 + positions.unsqueeze(1)) & _LANE)
    h = _scramble(h ^ seeds.unsqueeze(1))
    uniform = ((h & 0xFFFFFF).float() + 0.5) / float(1 << 24)
    gumbel = -torch.log(-torch.log(uniform))
    drawn = torch.argmax(logits / temperatures.unsqueeze(1) + gumbel, dim=-1)
    return torch.where(sampled, drawn, torch.argmax(logits, dim=-1))


def host_inputs(batch: Batch) -> dict[str, list]:
    """Per-token and per-row inputs of `batch` as host lists."""
    cols: dict[str, list] = {k: [] for k in ("tokens", "positions", "slots", "tables", "last")}
    for key in ("seeds", "temps", "sampled", "sample_pos"):
        cols[key] = []
    for r in batch.requests:
        table = list(r.block_ids) + [SPEC.null_block] * (MAX_BLOCKS - len(r.block_ids))
        for i, token in enumerate(r.tokens):
            position = r.context_len + i
            cols["tokens"].append(token)
            cols["positions"].append(position)
            cols["slots"].append(kv_slot(r.block_ids, position, BLOCK_SIZE))
            cols["tables"].append(table)
        cols["last"].append(len(cols["tokens"]) - 1)
        cols["seeds"].append((r.seed or 0) & _LANE)
        cols["temps"].append(float(r.temperature))
        cols["sampled"].append(r.seed is not None)
        cols["sample_pos"].append(r.seq_len - 1)
    return cols


DTYPES = {
    "tokens": torch.int64,
    "positions": torch.int64,
    "slots": torch.int64,
    "tables": torch.int64,
    "seeds": torch.int64,
    "temps": torch.float32,
    "sampled": torch.bool,
    "sample_pos": torch.int64,
}
PADDING = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": [SPEC.null_block] * MAX_BLOCKS,
    "seeds": 0,
    "temps": 1.0,
    "sampled": False,
    "sample_pos": 0,
}


class LayerwiseReloadRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, rebuild_kernel: bool
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.backend = get_backend(backend)
        device = torch.device(self.backend.device)
        self.device = device
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        with torch.inference_mode():
            self.model = MoEDecoder(device, rebuild_kernel=rebuild_kernel)
            self.model.load_weights(checkpoint(seed))
            self.kv = torch.zeros(SPEC.num_slots, 2, HEADS, HEAD_DIM, device=device)
            if mode == "graph":
                self.capture()

    # -- graphs ------------------------------------------------------------------------------
    def capture(self) -> None:
        top = SPEC.capture_sizes[-1]
        for name, dtype in DTYPES.items():
            shape = (top, MAX_BLOCKS) if name == "tables" else (top,)
            self.buffers[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.stage(Batch(()), size)
            self.run_graph_body(size)  # warm-up outside the graph
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_graph_body(size)
            self.graphs[size] = graph

    def run_graph_body(self, size: int) -> tuple[Tensor, Tensor]:
        b = {name: buf[:size] for name, buf in self.buffers.items()}
        hidden = self.model.forward(b["tokens"], b["positions"], b["slots"], b["tables"], self.kv)
        logits = self.model.logits(hidden)
        tokens = sample(logits, b["seeds"], b["temps"], b["sampled"], b["sample_pos"])
        return logits, tokens

    def stage(self, batch: Batch, size: int) -> None:
        """Write the batch into the static buffers' first rows and padding into the rest."""
        cols = host_inputs(batch)
        for name, buf in self.buffers.items():
            values = cols[name] + [PADDING[name]] * (size - batch.num_reqs)
            buf[:size].copy_(torch.tensor(values, dtype=DTYPES[name]))

    def graph_size(self, batch: Batch) -> int | None:
        if self.mode != "graph" or any(q != 1 for q in batch.query_lens):
            return None
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    # -- contract ----------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        problems = batch_problems(batch, SPEC)
        if problems:
            raise ValueError("illegal batch: " + "; ".join(problems))
        with torch.inference_mode():
            size = self.graph_size(batch)
            if size is None:
                return self.eager_step(batch)
            self.stage(batch, size)
            self.graphs[size].replay()  # type: ignore[attr-defined]
            logits, tokens = self.outputs[size]
            n = batch.num_reqs
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    def eager_step(self, batch: Batch) -> StepResult:
        cols = host_inputs(batch)
        t = {k: torch.tensor(v, dtype=DTYPES.get(k, torch.int64)) for k, v in cols.items()}
        t = {k: v.to(self.device) for k, v in t.items()}
        hidden = self.model.forward(t["tokens"], t["positions"], t["slots"], t["tables"], self.kv)
        logits = self.model.logits(hidden.index_select(0, t["last"]))
        tokens = sample(logits, t["seeds"], t["temps"], t["sampled"], t["sample_pos"])
        if self.mode == "eager":
            reason = "eager twin"
        elif any(q != 1 for q in batch.query_lens):
            reason = "query longer than one token"
        else:
            reason = "more requests than the largest graph"
        return StepResult(logits, tokens, "eager", None, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"kv": self.kv}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return dict(self.buffers)

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.reload_weights(checkpoint(seed))

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()  # type: ignore[attr-defined]
        self.graphs.clear()
        self.outputs.clear()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> LayerwiseReloadRunner:
    return LayerwiseReloadRunner(mode, seed=seed, backend=backend, rebuild_kernel=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> LayerwiseReloadRunner:
    """PWAL rebuilds the experts' kernel object at every reload (vLLM #41670)."""
    return LayerwiseReloadRunner(mode, seed=seed, backend=backend, rebuild_kernel=True)
