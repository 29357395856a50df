"""A two-stage pipeline-parallel runner in one process, one graph per stage and batch size.

The runner
----------
The model (a Llama-like decoder of two layers over a paged KV cache) is split the way vLLM's and
SGLang's pipeline-parallel workers split it: stage 0 (the first "rank") holds the embedding and
layer 0, stage 1 (the last "rank") layer 1, the final norm, the LM head and the sampler. Each stage
owns its layer's KV cache and runs on a stream of its own, standing in for its own device. Layers
carry a residual stream in vLLM's style (`hidden, residual = layer(hidden, residual)`, the add
fused into the next norm), so what stage 0 hands to stage 1 is an `IntermediateTensors`-like dict
of two tensors, `hidden_states` and `residual`, one row per token.

Every step is padded to a token bucket (`CAPTURE_SIZES`; prefill, mixed, speculative and decode
steps alike, as vLLM V1 pads to `cudagraph_capture_sizes`) and each stage replays its own FULL
graph of that size: stage 0's graph on stage 0's stream, then stage 1's graph on stage 1's stream
once that stream has waited for stage 0's (the "send/recv"); the current stream waits for stage 1
before the results are copied out. A step past the largest bucket runs both stages eagerly. Stage
1's graphs cannot read stage 0's graph outputs (those are another graph's memory, and on a real
pipeline they arrive by a receive into fresh tensors), so the graph twin keeps persistent
intermediate buffers of the largest shape (`max_num_tokens` rows each, vLLM's
`self.intermediate_tensors`, SGLang's `pp_proxy_tensors`), and stage 1's graph of size S reads
their first S rows. Before each stage-1 replay the runner copies what stage 0 produced into those
rows (the loop vLLM later moved into `sync_and_slice_intermediate_tensors`). The graph twin's eager
fallback goes through the same buffers (vLLM's `execute_model` does, whatever the step's size); the
eager twin hands stage 0's tensors to stage 1 directly. Sampling is counter-based (a hash of seed,
position and token id), so the graphs bake in no random state. Graphs are captured at construction,
largest first, each stage's in a private pool.

The bug
-------
`make_buggy_target` has the hand-off that vLLM V1 shipped in
https://github.com/vllm-project/vllm/pull/13353 ("[V1][PP] Cache Intermediate Tensors"): to make
CUDA graphs work it passes stage 1 slices of the cached max-size intermediate buffers instead of
the tensors received from the previous stage, but never copies the received values into them. The
stage-1 graph (and the eager fallback, which reads the same slices) computes from whatever the
buffers held: zeros from their allocation, the harness's poison. Fixed by
https://github.com/vllm-project/vllm/pull/13417 ("[V1][PP] Fix intermediate tensor values": "#13353
cached the intermediate tensors to make CUDA graph work. However, we forgot to copy the values of
intermediate tensors to the cached tensors."), which adds the per-key
`self.intermediate_tensors[k][:num_input_tokens].copy_(v[:num_input_tokens])` loop.

What the contract could not express
-----------------------------------
A real pipeline sends the intermediates between processes; here both stages live in one process
and "receiving" is reading stage 0's output. Micro-batches in flight across the stages (stage 0 of
step N+1 overlapping stage 1 of step N) are not modelled beyond the harness's pipelined pairs:
both stages read one set of input buffers, so each step's stages are ordered behind the step
before. The harness's ranks are data-parallel, so nothing checks two pipeline ranks against each
other; the comparison is the graph twin's pipeline against the eager twin's.
"""

from __future__ import annotations

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
from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.backends import GraphHandle
from pytest_graphmode.runtime.model import (
    PAD_POSITION,
    PAD_SLOT,
    PAD_TOKEN,
    SEQ_LEN_FILL,
    DecoderConfig,
    DecoderInputs,
    init_weights,
    paged_attention,
    sample,
)
from pytest_graphmode.runtime.model.ops import (
    apply_rope,
    rms_norm,
    rope_angles,
    rope_inv_freq,
    silu_mlp,
)

