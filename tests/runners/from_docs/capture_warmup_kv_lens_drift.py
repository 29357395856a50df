"""A TensorRT-LLM-style decode runner whose forward corrects its own inputs in place, with one bug.

The engine mechanism (TensorRT-LLM's PyTorch backend, `PyTorchModelEngine` with the overlap
scheduler and one-model speculative decoding, and `CUDAGraphRunner.capture`): the host prepares
step N+1 while step N still runs, so for a request that was in step N it cannot know how many of
step N's draft tokens were accepted. It prepares that request's position ids and KV length as if
every draft was accepted (the KV space for them is reserved anyway), and the forward itself starts
with a small preprocessing pass (`_preprocess_inputs`) that adds a per-request correction to the
position ids and to the attention metadata's `kv_lens_cuda`, in place, on the device. Because that
pass is part of the forward, it is part of every captured graph too, and the graph mutates its own
inputs each time it runs. That is harmless while the host rewrites those inputs before every run.
A graph is captured the first time a `(batch size, draft length)` key is needed, on the live
batch: two eager warm-up forwards on the prepared inputs, the capture, then the replay, with no
re-preparation in between (the replay re-copies input ids and position ids, not the attention
metadata).

Here: a one-layer float32 decoder (token + learned position embedding, two-head attention over a
slot-major paged KV cache through block tables, SiLU MLP, LM head). Position ids feed the position
embedding; the corrected KV length of a row decides where each of its query tokens stores its key
and value (`kv_len - query_len + i`) and how far it attends. In the contract the harness decides
acceptance and tells the runner through the next `context_len`, so the correction for a request
that was in the previous step is `context_len - (previous context_len + previous query length)`,
zero after a plain decode or a prefill chunk and negative after a speculative step that rejected
drafts; every other request gets zero. The runner stages it into the persistent offsets buffer the
forward reads (in the engine it comes from the previous step's sampler on the device). Uniform
generation batches of up to 4 rows (every request continuing, all with the same query length,
1 + 0..4 drafts) pad to 1, 2 or 4 rows and replay the graph of their key, captured lazily into one
shared pool; padding rows have query length 0 and point at the null block. Everything else runs
eagerly through the same forward, once per step. Sampling runs after the forward, outside the
graph, with Gumbel noise hashed from (seed, position of the last query token, token id).

The bug (`make_buggy_target`, `restore_inputs_after_warmup=False`): the capture runs the forward
twice on the same prepared inputs and then captures, without putting the inputs back. Each warm-up
adds the correction again, so the second warm-up stores this step's keys and values
`|correction|` positions early (over the request's own cached context) and the replay that
follows reads a KV length off by twice the correction. It shows only on the step that captures a
key, and only for a row whose previous step was speculative and rejected drafts. Reported as
NVIDIA/TensorRT-LLM nvbugs 5485325 and fixed by PR #7373, "Add a postprocess to the model engine
to fix the CUDA graph warmup issue when using speculative decoding"
(https://github.com/NVIDIA/TensorRT-LLM/pull/7373, cherry-picked to the 1.0 release in
https://github.com/NVIDIA/TensorRT-LLM/pull/7737): "there will be two warmup iterations using the
same inputs, so the attention metadata will be changed after each forward". That fix subtracts the
correction again after each warm-up and after the capture; later `cuda_graph_runner.py`
(`_save_spec_decode_capture_state` / `_restore_spec_decode_capture_state`) saves `kv_lens_cuda`
before the warm-ups and copies it back after each warm-up and after the capture. The correct
runner here does the latter for both inputs the forward mutates: copying back a saved copy is
right whether or not a pass actually ran (a capture records the add without running it).
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
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),  # padded batch sizes (requests), as TensorRT-LLM's graph batch sizes
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_DRAFT = 4  # graphs exist for 0..MAX_DRAFT draft tokens per request
MAX_ROWS, MAX_QUERY = max(SPEC.capture_sizes), 1 + MAX_DRAFT
MAX_SEQ = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
WARMUP_STEPS = 2  # eager forwards on the capture inputs before the capture, as the engine does
_M32 = 0xFFFFFFFF


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_SEQ, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: the captured graphs read these tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


class OverlapSpecRunner:
    def __init__(
        self, mode: str, *, seed: int, backend: str, restore_inputs_after_warmup: bool = True
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        self.restore_inputs_after_warmup = restore_inputs_after_warmup
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        # the host's view of the last step: req_id -> (context_len, query_len)
        self.last_step: dict[int, tuple[int, int]] = {}
        self.graphs: dict[tuple[int, int], Any] = {}
        self.graph_logits: dict[tuple[int, int], Tensor] = {}
        self.pool: Any = None
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.pool = self.be.graph_pool_handle()
            i64 = {"dtype": torch.int64, "device": dev}
            self.buffers = {  # shared by every graph, sliced per key
                "input_ids": torch.zeros(MAX_ROWS, MAX_QUERY, **i64),
                "position_ids": torch.zeros(MAX_ROWS, MAX_QUERY, **i64),
                "query_lens": torch.zeros(MAX_ROWS, **i64),
                "kv_lens": torch.zeros(MAX_ROWS, **i64),
                "len_offsets": torch.zeros(MAX_ROWS, **i64),
                "block_tables": torch.zeros(MAX_ROWS, SPEC.max_blocks_per_req, **i64),
            }

    # -- the model --------------------------------------------------------------------------------

    def forward(self, ids, positions, query_lens, kv_lens, len_offsets, tables) -> Tensor:
        """Logits at each row's last query token; rows are [rows, query] padded token grids."""
        # _preprocess_inputs: the overlap scheduler's correction, in place on the step's inputs
        positions.add_(len_offsets[:, None])
        kv_lens.add_(len_offsets)

        w, bs = self.w.t, SPEC.block_size
        rows, width = ids.shape
        col = torch.arange(width, device=ids.device)
        valid = col[None, :] < query_lens[:, None]
        seq_pos = kv_lens[:, None] - query_lens[:, None] + col[None, :]  # each token's position
        table_col = (seq_pos // bs).clamp(0, SPEC.max_blocks_per_req - 1)  # within the table row
        slots = tables.gather(1, table_col) * bs + seq_pos % bs
        slots = torch.where(valid, slots, torch.full_like(slots, NULL_SLOT))

        x = w["embed"][ids] + w["pos"][positions.clamp(0, MAX_SEQ - 1)]
        h = _norm(x)
        q = (h @ w["wq"]).view(rows, width, HEADS, HEAD_DIM)
        k = (h @ w["wk"]).view(rows, width, HEADS, HEAD_DIM)
        v = (h @ w["wv"]).view(rows, width, HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, slots.flatten(), k.flatten(0, 1))
        self.v_cache.index_copy_(0, slots.flatten(), v.flatten(0, 1))

        # every position of the row's table, causally masked by the corrected KV length
        kv_col = torch.arange(MAX_SEQ, device=ids.device)
        ctx_slots = tables[:, kv_col // bs] * bs + kv_col % bs  # [rows, MAX_SEQ]
        sees = valid[:, :, None] & (kv_col[None, None, :] <= seq_pos[:, :, None])
        any_sees = sees.any(1)[:, :, None, None]  # unwritten slots (NaN in the null block) -> 0
        zero = torch.zeros((), device=ids.device)
        keys = torch.where(any_sees, self.k_cache[ctx_slots], zero)
        vals = torch.where(any_sees, self.v_cache[ctx_slots], zero)
        scores = torch.einsum("rqhd,rjhd->rqhj", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(
            sees[:, :, None, :], scores, torch.full((), -math.inf, device=x.device)
        )
        probs = torch.where(sees[:, :, None, :], scores.softmax(-1), zero)
        attn = torch.einsum("rqhj,rjhd->rqhd", probs, vals).flatten(2)
        x = x + attn @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        last = (query_lens - 1).clamp(min=0)
        x_last = x.gather(1, last[:, None, None].expand(rows, 1, HIDDEN)).squeeze(1)
        return _norm(x_last) @ w["head"]

    # -- host-side preparation (the engine's _prepare_tp_inputs) ----------------------------------

    def len_offset(self, req: Request) -> tuple[int, int]:
        """(context length the host assumes, correction) for one request."""
        last = self.last_step.get(req.req_id)
        if last is not None and last[0] + 1 <= req.context_len <= last[0] + last[1]:
            assumed = last[0] + last[1]  # every token of its last step kept, drafts included
            return assumed, req.context_len - assumed
        return req.context_len, 0  # not in the last step's batch: prepared exactly

    def host_inputs(self, batch: Batch, rows: int, width: int) -> dict[str, list]:
        ids, pos, qlens, kvlens, offsets, tables = [], [], [], [], [], []
        for r in range(rows):
            if r < batch.num_reqs:
                req = batch.requests[r]
                assumed, offset = self.len_offset(req)
                q = len(req.tokens)
                ids.append(list(req.tokens) + [0] * (width - q))
                pos.append([assumed + i for i in range(width)])
                qlens.append(q)
                kvlens.append(assumed + q)
                offsets.append(offset)
                blocks = list(req.block_ids)
            else:  # graph padding row: no query tokens, every table entry the null block
                ids.append([0] * width)
                pos.append(list(range(width)))
                qlens.append(0)
                kvlens.append(0)
                offsets.append(0)
                blocks = []
            tables.append(blocks + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(blocks)))
        return {
            "input_ids": ids,
            "position_ids": pos,
            "query_lens": qlens,
            "kv_lens": kvlens,
            "len_offsets": offsets,
            "block_tables": tables,
        }

    def device_inputs(self, host: dict[str, list]) -> dict[str, Tensor]:
        return {k: torch.tensor(v, dtype=torch.int64, device=self.device) for k, v in host.items()}

    # -- steps ------------------------------------------------------------------------------------

    def graph_key(self, batch: Batch) -> tuple[tuple[int, int] | None, str]:
        if self.mode == "eager":
            return None, "eager twin"
        lens = set(batch.query_lens)
        if len(lens) != 1 or any(r.context_len == 0 for r in batch.requests):
            return None, "context or mixed batch"
        if batch.num_reqs > MAX_ROWS:
            return None, "more requests than the largest graph"
        width = lens.pop()
        if width > MAX_QUERY:
            return None, "query longer than 1 + MAX_DRAFT tokens"
        rows = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        return (rows, width), ""

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        if n == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        key, reason = self.graph_key(batch)
        if key is None:
            width = max(batch.query_lens)
            inputs = self.device_inputs(self.host_inputs(batch, n, width))
            logits = self.forward(*(inputs[name] for name in self.buffers_order()))
            path, graph_key = "eager", None
        else:
            rows, width = key
            step_inputs = self.device_inputs(self.host_inputs(batch, rows, width))
            self.prepare_metadata(step_inputs, rows)
            if key not in self.graphs:  # captured on this live batch, the first time it is needed
                self.copy_input_ids(step_inputs, rows, width)
                self.capture(key)
            self.replay(key, step_inputs)
            logits = self.graph_logits[key][:n].clone()
            path, graph_key, reason = "full", ("decode", rows, width - 1), None
        self.last_step = {r.req_id: (r.context_len, len(r.tokens)) for r in batch.requests}
        return StepResult(logits, self.sample(logits, batch.requests), path, graph_key, reason)

    @staticmethod
    def buffers_order() -> tuple[str, ...]:
        return ("input_ids", "position_ids", "query_lens", "kv_lens", "len_offsets", "block_tables")

    def graph_inputs(self, rows: int, width: int) -> list[Tensor]:
        b = self.buffers
        return [
            b["input_ids"][:rows, :width],
            b["position_ids"][:rows, :width],
            b["query_lens"][:rows],
            b["kv_lens"][:rows],
            b["len_offsets"][:rows],
            b["block_tables"][:rows],
        ]

    def prepare_metadata(self, step_inputs: dict[str, Tensor], rows: int) -> None:
        """attn_metadata.prepare(): lengths, offsets and block tables, once per step."""
        for name in ("query_lens", "kv_lens", "len_offsets", "block_tables"):
            self.buffers[name][:rows].copy_(step_inputs[name])

    def copy_input_ids(self, step_inputs: dict[str, Tensor], rows: int, width: int) -> None:
        """What the graph runner's replay copies in: input ids and position ids."""
        self.buffers["input_ids"][:rows, :width].copy_(step_inputs["input_ids"])
        self.buffers["position_ids"][:rows, :width].copy_(step_inputs["position_ids"])

    def capture(self, key: tuple[int, int]) -> None:
        """Capture on the live batch's prepared inputs (warm-ups first, as torch asks)."""
        rows, width = key
        inputs = self.graph_inputs(rows, width)
        positions, kv_lens = inputs[1], inputs[3]
        saved = (positions.clone(), kv_lens.clone())

        def restore() -> None:
            # the forward added the correction to its own inputs: put back what was prepared
            if self.restore_inputs_after_warmup:
                positions.copy_(saved[0])
                kv_lens.copy_(saved[1])

        for _ in range(WARMUP_STEPS):
            self.forward(*inputs)
            restore()
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=self.pool):
            logits = self.forward(*inputs)
        restore()
        self.graphs[key], self.graph_logits[key] = graph, logits

    def replay(self, key: tuple[int, int], step_inputs: dict[str, Tensor]) -> None:
        rows, width = key
        self.copy_input_ids(step_inputs, rows, width)
        self.graphs[key].replay()

    def sample(self, logits: Tensor, reqs: Sequence[Request]) -> Tensor:
        dev = self.device
        seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], dtype=torch.int64, device=dev)
        positions = torch.tensor([r.seq_len - 1 for r in reqs], dtype=torch.int64, device=dev)
        sampled = torch.tensor([r.seed is not None for r in reqs], device=dev)
        temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
        key = _mix(_mix(seeds) ^ ((positions * 0x9E3779B1) & _M32))
        ids = torch.arange(logits.shape[-1], device=dev)
        bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
        uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
        return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_logits.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OverlapSpecRunner:
    return OverlapSpecRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> OverlapSpecRunner:
    return OverlapSpecRunner(mode, seed=seed, backend=backend, restore_inputs_after_warmup=False)
