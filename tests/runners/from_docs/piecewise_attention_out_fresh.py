"""A graph runner that captures each layer's non-attention work as graph pieces and runs attention
eagerly between them, as vLLM's piecewise CUDA graphs do.

The model is a two-layer decoder in float32 with weights drawn from the seed: token embedding plus
learned positions; per layer an RMS norm, q/k/v projections, attention over a slot-major paged KV
cache read through block tables, an output projection and a SiLU MLP; an LM head; Gumbel-max
sampling from a hash of (seed, position, token id). Graph mode flattens every batch (decode,
prefill, speculative and mixed alike) into its query tokens and pads their count up to a capture
size. For each capture size it captures, at start-up, largest size first, into one shared pool,
LAYERS + 1 pieces: piece 0 embeds and projects layer 0's q/k/v; piece i applies layer i - 1's
output projection and MLP and projects layer i's q/k/v; the last piece finishes the last layer,
computes the logits and samples. A piece ends by writing the residual stream and q/k/v into
max-size static tensors. Attention is never captured: between two replays it runs eagerly on the
step's real token count, stores the keys and values in the cache and attends over each token's
block table, so one set of pieces serves any mix of query lengths, and hands its output to the
next piece through the static `attn_out` buffer. Graphs are keyed by the padded token count; a
batch past the largest capture size runs eagerly.

    make_target:        the eager attention copies its output into the persistent max-size
                        buffer, `attn_out[:num_tokens].copy_(out)`: the very tensor the next
                        piece was captured reading.
    make_buggy_target:  the eager attention's fresh output is handed on by rebinding
                        `self.attn_out = out`. The next piece's graph holds the address it saw
                        at capture, not the attribute: that tensor was freed by the rebinding and
                        the caching allocator gives its memory to later allocations, so on a GPU
                        the piece reads whatever lives there now (another step's, layer's or
                        size's attention output when the allocator happens to hand back the same
                        block, unrelated data otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import Backend
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8, 16),  # in tokens, as vLLM's cudagraph_capture_sizes
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 2, 16, 2
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size  # positions a request can reach
NULL_SLOT = SPEC.null_block * SPEC.block_size
_MASK32 = 0xFFFFFFFF

# Per-token inputs are read at [:num_tokens], per-request ones at [:num_reqs]; padding rows point
# at the null block and at token row 0, which every padded size has.
_INPUTS: dict[str, tuple[torch.dtype, float | int | bool]] = {
    "tokens": (torch.int64, 0),
    "positions": (torch.int64, 0),
    "slots": (torch.int64, NULL_SLOT),
    "tables": (torch.int64, SPEC.null_block),
    "last": (torch.int64, 0),
    "seeds": (torch.int64, 0),
    "temperatures": (torch.float32, 1.0),
    "sampled": (torch.bool, False),
}


class Decoder:
    """Weights and the forward pass cut at attention; no host reads, so every piece captures."""

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            **{f"{name}{i}": (HIDDEN, HIDDEN) for i in range(LAYERS) for name in "qkvo"},
            **{f"up{i}": (HIDDEN, 2 * HIDDEN) for i in range(LAYERS)},
            **{f"down{i}": (2 * HIDDEN, HIDDEN) for i in range(LAYERS)},
        }
        self.device = device
        self.weights = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        """In place: the captured pieces keep reading the same tensors."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.weights["embed"][tokens] + self.weights["pos"][positions]  # [T, hidden]

    def project(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = _rms(x)
        w = self.weights
        return h @ w[f"q{layer}"], h @ w[f"k{layer}"], h @ w[f"v{layer}"]

    def finish_layer(self, layer: int, x: Tensor, attn: Tensor) -> Tensor:
        w = self.weights
        x = x + attn @ w[f"o{layer}"]
        return x + torch.nn.functional.silu(_rms(x) @ w[f"up{layer}"]) @ w[f"down{layer}"]

    def logits(self, x: Tensor) -> Tensor:
        return _rms(x) @ self.weights["head"]  # [R, vocab]


def attend(
    q: Tensor, k: Tensor, v: Tensor, inputs: Mapping[str, Tensor], kv: tuple[Tensor, Tensor]
) -> Tensor:
    """Store this step's keys and values, then attend over each token's block table. Returns a
    fresh [T, hidden] tensor, as a varlen attention kernel without `out=` does."""
    k_cache, v_cache = kv
    k_cache.index_copy_(0, inputs["slots"], k.view(-1, HEADS, HEAD_DIM))
    v_cache.index_copy_(0, inputs["slots"], v.view(-1, HEADS, HEAD_DIM))
    size = SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    context = (inputs["tables"][:, :, None] * size + offsets).flatten(1)  # [T, CONTEXT] slots
    keys, values = k_cache[context], v_cache[context]  # [T, CONTEXT, heads, dim]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inputs["positions"][:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    # Masked slots may hold anything (NaN in the null block): 0 * NaN would leak it.
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)  # [T, hidden]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def sample(logits: Tensor, positions: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """Gumbel-max from a hash of (seed, position, token id): the same request at the same position
    draws the same noise in any batch, bucket or padding."""
    key = _mix(_mix(inputs["seeds"]) ^ ((positions * 0x9E3779B1) & _MASK32))  # [R]
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])  # [R, vocab]
    # 23 bits: exact in float32, so the uniform is never 0 or 1.
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inputs["temperatures"][:, None] - torch.log(-torch.log(uniform))
    return torch.where(inputs["sampled"], noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash; every product stays below 2**63."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class PiecewiseRunner:
    """Implements the target contract; `mode="graph"` captures the pieces of every size at start-up."""

    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        rebind_attn_out: bool = False,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.rebind_attn_out = rebind_attn_out
        self.backend: Backend = get_backend(backend)
        device = self.backend.device
        self.model = Decoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = [
            (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in range(LAYERS)
        ]
        self.graphs: dict[int, list[Any]] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.buffers = self.allocate_buffers()
            self.attn_out = torch.zeros(SPEC.max_num_tokens, HIDDEN, device=device)
            self.capture()

    # -- graph mode -------------------------------------------------------------------------------

    def allocate_buffers(self) -> dict[str, Tensor]:
        device, tokens, reqs = self.backend.device, SPEC.max_num_tokens, SPEC.max_num_reqs
        rows = {"last": reqs, "seeds": reqs, "temperatures": reqs, "sampled": reqs}
        buffers = {
            name: torch.full((rows.get(name, tokens),), pad, dtype=dtype, device=device)
            for name, (dtype, pad) in _INPUTS.items()
        }
        buffers["tables"] = torch.full(
            (tokens, SPEC.max_blocks_per_req), SPEC.null_block, dtype=torch.int64, device=device
        )
        # What the pieces hand to attention: the residual stream and this layer's q/k/v.
        for name in ("residual", "q", "k", "v"):
            buffers[name] = torch.zeros(tokens, HIDDEN, device=device)
        return buffers

    def capture(self) -> None:
        """Largest first into one pool. Between two pieces the capture runs attention eagerly over
        every row, as the engine's dummy run does, so the next piece sees a filled `attn_out`."""
        pool = self.backend.graph_pool_handle()
        for size in reversed(SPEC.capture_sizes):
            self.prepare(Batch(()), size)  # every row is padding during warm-up and capture
            pieces = []
            for index in range(LAYERS + 1):
                self.run_piece(index, size)  # warm-up outside the graph
                self.backend.synchronize()
                graph = self.backend.Graph()
                with self.backend.graph(graph, pool=pool):
                    result = self.run_piece(index, size)
                pieces.append(graph)
                if index < LAYERS:
                    self.run_attention(index, size)
            assert result is not None
            self.graphs[size] = pieces
            self.outputs[size] = result

    def run_piece(self, index: int, size: int) -> tuple[Tensor, Tensor] | None:
        """Piece `index` over `size` padded tokens; the last one returns (logits, tokens)."""
        b = self.buffers
        if index == 0:
            x = self.model.embed(b["tokens"][:size], b["positions"][:size])
        else:
            x = self.model.finish_layer(index - 1, b["residual"][:size], self.attn_out[:size])
        if index == LAYERS:
            last = b["last"]
            logits = self.model.logits(x[last])  # [max_num_reqs, vocab]
            return logits, sample(logits, b["positions"][last], b)
        b["residual"][:size].copy_(x)
        for name, value in zip("qkv", self.model.project(index, x), strict=True):
            b[name][:size].copy_(value)
        return None

    def run_attention(self, layer: int, num_tokens: int) -> None:
        b = self.buffers
        inputs = {name: b[name][:num_tokens] for name in ("slots", "tables", "positions")}
        q, k, v = (b[name][:num_tokens] for name in "qkv")
        out = attend(q, k, v, inputs, self.kv[layer])
        if self.rebind_attn_out:
            self.attn_out = out
        else:
            self.attn_out[:num_tokens].copy_(out)

    def prepare(self, batch: Batch, size: int) -> None:
        """Write the batch into the inputs' prefix and reset every row after it to padding, so no
        departed request's slots or blocks are left for a padding row to touch."""
        for name, values in _rows(batch.requests).items():
            buffer = self.buffers[name]
            if values:
                buffer[: len(values)].copy_(torch.tensor(values, dtype=buffer.dtype))
            buffer[len(values) :].fill_(_INPUTS[name][1])

    def replay(self, batch: Batch) -> StepResult:
        num_tokens = batch.num_tokens
        size = next(s for s in SPEC.capture_sizes if s >= num_tokens)
        self.prepare(batch, size)
        for index, graph in enumerate(self.graphs[size]):
            graph.replay()
            if index < LAYERS:
                self.run_attention(index, num_tokens)  # the real tokens only: padding skips it
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "piecewise", ("tokens", size))

    # -- both modes -------------------------------------------------------------------------------

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        device = self.backend.device
        inputs = {
            name: torch.tensor(values, dtype=_INPUTS[name][0], device=device)
            for name, values in _rows(batch.requests).items()
        }
        x = self.model.embed(inputs["tokens"], inputs["positions"])
        for layer in range(LAYERS):
            q, k, v = self.model.project(layer, x)
            x = self.model.finish_layer(layer, x, attend(q, k, v, inputs, self.kv[layer]))
        last = inputs["last"]
        logits = self.model.logits(x[last])
        tokens = sample(logits, inputs["positions"][last], inputs)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        """Why `batch` cannot replay the pieces; None when it can."""
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.num_tokens > SPEC.capture_sizes[-1]:
            return "more tokens than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        return self.replay(batch) if reason is None else self.run_eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{kind}{i}": kv[j] for i, kv in enumerate(self.kv) for j, kind in enumerate("kv")}

    def static_buffers(self) -> Mapping[str, Tensor]:
        if self.mode == "eager":
            return {}
        return {**self.buffers, "attn_out": self.attn_out}

    def address_views(self) -> Sequence[AddressView]:
        return []  # addresses are not tracked

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for pieces in self.graphs.values():
            for graph in pieces:
                graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def _slot(request: Request, position: int) -> int:
    block = request.block_ids[position // SPEC.block_size]
    return block * SPEC.block_size + position % SPEC.block_size


def _rows(requests: Sequence[Request]) -> dict[str, list[Any]]:
    """Host values of a batch: one row per query token, or per request for the last four."""
    rows: dict[str, list[Any]] = {name: [] for name in _INPUTS}
    for request in requests:
        table = list(request.block_ids)
        table += [SPEC.null_block] * (SPEC.max_blocks_per_req - len(table))
        for i, token in enumerate(request.tokens):
            position = request.context_len + i
            rows["tokens"].append(token)
            rows["positions"].append(position)
            rows["slots"].append(_slot(request, position))
            rows["tables"].append(table)
        rows["last"].append(len(rows["tokens"]) - 1)
        sampled = request.seed is not None
        rows["seeds"].append(request.seed & _MASK32 if sampled else 0)
        rows["temperatures"].append(request.temperature if sampled else 1.0)
        rows["sampled"].append(sampled)
    return rows


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PiecewiseRunner:
    return PiecewiseRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> PiecewiseRunner:
    return PiecewiseRunner(mode, seed=seed, backend=backend, rebind_attn_out=True)