CONFIG = DecoderConfig(
    vocab_size=128,
    hidden=32,
    layers=2,  # one per pipeline stage
    heads=2,
    kv_heads=1,
    head_dim=16,
    mlp=64,
    block_size=4,
    num_blocks=48,
    max_blocks_per_req=8,
)
CAPTURE_SIZES = (1, 2, 4, 8, 16)  # token buckets
MAX_NUM_REQS = 8
MAX_NUM_TOKENS = 32
INTERMEDIATE_KEYS = ("hidden_states", "residual")

# The packed integer inputs, at their largest shapes; both stages read them.
_FIELDS: tuple[tuple[str, int], ...] = (
    ("token_ids", MAX_NUM_TOKENS),
    ("positions", MAX_NUM_TOKENS),
    ("slot_mapping", MAX_NUM_TOKENS),
    ("query_start", MAX_NUM_REQS + 1),
    ("seq_lens", MAX_NUM_REQS),
    ("block_tables", MAX_NUM_REQS * CONFIG.max_blocks_per_req),
    ("seeds", MAX_NUM_REQS),
)

Intermediates = dict[str, Tensor]


def _rows_for(num_tokens: int) -> int:
    """Request rows of a bucket: every request has at least one token."""
    return min(num_tokens, MAX_NUM_REQS)


