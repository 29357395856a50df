"""A TensorRT-LLM-style one-model speculative decoding runner with in-graph sampling.

Design (after ``tensorrt_llm/_torch/pyexecutor``: ``CUDAGraphRunner``, ``PyTorchModelEngine``'s
generation-only CUDA graph warmup, ``SpecMetadata.populate_sampling_params_for_one_model``):

- One ``ModelEngine`` per twin, written against plain ``torch.cuda`` (graphs, pool, device
  ``"cuda"``), so it runs on a GPU and in the sim's drop-in alike.
- Generation-only batches (every request continues a cached sequence with at most
  ``1 + MAX_DRAFT`` query tokens) run on CUDA graphs keyed, as in TensorRT-LLM, by
  ``(batch_size, draft_len, is_all_greedy_sample)``; anything with a context request runs
  eagerly. A batch is padded to the next captured batch size with one replicated dummy
  generation request (``CUDA_GRAPH_DUMMY_REQUEST_ID``'s role) that owns only the null block, and
  every row is padded to ``1 + draft_len`` query tokens ("CUDA graph spec decode padding"); the
  padding tokens store their keys in the null block.
- Static ``input_ids`` / ``position_ids`` are shared by every graph (sliced per key); each graph
  has its own attention metadata, whose device buffers come from a named buffer pool that
  shares reserved blocks between graphs (``memory_buffer_utils.Buffers``), and its own
  ``SpecMetadata``, made by ``create_cuda_graph_metadata``: a shallow ``copy.copy`` of the live
  metadata with its buffers re-allocated in ``__post_init__``. ``maybe_get_cuda_graph`` reseats
  that cached copy as the step's spec metadata and ``populate`` fills its per-row sampling
  buffers (temperature, top-k, top-p, seed) before each replay.
- Sampling runs in the graph (one-model speculative decoding samples inside the target graph):
  an argmax fast path for all-greedy batches and an "advanced" temperature / top-k / top-p path
  otherwise, chosen in Python from ``is_all_greedy_sample``, which is part of the graph key.
  Greedy rows in an advanced batch get a vanishing temperature, as TensorRT-LLM's
  ``DISABLE_TEMP_VAL``. The noise is Gumbel noise hashed from (seed, position, token).
- Warmup captures every key in two passes: a greedy pass, then the advanced-sampling pass, which
  sets the capture-only override ``_force_non_greedy_for_capture`` on the live SpecMetadata so
  that the parameter-less dummy requests scan as non-greedy (synthetic temperature 0.7, top-k
  50, top-p 0.9) and the advanced branch is the one recorded.

The bug (``make_buggy_target``), NVIDIA/TensorRT-LLM PR #17033, "[TRTLLM-14779][fix] Clear
capture-only sampling override from cached CUDA graph metadata",
https://github.com/NVIDIA/TensorRT-LLM/pull/17033 (the fix added
``CUDAGraphRunner.clear_capture_only_spec_state``): ``create_cuda_graph_metadata`` shallow-copies
the live SpecMetadata while the advanced-sampling capture pass has set the override on it, so
every graph captured in that pass caches a copy with the flag set. The pass clears the flag on
the live object only. The copies are reseated as the step's spec metadata at every replay, so
``_scan_one_model_sampling`` takes the capture branch at serving time and replaces every row's
sampling parameters with the synthetic capture values: sampled requests sample at temperature
0.7 with top-k 50 and top-p 0.9 whatever they asked for, and greedy rows beside them sample too.
All-greedy batches replay the argmax graphs, whose copies were made in the greedy pass, and are
unaffected; eager steps use the live object and are unaffected.

What the contract could not express: requests carry no top-k / top-p (only a temperature and a
seed), so top-k and top-p are always disabled for real requests and show only through the
capture values; the drafts come from the harness and acceptance is the harness's, so the
runner is the target half of one-model speculative decoding (no draft head, no acceptance
kernel), and it samples one token per request, at its last query token, not one per draft.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pytest_graphmode import AddressView, Batch, StepResult, TargetSpec
from pytest_graphmode.contract import kv_slot

DEVICE = "cuda"
BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_BLOCKS_PER_REQ = 8
MAX_SEQ_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
VOCAB = 128
HIDDEN = 32
HEADS = 2
HEAD_DIM = HIDDEN // HEADS
MAX_NUM_REQS = 8
MAX_NUM_TOKENS = 32
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8)
MAX_DRAFT = 2
NULL_BLOCK = 0
NULL_SLOT = NULL_BLOCK * BLOCK_SIZE

# TensorRT-LLM's values for "disabled" and the capture pass's synthetic sampling parameters.
DISABLE_TEMP_VAL = 1e-5
DISABLE_TOPK_VAL = 2**31 - 1
DISABLE_TOPP_VAL = 1.0
CAPTURE_SAMPLING_PARAMS = (0.7, 50, 0.9)

SPEC = TargetSpec(
    num_blocks=NUM_BLOCKS,
    block_size=BLOCK_SIZE,
    max_blocks_per_req=MAX_BLOCKS_PER_REQ,
    vocab_size=VOCAB,
    max_num_reqs=MAX_NUM_REQS,
    max_num_tokens=MAX_NUM_TOKENS,
    capture_sizes=CUDA_GRAPH_BATCH_SIZES,
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=NULL_BLOCK,
)


@dataclass(frozen=True)
class Row:
    """One scheduled request as the engine sees it (an ``LlmRequest``'s few fields)."""

    tokens: tuple[int, ...]
    context_len: int
    block_ids: tuple[int, ...]
    seed: int | None = None  # None: greedy (no sampling parameters)
    temperature: float | None = None
    is_generation: bool = True
    is_dummy: bool = False

    @staticmethod
    def from_request(r: Any) -> Row:
        temperature = None if r.seed is None else r.temperature
        return Row(r.tokens, r.context_len, r.block_ids, r.seed, temperature, r.context_len > 0)

    @staticmethod
    def dummy(num_tokens: int) -> Row:
        """A generation request that owns the null block only (padding and warmup)."""
        return Row(tokens=(1,) * num_tokens, context_len=0, block_ids=(), is_dummy=True)


class Buffers:
    """Named device buffers shared between graph metadata (``memory_buffer_utils.Buffers``)."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[list[Any]]] = {}  # name -> [[uint8 buffer, reserved], ...]

    def get_buffer(
        self, shape: Sequence[int], dtype: torch.dtype, name: str, reserve: bool
    ) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        candidates = self.blocks.setdefault(name, [])
        best = None
        for block in candidates:
            if block[0].numel() < nbytes:
                continue
            if best is None or block[0].numel() < best[0].numel():
                if best is not None and best[1] and not block[1]:
                    continue  # prefer a reserved block
                best = block
        if reserve and best is not None:
            best[1] = True
            return best[0][:nbytes].view(dtype).view(*shape)
        candidates[:] = [block for block in candidates if block[1]]
        block = [torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE), reserve]
        candidates.append(block)
        return block[0][:nbytes].view(dtype).view(*shape)


class AttentionMetadata:
    """Per-step paged-attention metadata; graph instances keep fixed device buffers."""

    def __init__(self, num_rows: int, tokens_per_row: int, buffers: Buffers | None) -> None:
        self.num_rows = num_rows
        self.tokens_per_row = tokens_per_row
        self.is_cuda_graph = buffers is not None
        shapes = {
            "slot_mapping": ((num_rows * tokens_per_row,), torch.int64),
            "block_table": ((num_rows, MAX_BLOCKS_PER_REQ), torch.int64),
            "gather_ids": ((num_rows,), torch.int64),
        }
        self.tensors: dict[str, torch.Tensor] = {}
        if buffers is not None:
            for name, (shape, dtype) in shapes.items():
                self.tensors[name] = buffers.get_buffer(shape, dtype, name, reserve=True)

    @staticmethod
    def create_cuda_graph_metadata(
        num_rows: int, draft_len: int, buffers: Buffers
    ) -> AttentionMetadata:
        return AttentionMetadata(num_rows, 1 + draft_len, buffers)

    def prepare(self, rows: Sequence[Row]) -> None:
        """Write every row's slots, block table and gather index (padding rows included)."""
        t = self.tokens_per_row
        slots: list[int] = []
        tables: list[list[int]] = []
        gather: list[int] = []
        for r, row in enumerate(rows):
            q = len(row.tokens)
            for j in range(t):
                if row.is_dummy:
                    slots.append(NULL_SLOT + min(j, q - 1))
                elif j < q:
                    slots.append(kv_slot(row.block_ids, row.context_len + j, BLOCK_SIZE))
                else:
                    slots.append(NULL_SLOT)
            blocks = list(row.block_ids)
            tables.append(blocks + [NULL_BLOCK] * (MAX_BLOCKS_PER_REQ - len(blocks)))
            gather.append(r * t + q - 1)
        values = {"slot_mapping": slots, "block_table": tables, "gather_ids": gather}
        for name, value in values.items():
            host = torch.tensor(value, dtype=torch.int64)
            if self.is_cuda_graph:
                self.tensors[name].copy_(host.to(DEVICE))
            else:
                self.tensors[name] = host.to(DEVICE)


class SpecMetadata:
    """One-model speculative decoding metadata: the sampler's per-row parameters."""

    _force_non_greedy_for_capture = False  # set on the live object by the capture pass

    def __init__(self, max_num_requests: int) -> None:
        self.max_num_requests = max_num_requests
        self.is_cuda_graph = False
        self.is_all_greedy_sample = True
        self.__post_init__()

    def __post_init__(self) -> None:
        n = self.max_num_requests
        self.temperatures = torch.ones(n, dtype=torch.float32, device=DEVICE)
        self.top_ks = torch.zeros(n, dtype=torch.int64, device=DEVICE)
        self.top_ps = torch.ones(n, dtype=torch.float32, device=DEVICE)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=DEVICE)

    def create_cuda_graph_metadata(self, max_batch_size: int) -> SpecMetadata:
        if self.is_cuda_graph:
            return self
        graph_metadata = copy.copy(self)  # shallow: instance attributes come along
        graph_metadata.is_cuda_graph = True
        graph_metadata.max_num_requests = max_batch_size
        graph_metadata.__post_init__()
        return graph_metadata

    def buffers(self) -> dict[str, torch.Tensor]:
        names = ("temperatures", "top_ks", "top_ps", "seeds")
        return {name: getattr(self, name) for name in names}

    def _scan_one_model_sampling(self, rows: Sequence[Row]) -> list[tuple[float, int, float]]:
        """Normalize each row's parameters and set ``is_all_greedy_sample`` (honoring the
        warmup capture override)."""
        normalized = []
        all_greedy = True
        for row in rows:
            greedy = row.seed is None
            temperature = DISABLE_TEMP_VAL if greedy else float(row.temperature or 1.0)
            normalized.append((temperature, DISABLE_TOPK_VAL, DISABLE_TOPP_VAL))
            all_greedy &= greedy
        self.is_all_greedy_sample = all_greedy
        if self._force_non_greedy_for_capture:
            self.is_all_greedy_sample = False
            normalized = [CAPTURE_SAMPLING_PARAMS for _ in normalized]
        return normalized

    def update_is_all_greedy_sample(self, rows: Sequence[Row]) -> None:
        """Refresh the flag the graph key is built from, before the key is built."""
        self._scan_one_model_sampling(rows)

    def populate_sampling_params(self, rows: Sequence[Row]) -> None:
        normalized = self._scan_one_model_sampling(rows)
        if self.is_all_greedy_sample:
            return  # the argmax branch reads none of the buffers
        seeds = [0 if row.seed is None else row.seed & 0x7FFFFFFF for row in rows]
        columns = (*zip(*normalized, strict=True), seeds)
        for buffer, values in zip(self.buffers().values(), columns, strict=True):
            buffer[: len(rows)].copy_(torch.tensor(values, dtype=buffer.dtype).to(DEVICE))


