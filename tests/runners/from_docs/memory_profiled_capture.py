"""A decode runner that sizes its KV cache by memory profiling, as vLLM's gpu_worker does.

Written against plain `torch.cuda` only (on sim the harness's drop-in stands in for it). Start-up
follows vLLM's `Worker.init_device` / `determine_available_memory` / `capture_model`:

1. an initial snapshot (`torch.cuda.mem_get_info`): the free memory must cover
   `gpu_memory_utilization * total` (vLLM: "Free memory on device ... is less than desired");
2. weights are loaded, their footprint taken from `torch.cuda.memory_allocated()`;
3. `gc.collect()`, `torch.cuda.empty_cache()`, `torch.cuda.reset_peak_memory_stats()`, then a
   dummy profile forward of `max_num_tokens` tokens (all aimed at the null block); the peak
   increase comes from `torch.cuda.memory_stats()["allocated_bytes.all.peak"]`, the non-torch
   increase from `mem_get_info` minus `memory_reserved()`;
4. the KV budget is `requested - (weights + peak + non_torch)`; it is turned into blocks and
   capped by `num_gpu_blocks_override` (the spec's block count); no budget raises;
5. the decode graphs are captured largest first into one `torch.cuda.graph_pool_handle()` pool,
   with `gc.collect()` + `torch.cuda.empty_cache()` before every capture, and the graph memory is
   measured through `mem_get_info`.

Attention writes its score matrix into a scratch buffer owned by a `WorkspaceManager` (vLLM's
v1 `WorkspaceManager`, FlashInfer's cached workspace): the buffer only grows, and growing drops the
last reference to the old buffer, runs `gc.collect()` + `torch.cuda.empty_cache()` (so the freed
memory really goes) and allocates a larger one. The graphs bake the buffer's address in. The
correct runner's profile forward runs the largest batch any step may hold (`max_num_tokens`), so
the workspace reaches its final size before the first capture and never moves again.

THE BUG (`make_buggy_target`): the profile forward is sized by the largest *capture* size (the
decode shape the graphs use) instead of `max_num_tokens`. The workspace is therefore too small for
an eager prefill or speculative step of more tokens; the first such step grows it, which frees
the buffer every captured graph writes its scores into, `empty_cache()` returns it, and the next
replay writes into memory the allocator has handed to someone else (on a GPU: silent corruption
or an illegal address at the next sync; sim reports the use after free).

Modelled on vLLM PR #46067 ("Fix dangling decode scratch when workspace grows after cudagraph
capture", https://github.com/vllm-project/vllm/pull/46067): the WorkspaceManager frees and
reallocates its buffer when it grows and calls empty_cache(), unmapping the address captured
graphs still use; and FlashInfer PRs #4399 / #4553 (workspace `resize_` after capture,
https://github.com/flashinfer-ai/flashinfer/pull/4399). The profiling flow follows vLLM's
`determine_available_memory` (issue context: vllm#50780, vllm PR #30515). No engine code copied.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NULL_BLOCK = 0
GIB = 1 << 30

SPEC = TargetSpec(
    num_blocks=24,  # num_gpu_blocks_override: the profiled budget must cover at least this
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=NULL_BLOCK,
)
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size


class WorkspaceManager:
    """One growable float32 scratch buffer handed out as views (vLLM v1's WorkspaceManager)."""

    def __init__(self) -> None:
        self._buf: Tensor | None = None
        self.grows = 0

    def get(self, shape: tuple[int, ...]) -> Tensor:
        n = math.prod(shape)
        if self._buf is None or self._buf.numel() < n:
            self._grow(n)
        assert self._buf is not None
        return self._buf[:n].view(shape)

    def _grow(self, n: int) -> None:
        # Drop the last reference first so the old block can actually be returned: the new
        # buffer is larger, and holding both at the peak is what the profile did not budget.
        self._buf = None
        gc.collect()
        torch.cuda.empty_cache()
        self._buf = torch.empty(n, dtype=torch.float32, device="cuda")
        self.grows += 1


class MemorySnapshot:
    """What vLLM's MemorySnapshot records: allocator peak, reserved bytes, driver free/total."""

    def __init__(self) -> None:
        torch.cuda.synchronize()
        self.torch_peak = torch.cuda.memory_stats().get("allocated_bytes.all.peak", 0)
        self.torch_memory = torch.cuda.memory_reserved()
        self.free_memory, self.total_memory = torch.cuda.mem_get_info()
        self.cuda_memory = self.total_memory - self.free_memory
        self.non_torch_memory = self.cuda_memory - self.torch_memory


class ProfiledRunner:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        profile_tokens: int,
        gpu_memory_utilization: float = 0.9,
        allocator_conf: str | None = "expandable_segments:True",
        memory_fraction: float | None = None,
        strict_profile_check: bool = False,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.mode, self.spec = mode, SPEC
        if allocator_conf is not None:
            with warnings.catch_warnings():
                # Deprecated in later torch for torch._C._accelerator_setAllocatorSettings; vLLM
                # still calls it by this name.
                warnings.simplefilter("ignore", FutureWarning)
                torch.cuda.memory._set_allocator_settings(allocator_conf)
        if memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(memory_fraction, 0)
        self.device = torch.device("cuda", torch.cuda.current_device())

        # 1. initial snapshot and the requested budget
        gc.collect()
        torch.cuda.empty_cache()
        self.init_snapshot = MemorySnapshot()
        self.requested_memory = int(self.init_snapshot.total_memory * gpu_memory_utilization)
        if self.init_snapshot.free_memory < self.requested_memory:
            raise ValueError(
                f"free memory {self.init_snapshot.free_memory / GIB:.2f} GiB is less than the "
                f"desired utilization {gpu_memory_utilization} ({self.requested_memory / GIB:.2f} GiB)"
            )

        # 2. weights
        allocated_before = torch.cuda.memory_allocated()
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {n: torch.empty(s, device=self.device) for n, s in shapes.items()}
        self.update_weights(seed)
        self.weights_memory = torch.cuda.memory_allocated() - allocated_before

        self.workspace = WorkspaceManager()
        rows = max(SPEC.capture_sizes)
        self.static = {
            "tokens": torch.zeros(rows, dtype=torch.int64, device=self.device),
            "positions": torch.zeros(rows, dtype=torch.int64, device=self.device),
            "slots": torch.zeros(rows, dtype=torch.int64, device=self.device),
            "tables": torch.zeros(
                rows, SPEC.max_blocks_per_req, dtype=torch.int64, device=self.device
            ),
        }

        # 3. profile run with a dummy KV cache of one block (every dummy token writes the null block)
        self.k_cache = torch.zeros(SPEC.block_size, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = MemorySnapshot()
        self._profile_run(profile_tokens)
        gc.collect()
        torch.cuda.empty_cache()
        after = MemorySnapshot()
        torch_peak_increase = after.torch_peak - before.torch_peak
        non_torch_increase = after.non_torch_memory - before.non_torch_memory
        # Nobody else may have released memory while we profiled (vLLM's sanity check, in the
        # form that tolerates an allocator that does not move the driver's free count).
        # vLLM <= 0.11 asserts strictly (`init free > free after`); `strict_profile_check` does so.
        if after.free_memory > self.init_snapshot.free_memory or (
            strict_profile_check and after.free_memory == self.init_snapshot.free_memory
        ):
            raise AssertionError(
                f"Error in memory profiling: initial free memory {self.init_snapshot.free_memory}, "
                f"free memory after profiling {after.free_memory} bytes (another process released "
                f"memory during start-up)"
            )
        non_kv = self.weights_memory + torch_peak_increase + non_torch_increase
        available = self.requested_memory - non_kv
        if available <= 0:
            raise ValueError("No available memory for the cache blocks")
        block_bytes = 2 * SPEC.block_size * HEADS * HEAD_DIM * 4
        profiled_blocks = available // block_bytes
        if profiled_blocks < SPEC.num_blocks:
            raise ValueError(f"budget holds {profiled_blocks} blocks, {SPEC.num_blocks} needed")
        self.num_blocks = SPEC.num_blocks  # the override caps what the profile allows
        self.kv_budget = {"available": available, "profiled_blocks": profiled_blocks}

        # 4. the real KV cache (the dummy one goes first)
        self.k_cache = self.v_cache = None  # type: ignore[assignment]
        gc.collect()
        torch.cuda.empty_cache()
        slots = self.num_blocks * SPEC.block_size
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=self.device)

        # 5. graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.graph_memory = 0
        if mode == "graph":
            self._capture_all()

    # -- start-up ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def _profile_run(self, tokens: int) -> None:
        z = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        tables = torch.zeros(tokens, SPEC.max_blocks_per_req, dtype=torch.int64, device=self.device)
        self._forward(z, z, z, tables)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._write_static(Batch(()), size)
            inputs = self._static_inputs(size)
            for _ in range(2):  # warm-up outside the graph
                self._forward(*inputs)
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(*inputs)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.graph_memory = free_before - torch.cuda.mem_get_info()[0]

    def _static_inputs(self, size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        s = self.static
        return s["tokens"][:size], s["positions"][:size], s["slots"][:size], s["tables"][:size]

    def _write_static(self, batch: Batch, size: int) -> None:
        toks, pos, slots, tables = [], [], [], []
        for r in batch.requests:
            toks.append(r.tokens[0])
            pos.append(r.context_len)
            slots.append(kv_slot(r.block_ids, r.context_len, SPEC.block_size))
            tables.append(
                list(r.block_ids) + [NULL_BLOCK] * (SPEC.max_blocks_per_req - len(r.block_ids))
            )
        for _ in range(size - len(toks)):  # padding rows: the null block only
            toks.append(0)
            pos.append(0)
            slots.append(NULL_BLOCK * SPEC.block_size)
            tables.append([NULL_BLOCK] * SPEC.max_blocks_per_req)
        s = self.static
        s["tokens"][:size].copy_(torch.tensor(toks, dtype=torch.int64))
        s["positions"][:size].copy_(torch.tensor(pos, dtype=torch.int64))
        s["slots"][:size].copy_(torch.tensor(slots, dtype=torch.int64))
        s["tables"][:size].copy_(torch.tensor(tables, dtype=torch.int64))

    # -- the model --------------------------------------------------------------------------------

    def _forward(
        self, tokens: Tensor, positions: Tensor, slots: Tensor, tables: Tensor
    ) -> tuple[Tensor, Tensor]:
        w = self.weights
        t = tokens.shape[0]
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = (x @ w[n] for n in "qkv")
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        bs = SPEC.block_size
        width = tables.shape[1] * bs
        context = (tables[:, :, None] * bs + torch.arange(bs, device=tokens.device)).flatten(1)
        keys, values = self.k_cache[context], self.v_cache[context]  # [T, C, H, D]
        visible = torch.arange(width, device=tokens.device)[None, :] <= positions[:, None]
        # Scores go into the shared workspace: [T*H, 1, C] (the graphs bake its address in).
        scores = self.workspace.get((t * HEADS, 1, width))
        qh = q.view(t * HEADS, 1, HEAD_DIM)
        kt = keys.permute(0, 2, 3, 1).reshape(t * HEADS, HEAD_DIM, width)
        torch.bmm(qh, kt, out=scores)
        probs = (scores.view(t, HEADS, width) / math.sqrt(HEAD_DIM)).masked_fill(
            ~visible[:, None, :], float("-inf")
        )
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        attended = torch.einsum("thc,tchd->thd", probs.softmax(-1), values).flatten(1)
        logits = (x + attended @ w["o"]) @ w["head"]
        return logits, logits.argmax(-1)

    # -- steps ------------------------------------------------------------------------------------

    def capture_size(self, n: int) -> int | None:
        return next((s for s in sorted(SPEC.capture_sizes) if s >= n), None)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if any(q != 1 for q in batch.query_lens):
            return "speculative decode"
        if self.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        n = batch.num_reqs
        if reason is None:
            size = self.capture_size(n)
            assert size is not None
            self._write_static(batch, size)
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
        toks, pos, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            table = list(r.block_ids) + [NULL_BLOCK] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for i, tok in enumerate(r.tokens):
                toks.append(tok)
                pos.append(r.context_len + i)
                slots.append(kv_slot(r.block_ids, r.context_len + i, SPEC.block_size))
                tables.append(table)
            last.append(len(toks) - 1)
        if not toks:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(
                empty,
                torch.zeros(0, dtype=torch.int64, device=self.device),
                "eager",
                None,
                reason=reason,
            )
        dev = self.device
        logits, tokens = self._forward(
            torch.tensor(toks, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            torch.tensor(slots, dtype=torch.int64, device=dev),
            torch.tensor(tables, dtype=torch.int64, device=dev),
        )
        index = torch.tensor(last, dtype=torch.int64, device=dev)
        return StepResult(logits[index], tokens[index], "eager", None, reason=reason)

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return dict(self.static) if self.graphs else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ProfiledRunner:
    # Profile the largest batch a step may hold: the workspace reaches its final size before capture.
    return ProfiledRunner(mode, seed=seed, profile_tokens=SPEC.max_num_tokens)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> ProfiledRunner:
    # BUG: profiled at the largest capture size; an eager step of more tokens grows (frees and
    # reallocates) the workspace every captured graph writes its attention scores into.
    return ProfiledRunner(mode, seed=seed, profile_tokens=max(SPEC.capture_sizes))