class Stage:
    """One pipeline stage's layer, its own KV cache and its slice of the weights."""

    def __init__(self, index: int, weights: dict[str, Tensor], device: torch.device) -> None:
        c = CONFIG
        self.index = index
        self.w = weights
        self.kv_cache = torch.zeros(
            (c.num_slots, 1, 2, c.kv_heads, c.head_dim), dtype=torch.float32, device=device
        )
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, device)

    def layer(
        self, hidden: Tensor, residual: Tensor | None, inputs: DecoderInputs
    ) -> Intermediates:
        """vLLM's decoder layer: the residual add fused into the input norm, carried along."""
        c, p = CONFIG, f"layers.{self.index}."
        n = hidden.shape[0]
        residual = hidden if residual is None else hidden + residual
        h = rms_norm(residual, self.w[p + "attn_norm"])
        q, k, v = (h @ self.w[p + "qkv"]).split(
            [c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], dim=-1
        )
        cos, sin = rope_angles(inputs.positions, self.inv_freq)
        q = apply_rope(q.view(n, c.heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(n, c.kv_heads, c.head_dim), cos, sin)
        v = v.view(n, c.kv_heads, c.head_dim)
        attended = paged_attention(
            0, q, k, v, inputs, self.kv_cache, block_size=c.block_size, null_block=c.null_block
        )
        residual = residual + attended.reshape(n, c.heads * c.head_dim) @ self.w[p + "out"]
        h = rms_norm(residual, self.w[p + "mlp_norm"])
        hidden = silu_mlp(h, self.w[p + "gate_up"], self.w[p + "down"])
        return {"hidden_states": hidden, "residual": residual}


class PipelineStageGraphRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, copy_intermediates: bool
    ) -> None:
        self.mode = mode
        self.copy_intermediates = copy_intermediates
        self.spec = TargetSpec(
            num_blocks=CONFIG.num_blocks,
            block_size=CONFIG.block_size,
            max_blocks_per_req=CONFIG.max_blocks_per_req,
            vocab_size=CONFIG.vocab_size,
            max_num_reqs=MAX_NUM_REQS,
            max_num_tokens=MAX_NUM_TOKENS,
            capture_sizes=CAPTURE_SIZES,
            features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
            null_block=CONFIG.null_block,
        )
        self.backend = backends.get(backend)
        self.backend.activate()
        self._closed = False
        try:
            with torch.inference_mode():
                self._build(seed)
        except BaseException:
            self.backend.deactivate()
            raise

    def _build(self, seed: int) -> None:
        device = self.backend.device
        self.weights = {name: w.to(device=device) for name, w in init_weights(CONFIG, seed).items()}
        self.stages = (Stage(0, self.weights, device), Stage(1, self.weights, device))
        self.packed = torch.zeros(sum(n for _, n in _FIELDS), dtype=torch.int64, device=device)
        self.views: dict[str, Tensor] = {}
        start = 0
        for name, n in _FIELDS:
            self.views[name] = self.packed[start : start + n]
            start += n
        self.temperatures = torch.ones(MAX_NUM_REQS, dtype=torch.float32, device=device)
        self.adapter_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        # Stage 1's persistent inputs from stage 0, at the largest step's shape.
        self.intermediates: Intermediates = {
            key: torch.zeros(MAX_NUM_TOKENS, CONFIG.hidden, dtype=torch.float32, device=device)
            for key in INTERMEDIATE_KEYS
        }
        self.graphs: dict[int, tuple[GraphHandle, Intermediates, GraphHandle, Tensor, Tensor]] = {}
        if self.mode == "graph":
            self.streams = (self.backend.Stream(), self.backend.Stream())
            self._capture()

    # ---- the two stages ------------------------------------------------------------------

    def _inputs(self, num_tokens: int, num_reqs: int) -> DecoderInputs:
        v = self.views
        return DecoderInputs(
            token_ids=v["token_ids"][:num_tokens],
            positions=v["positions"][:num_tokens],
            slot_mapping=v["slot_mapping"][:num_tokens],
            query_start=v["query_start"][: num_reqs + 1],
            seq_lens=v["seq_lens"][:num_reqs],
            block_tables=v["block_tables"][: num_reqs * CONFIG.max_blocks_per_req].view(
                num_reqs, CONFIG.max_blocks_per_req
            ),
            adapter_ids=self.adapter_ids[:num_reqs],
        )

    def _first_stage(self, inputs: DecoderInputs) -> Intermediates:
        token_ids = inputs.token_ids.clamp(0, CONFIG.vocab_size - 1)
        embedded = self.weights["embed"].index_select(0, token_ids)
        return self.stages[0].layer(embedded, None, inputs)

    def _last_stage(self, inputs: DecoderInputs, received: Intermediates) -> tuple[Tensor, Tensor]:
        out = self.stages[1].layer(received["hidden_states"], received["residual"], inputs)
        num_tokens = out["hidden_states"].shape[0]
        last = (inputs.query_start[1:] - 1).clamp(0, num_tokens - 1)
        final = (out["hidden_states"] + out["residual"]).index_select(0, last)
        logits = rms_norm(final, self.weights["final_norm"]) @ self.weights["lm_head"]
        num_reqs = inputs.seq_lens.shape[0]
        seeds = self.views["seeds"][:num_reqs]
        tokens = sample(logits, seeds, self.temperatures[:num_reqs], inputs.seq_lens)
        return logits, tokens

    def _hand_off(self, sent: Intermediates, num_tokens: int) -> Intermediates:
        """Stage 1's view of what stage 0 sent: the persistent buffers' first rows."""
        if self.copy_intermediates:
            for key, buffer in self.intermediates.items():
                buffer[:num_tokens].copy_(sent[key][:num_tokens])
        return {key: buffer[:num_tokens] for key, buffer in self.intermediates.items()}

    # ---- graphs --------------------------------------------------------------------------

    def _capture(self) -> None:
        s0, s1 = self.streams
        for size in sorted(CAPTURE_SIZES, reverse=True):
            rows = _rows_for(size)
            self._stage_inputs(Batch(()))  # every row padding
            inputs = self._inputs(size, rows)
            s0.wait_stream(self.backend.current_stream())
            with self.backend.stream(s0):  # warm-up, outside the graphs
                sent = self._first_stage(inputs)
            s1.wait_stream(s0)
            with self.backend.stream(s1):
                self._last_stage(inputs, self._hand_off(sent, size))
            self.backend.synchronize()
            del sent
            first = self.backend.Graph()
            with self.backend.graph(first, stream=s0):
                sent = self._first_stage(inputs)
            last = self.backend.Graph()
            received = {key: buffer[:size] for key, buffer in self.intermediates.items()}
            with self.backend.graph(last, stream=s1):
                logits, tokens = self._last_stage(inputs, received)
            self.graphs[size] = (first, sent, last, logits, tokens)
        self.backend.synchronize()

    # ---- host side -----------------------------------------------------------------------

    def _stage_inputs(self, batch: Batch) -> None:
        """Write the batch into the inputs' prefix and every other row as padding (one upload of
        the whole buffers, so no row keeps an earlier step's values)."""
        mb = CONFIG.max_blocks_per_req
        host = {
            "token_ids": [PAD_TOKEN] * MAX_NUM_TOKENS,
            "positions": [PAD_POSITION] * MAX_NUM_TOKENS,
            "slot_mapping": [PAD_SLOT] * MAX_NUM_TOKENS,
            "query_start": [0] * (MAX_NUM_REQS + 1),
            "seq_lens": [SEQ_LEN_FILL] * MAX_NUM_REQS,
            "block_tables": [CONFIG.null_block] * (MAX_NUM_REQS * mb),
            "seeds": [-1] * MAX_NUM_REQS,
        }
        temperatures = [1.0] * MAX_NUM_REQS
        row = 0
        for index, request in enumerate(batch.requests):
            for offset, token in enumerate(request.tokens):
                position = request.context_len + offset
                host["token_ids"][row] = token
                host["positions"][row] = position
                host["slot_mapping"][row] = kv_slot(request.block_ids, position, CONFIG.block_size)
                row += 1
            host["query_start"][index + 1] = row
            host["seq_lens"][index] = request.seq_len
            host["block_tables"][index * mb : index * mb + len(request.block_ids)] = list(
                request.block_ids
            )
            host["seeds"][index] = -1 if request.seed is None else request.seed
            temperatures[index] = request.temperature
        for index in range(batch.num_reqs + 1, MAX_NUM_REQS + 1):
            host["query_start"][index] = row  # padding requests hold no tokens
        flat = [value for name, _ in _FIELDS for value in host[name]]
        self.packed.copy_(torch.tensor(flat, dtype=torch.int64))
        self.temperatures.copy_(torch.tensor(temperatures, dtype=torch.float32))

    def _replay(self, size: int) -> tuple[Tensor, Tensor]:
        s0, s1 = self.streams
        first, sent, last, logits, tokens = self.graphs[size]
        current = self.backend.current_stream()
        s0.wait_stream(current)  # the inputs were written on the current stream
        with self.backend.stream(s0):
            first.replay()
        s1.wait_stream(s0)  # stage 0's output has arrived
        with self.backend.stream(s1):
            self._hand_off(sent, size)
            last.replay()
        current.wait_stream(s1)
        return logits, tokens

    # ---- the contract --------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        problems = batch_problems(batch, self.spec)
        if problems:
            raise ValueError("; ".join(problems))
        n, num_tokens = batch.num_reqs, batch.num_tokens
        with torch.inference_mode():
            size = next((s for s in CAPTURE_SIZES if s >= num_tokens), None)
            if self.mode == "graph" and size is not None:
                self._stage_inputs(batch)
                logits, tokens = self._replay(size)
                path, key, reason = "full", ("pp_stages", size), None
            else:
                self._stage_inputs(batch)
                inputs = self._inputs(num_tokens, n)
                sent = self._first_stage(inputs)
                if self.mode == "graph":  # the graph twin's fallback reads the buffers too
                    sent = self._hand_off(sent, num_tokens)
                logits, tokens = self._last_stage(inputs, sent)
                path, key = "eager", None
                reason = None if self.mode == "eager" else f"{num_tokens} tokens past the graphs"
            return StepResult(logits[:n].clone(), tokens[:n].clone(), path, key, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {
            f"kv_stage{stage.index}": stage.kv_cache.view(CONFIG.num_slots, -1)
            for stage in self.stages
        }

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode != "graph":
            return {}
        return {**self.views, "temperatures": self.temperatures, **self.intermediates}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            for name, fresh in init_weights(CONFIG, seed).items():
                self.weights[name].copy_(fresh)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.backend.synchronize()
            for first, _, last, _, _ in self.graphs.values():
                first.reset()
                last.reset()
            self.graphs.clear()
        finally:
            self.backend.deactivate()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PipelineStageGraphRunner:
    return PipelineStageGraphRunner(mode, seed=seed, backend=backend, copy_intermediates=True)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PipelineStageGraphRunner:
    return PipelineStageGraphRunner(mode, seed=seed, backend=backend, copy_intermediates=False)