def _make_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    d = HIDDEN
    return {
        "embed": rnd(VOCAB, d, scale=1.0),
        "pos": rnd(MAX_SEQ_LEN, d, scale=0.5),
        "wqkv": rnd(d, 3 * d, scale=d**-0.5),
        "wo": rnd(d, d, scale=d**-0.5),
        "w1": rnd(d, 4 * d, scale=d**-0.5),
        "w2": rnd(4 * d, d, scale=(4 * d) ** -0.5),
        "lm_head": rnd(d, VOCAB, scale=4 * d**-0.5),
    }


def _gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise hashed from (seed, position, token): the same in any batch or replay."""
    mask = 0x7FFFFFFF
    h = (seeds[:, None] * 0x2545F491 + positions[:, None] * 0x6C8E9CF5) & mask
    h = (h ^ (vocab_ids[None, :] * 0x1B873593)) & mask
    for mult in (0x45D9F3B, 0x2C1B3C6D):
        h = ((h ^ (h >> 15)) * mult) & mask
    h = h ^ (h >> 13)
    u = ((h & 0xFFFFFF).to(torch.float32) + 0.5) / float(1 << 24)
    return -torch.log(-torch.log(u))


class Model:
    """A one-layer decoder over a slot-major paged KV cache, with the one-model sampler."""

    def __init__(self, seed: int) -> None:
        self.weights = {k: v.to(DEVICE) for k, v in _make_weights(seed).items()}
        slots = NUM_BLOCKS * BLOCK_SIZE
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=DEVICE)
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device=DEVICE)
        self.key_pos = torch.arange(MAX_SEQ_LEN, device=DEVICE)
        self.key_block = self.key_pos // BLOCK_SIZE
        self.key_offset = self.key_pos % BLOCK_SIZE
        self.vocab_ids = torch.arange(VOCAB, device=DEVICE)

    def load_weights(self, seed: int) -> None:
        for name, value in _make_weights(seed).items():
            self.weights[name].copy_(value.to(DEVICE))  # in place: graphs keep reading it

    def forward(self, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        attn: AttentionMetadata = inputs["attn_metadata"]
        spec: SpecMetadata = inputs["spec_metadata"]
        input_ids, position_ids = inputs["input_ids"], inputs["position_ids"]
        w, md = self.weights, attn.tensors
        r, t = attn.num_rows, attn.tokens_per_row
        x = w["embed"][input_ids] + w["pos"][position_ids]
        q, k, v = (x @ w["wqkv"]).split(HIDDEN, dim=-1)
        self.k_cache.index_copy_(0, md["slot_mapping"], k.reshape(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, md["slot_mapping"], v.reshape(-1, HEADS, HEAD_DIM))
        slots = md["block_table"][:, self.key_block] * BLOCK_SIZE + self.key_offset
        qpos = position_ids.view(r, t)
        key_ok = (self.key_pos[None, :] <= qpos[:, -1:])[..., None, None]
        keys = torch.where(key_ok, self.k_cache[slots], 0.0)
        values = torch.where(key_ok, self.v_cache[slots], 0.0)
        scores = torch.einsum("rthd,rlhd->rhtl", q.reshape(r, t, HEADS, HEAD_DIM), keys)
        causal = self.key_pos[None, None, :] <= qpos[:, :, None]
        scores = scores.mul(HEAD_DIM**-0.5).masked_fill(~causal[:, None], float("-inf"))
        out = torch.einsum("rhtl,rlhd->rthd", scores.softmax(-1), values).reshape(r * t, HIDDEN)
        x = x + out @ w["wo"]
        x = x + torch.nn.functional.silu(x @ w["w1"]) @ w["w2"]
        gather = md["gather_ids"]
        logits = x[gather] @ w["lm_head"]
        return logits, self.sample(logits, spec, position_ids[gather])

    def sample(
        self, logits: torch.Tensor, spec: SpecMetadata, positions: torch.Tensor
    ) -> torch.Tensor:
        if spec.is_all_greedy_sample:  # a Python branch: each graph records one of the two
            return logits.argmax(-1)
        n = logits.shape[0]
        scaled = logits / spec.temperatures[:n, None]
        sorted_vals = scaled.sort(dim=-1, descending=True).values
        top_k = spec.top_ks[:n].clamp(1, VOCAB)
        in_top_k = self.vocab_ids[None, :] < top_k[:, None]
        probs = torch.where(in_top_k, sorted_vals, float("-inf")).softmax(-1)
        keep = in_top_k & ((probs.cumsum(-1) - probs) <= spec.top_ps[:n, None])
        threshold = torch.where(keep, sorted_vals, float("inf")).amin(-1, keepdim=True)
        masked = torch.where(scaled >= threshold, scaled, float("-inf"))
        return (masked + _gumbel(spec.seeds[:n], positions, self.vocab_ids)).argmax(-1)


class CUDAGraphRunner:
    """Padding, eligibility, capture and replay of the generation graphs."""

    WARMUP_STEPS = 2

    def __init__(self, engine: ModelEngine) -> None:
        self.engine = engine
        self.graphs: dict[tuple[int, int, bool], Any] = {}
        self.graph_outputs: dict[tuple[int, int, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self.graph_metadata: dict[tuple[int, int, bool], dict[str, Any]] = {}
        self.memory_pool = torch.cuda.graph_pool_handle()
        self.cuda_graph_meta_buffers = Buffers()
        self.padding_dummy_request: Row | None = None
        self._capture_allowed = False
        max_tokens = CUDA_GRAPH_BATCH_SIZES[-1] * (1 + MAX_DRAFT)
        self.shared_static_tensors = {
            "input_ids": torch.ones(max_tokens, dtype=torch.int64, device=DEVICE),
            "position_ids": torch.zeros(max_tokens, dtype=torch.int64, device=DEVICE),
        }

    @staticmethod
    def can_run_cuda_graph(rows: Sequence[Row]) -> bool:
        return (
            0 < len(rows) <= CUDA_GRAPH_BATCH_SIZES[-1]
            and all(row.is_generation for row in rows)
            and all(len(row.tokens) <= 1 + MAX_DRAFT for row in rows)
        )

    def get_graph_key(self, batch_size: int, draft_len: int) -> tuple[int, int, bool]:
        return (batch_size, draft_len, self.engine.spec_metadata.is_all_greedy_sample)

    def maybe_get_cuda_graph(
        self, rows: Sequence[Row], draft_len: int
    ) -> tuple[bool, AttentionMetadata | None, SpecMetadata | None, tuple[int, int, bool] | None]:
        key = self.get_graph_key(len(rows), draft_len)
        if key in self.graph_metadata:
            stored = self.graph_metadata[key]
            return True, stored["attn_metadata"], stored["spec_metadata"], key
        if not self._capture_allowed or len(rows) not in CUDA_GRAPH_BATCH_SIZES:
            return False, None, None, None
        attn = AttentionMetadata.create_cuda_graph_metadata(
            len(rows), draft_len, self.cuda_graph_meta_buffers
        )
        spec = self.engine.spec_metadata.create_cuda_graph_metadata(len(rows))
        self.graph_metadata[key] = {"attn_metadata": attn, "spec_metadata": spec}
        return True, attn, spec, key

    def needs_capture(self, key: tuple[int, int, bool]) -> bool:
        return self._capture_allowed and key not in self.graph_outputs

    @contextlib.contextmanager
    def allow_capture(self) -> Iterator[None]:
        self._capture_allowed = True
        try:
            yield
        finally:
            self._capture_allowed = False

    @contextlib.contextmanager
    def pad_batch(self, rows: list[Row], draft_len: int) -> Iterator[list[Row]]:
        """Pad with the replicated dummy request up to the next captured batch size."""
        idx = bisect.bisect_left(CUDA_GRAPH_BATCH_SIZES, len(rows))
        padding = CUDA_GRAPH_BATCH_SIZES[idx] - len(rows)
        if padding:
            if self.padding_dummy_request is None or (
                len(self.padding_dummy_request.tokens) != 1 + draft_len
            ):
                self.padding_dummy_request = Row.dummy(1 + draft_len)
            rows.extend([self.padding_dummy_request] * padding)
        try:
            yield rows
        finally:
            if padding:
                del rows[-padding:]

    def _static_inputs(self, key: tuple[int, int, bool]) -> dict[str, torch.Tensor]:
        num_tokens = key[0] * (1 + key[1])
        return {name: t[:num_tokens] for name, t in self.shared_static_tensors.items()}

    def capture(self, key: tuple[int, int, bool], forward_fn: Any, initial: dict) -> None:
        inputs = dict(initial)
        inputs.update(self._static_inputs(key))
        for _ in range(self.WARMUP_STEPS):
            forward_fn(inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            output = forward_fn(inputs)
        self.graphs[key] = graph
        self.graph_outputs[key] = output
        self.memory_pool = graph.pool()

    def replay(self, key: tuple[int, int, bool], current: dict) -> tuple[torch.Tensor, ...]:
        stored = self.graph_metadata[key]
        assert current["attn_metadata"] is stored["attn_metadata"]
        assert current["spec_metadata"] is stored["spec_metadata"]
        for name, static in self._static_inputs(key).items():
            static.copy_(current[name])
        self.graphs[key].replay()
        return self.graph_outputs[key]

    def clear_capture_only_spec_state(self) -> int:
        """The fix of PR #17033: clear the capture pass's override from the cached copies."""
        cleared = 0
        for stored in self.graph_metadata.values():
            spec = stored["spec_metadata"]
            if spec is not None and spec._force_non_greedy_for_capture:
                spec._force_non_greedy_for_capture = False
                cleared += 1
        return cleared

    def static_buffers(self) -> dict[str, torch.Tensor]:
        out = dict(self.shared_static_tensors)
        for key, stored in self.graph_metadata.items():
            name = "_".join(str(int(part)) for part in key)
            for field, tensor in stored["attn_metadata"].tensors.items():
                out[f"attn{name}.{field}"] = tensor
            for field, tensor in stored["spec_metadata"].buffers().items():
                out[f"spec{name}.{field}"] = tensor
        return out

    def clear(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_outputs.clear()
        self.graph_metadata.clear()


class ModelEngine:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, clear_capture_override: bool
    ) -> None:
        self.spec = SPEC
        self.use_cuda_graph = mode == "graph"
        self.clear_capture_override = clear_capture_override
        with torch.inference_mode():
            self.model = Model(seed)
            self.spec_metadata = SpecMetadata(MAX_NUM_REQS)  # the live one
            self.cuda_graph_runner = CUDAGraphRunner(self)
            if self.use_cuda_graph:
                self._capture_generation_cuda_graphs()

    # -- warmup ---------------------------------------------------------------------------

    def _capture_generation_cuda_graphs(self) -> None:
        runner = self.cuda_graph_runner
        graphs_to_capture = [
            (bs, draft_len)
            for bs in sorted(CUDA_GRAPH_BATCH_SIZES, reverse=True)
            for draft_len in (0, MAX_DRAFT)
        ]

        def run_capture_pass(force_non_greedy: bool) -> None:
            spec = self.spec_metadata
            if force_non_greedy:
                spec._force_non_greedy_for_capture = True
                spec.is_all_greedy_sample = False
            try:
                for bs, draft_len in graphs_to_capture:
                    self.forward([Row.dummy(1 + draft_len)] * bs)
                    torch.cuda.synchronize()
            finally:
                if force_non_greedy:
                    spec._force_non_greedy_for_capture = False  # the live object only

        with runner.allow_capture():
            run_capture_pass(force_non_greedy=False)  # argmax graphs
            run_capture_pass(force_non_greedy=True)  # advanced-sampling graphs
        if self.clear_capture_override:
            runner.clear_capture_only_spec_state()
        self.spec_metadata.is_all_greedy_sample = True

    # -- one forward ----------------------------------------------------------------------

    def _prepare_inputs(
        self, rows: Sequence[Row], tokens_per_row: int, attn: AttentionMetadata, spec: SpecMetadata
    ) -> dict[str, Any]:
        ids: list[int] = []
        positions: list[int] = []
        for row in rows:
            q = len(row.tokens)
            ids += list(row.tokens) + [1] * (tokens_per_row - q)
            positions += [row.context_len + min(j, q - 1) for j in range(tokens_per_row)]
        attn.prepare(rows)
        spec.populate_sampling_params(rows)
        return {
            "input_ids": torch.tensor(ids, dtype=torch.int64).to(DEVICE),
            "position_ids": torch.tensor(positions, dtype=torch.int64).to(DEVICE),
            "attn_metadata": attn,
            "spec_metadata": spec,
        }

    def forward(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        runner = self.cuda_graph_runner
        n = len(rows)
        self.spec_metadata.update_is_all_greedy_sample(rows)
        if self.use_cuda_graph and runner.can_run_cuda_graph(rows):
            draft_len = 0 if all(len(row.tokens) == 1 for row in rows) else MAX_DRAFT
            with runner.pad_batch(rows, draft_len) as padded:
                ok, attn, spec, key = runner.maybe_get_cuda_graph(padded, draft_len)
                if ok:
                    inputs = self._prepare_inputs(padded, 1 + draft_len, attn, spec)
                    if runner.needs_capture(key):
                        runner.capture(key, self.model.forward, inputs)
                    logits, tokens = runner.replay(key, inputs)
                    return logits[:n].clone(), tokens[:n].clone(), key
        tokens_per_row = max(len(row.tokens) for row in rows)
        attn = AttentionMetadata(n, tokens_per_row, None)
        inputs = self._prepare_inputs(rows, tokens_per_row, attn, self.spec_metadata)
        logits, tokens = self.model.forward(inputs)
        return logits, tokens, None

    # -- the contract ---------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            rows = [Row.from_request(request) for request in batch.requests]
            logits, tokens, key = self.forward(rows)
        if key is None:
            reason = "graphs disabled" if not self.use_cuda_graph else "not generation-only"
            return StepResult(logits, tokens, "eager", None, reason)
        return StepResult(logits, tokens, "full", key)

    def state(self) -> Mapping[str, torch.Tensor]:
        return {"k0": self.model.k_cache, "v0": self.model.v_cache}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return self.cuda_graph_runner.static_buffers() if self.use_cuda_graph else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load_weights(seed)

    def close(self) -> None:
        self.cuda_graph_runner.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ModelEngine:
    # `backend` is not the engine's business: on sim the harness's drop-in is active around it.
    return ModelEngine(mode, seed=seed, clear_capture_override=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ModelEngine:
    return ModelEngine(mode, seed=seed, clear_capture_override=False)
