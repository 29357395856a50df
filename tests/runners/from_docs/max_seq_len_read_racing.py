"""A graph runner that uploads metadata on a copy stream and sizes eager attention by max seq_len.

A two-layer decoder (token embedding plus learned positions, attention over a slot-major paged
KV cache read through per-token block tables, a SiLU MLP, an LM head; float32, weights drawn
from the seed). Every step, on both paths, stages its metadata (tokens, positions, slot mapping,
block table, seq_lens, sampling parameters) in pinned host buffers and uploads it with
non_blocking copies on a dedicated copy stream into persistent device buffers, as engines with
asynchronous input preparation do; the compute stream (the caller's current stream) waits on an
event recorded after the copies before it runs anything that reads them. Graph mode captures one
decode graph per capture size (1, 2, 4 requests of one token each) at start-up, largest first
into one pool, keyed by that size; a decode step writes its rows and padding rows that point at
the null block, then replays the smallest graph that fits. Everything else (prefills, mixed and
speculative steps, more requests than the largest graph) runs eagerly from the same device
buffers, and its attention gathers only as many block-table columns as the batch's longest
sequence needs: a host integer that sizes the kernel, as varlen attention's `max_seqlen_k` does.

    make_target:        the longest sequence is computed on the host from the batch
                        (`max(r.seq_len for r in batch.requests)`), independently of the upload.
    make_buggy_target:  it is read back from the device buffer (`int(seq_lens[:n].max())`) on
                        the compute stream right after the copies were issued on the copy
                        stream, before the compute stream waits for their event. On a GPU the
                        read can run before the copy lands and see the previous step's seq_lens
                        (or whatever the buffer held): a prefill after shorter sequences then
                        gathers too few columns and its newest keys drop out of attention.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM, LAYERS = 32, 2, 16, 2
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
_MASK32 = 0xFFFFFFFF

# name: (shape, dtype, padding value). Token rows first, then request rows.
_BUFFERS: dict[str, tuple[tuple[int, ...], torch.dtype, Any]] = {
    "tokens": ((SPEC.max_num_tokens,), torch.int64, 0),
    "positions": ((SPEC.max_num_tokens,), torch.int64, 0),
    "slots": ((SPEC.max_num_tokens,), torch.int64, SPEC.null_block * SPEC.block_size),
    "tables": (
        (SPEC.max_num_tokens, SPEC.max_blocks_per_req),
        torch.int64,
        [SPEC.null_block] * SPEC.max_blocks_per_req,
    ),
    "seq_lens": ((SPEC.max_num_reqs,), torch.int64, 1),  # a padding row sees its own null slot
    "last": ((SPEC.max_num_reqs,), torch.int64, 0),
    "seeds": ((SPEC.max_num_reqs,), torch.int64, 0),
    "temperatures": ((SPEC.max_num_reqs,), torch.float32, 1.0),
    "sampled": ((SPEC.max_num_reqs,), torch.bool, False),
}


class Uploader:
    """Pinned host rows and their persistent device copies, uploaded on a copy stream."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.host = {
            name: backend.empty_pinned(shape, dtype=dtype)
            for name, (shape, dtype, _) in _BUFFERS.items()
        }
        self.dev = {
            name: torch.zeros(shape, dtype=dtype, device=backend.device)
            for name, (shape, dtype, _) in _BUFFERS.items()
        }
        self.stream = backend.Stream()
        self.uploaded = backend.Event()

    def upload(self, rows: Mapping[str, list[Any]]) -> None:
        """Issue the copies; the caller's stream must wait for `uploaded` before reading them."""
        self.uploaded.synchronize()  # the last upload has read the pinned rows
        for name, values in rows.items():
            if values:
                host = self.host[name]
                host[: len(values)].copy_(torch.tensor(values, dtype=host.dtype))
        # The last step's kernels have read the device rows (and the harness is done with them).
        self.stream.wait_stream(self.backend.current_stream())
        with self.backend.stream(self.stream):
            for name, values in rows.items():
                if values:
                    n = len(values)
                    self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)
            self.uploaded.record()

    def wait(self) -> None:
        self.backend.current_stream().wait_event(self.uploaded)


class TinyDecoder:
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
        """In place: captured graphs keep reading the same tensors."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    def forward(
        self,
        kv: list[tuple[Tensor, Tensor]],
        tokens: Tensor,  # [T]
        positions: Tensor,  # [T]
        slots: Tensor,  # [T]
        tables: Tensor,  # [T, columns] block table row of each token's request
        visible: Tensor,  # [T] keys at context index < visible are attended
    ) -> Tensor:
        w = self.weights
        x = w["embed"][tokens] + w["pos"][positions]  # [T, hidden]
        for i, (k_cache, v_cache) in enumerate(kv):
            h = _rms(x)
            q, k, v = (h @ w[f"{n}{i}"] for n in "qkv")
            k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
            v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
            x = x + _attention(q, k_cache, v_cache, tables, visible) @ w[f"o{i}"]
            x = x + torch.nn.functional.silu(_rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        return x

    def head(self, x: Tensor) -> Tensor:
        return _rms(x) @ self.weights["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, visible: Tensor
) -> Tensor:
    size = SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    context = (tables[:, :, None] * size + offsets).flatten(1)  # [T, columns * size] slots
    keys, values = k_cache[context], v_cache[context]  # [T, C, heads, dim]
    mask = torch.arange(context.shape[1], device=q.device)[None, :] < visible[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
    # The null block holds NaN: 0 * NaN would leak into valid rows.
    values = torch.where(mask[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)  # [T, hidden]


def sample(
    logits: Tensor, positions: Tensor, seeds: Tensor, temperatures: Tensor, sampled: Tensor
) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): no generator, so the same
    request at the same position draws the same noise in any batch, bucket or replay."""
    key = _mix(_mix(seeds) ^ ((positions * 0x9E3779B1) & _MASK32))  # [R]
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])  # [R, vocab]
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24  # in (0, 1), exact
    noisy = logits / temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def _rows(requests: Sequence[Request], pad_to: int) -> dict[str, list[Any]]:
    """Host rows of every buffer: one a query token, one a request. Rows past the batch up to
    `pad_to` are padding (decode graphs only, where a request is one token)."""
    rows: dict[str, list[Any]] = {name: [] for name in _BUFFERS}
    for request in requests:
        table = list(request.block_ids)
        table += [SPEC.null_block] * (SPEC.max_blocks_per_req - len(table))
        for i, token in enumerate(request.tokens):
            position = request.context_len + i
            rows["tokens"].append(token)
            rows["positions"].append(position)
            rows["slots"].append(kv_slot(request.block_ids, position, SPEC.block_size))
            rows["tables"].append(table)
        sampled = request.seed is not None
        rows["seq_lens"].append(request.seq_len)
        rows["last"].append(len(rows["tokens"]) - 1)
        rows["seeds"].append(request.seed & _MASK32 if sampled else 0)
        rows["temperatures"].append(request.temperature if sampled else 1.0)
        rows["sampled"].append(sampled)
    for _ in range(pad_to - len(requests)):
        for name, (_, _, padding) in _BUFFERS.items():
            rows[name].append(padding)
    return rows


class MetadataUploadRunner:
    """`mode="graph"` captures decode graphs at start-up; `read_back_lengths` is the bug."""

    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        read_back_lengths: bool = False,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.read_back_lengths = read_back_lengths
        self.backend: Any = get_backend(backend)
        device = self.backend.device
        self.model = TinyDecoder(seed, device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = [
            (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in range(LAYERS)
        ]
        self.inputs = Uploader(self.backend)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            self.capture()

    # -- graph mode -------------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.inputs.upload(_rows((), size))  # every row is padding while capturing
            self.inputs.wait()
            self.decode(size)  # warm-up outside the graph
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.decode(size)
            self.graphs[size] = graph

    def decode(self, size: int) -> tuple[Tensor, Tensor]:
        """One token a row, every block-table column: shapes fixed by `size` alone."""
        d = {name: buffer[:size] for name, buffer in self.inputs.dev.items()}
        hidden = self.model.forward(
            self.kv, d["tokens"], d["positions"], d["slots"], d["tables"], d["seq_lens"]
        )
        logits = self.model.head(hidden)
        tokens = sample(logits, d["positions"], d["seeds"], d["temperatures"], d["sampled"])
        return logits, tokens

    def replay(self, batch: Batch, size: int) -> StepResult:
        self.inputs.upload(_rows(batch.requests, size))
        self.inputs.wait()
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager ------------------------------------------------------------------------------------

    def longest_sequence(self, batch: Batch) -> int:
        if self.read_back_lengths:
            return int(self.inputs.dev["seq_lens"][: batch.num_reqs].max())
        return max(request.seq_len for request in batch.requests)

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        self.inputs.upload(_rows(batch.requests, batch.num_reqs))
        columns = -(-self.longest_sequence(batch) // SPEC.block_size)
        self.inputs.wait()
        d = self.inputs.dev
        t, r = batch.num_tokens, batch.num_reqs
        positions = d["positions"][:t]
        tables = d["tables"][:t, :columns]  # only the columns the longest sequence reaches
        hidden = self.model.forward(
            self.kv, d["tokens"][:t], positions, d["slots"][:t], tables, positions + 1
        )
        last = d["last"][:r]
        logits = self.model.head(hidden[last])
        tokens = sample(
            logits, positions[last], d["seeds"][:r], d["temperatures"][:r], d["sampled"][:r]
        )
        return StepResult(logits, tokens, "eager", None, reason=reason)

    # -- the contract -----------------------------------------------------------------------------

    def capture_size(self, batch: Batch) -> int | None:
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode (query length > 1)"
        if self.capture_size(batch) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self.run_eager(batch, reason)
        size = self.capture_size(batch)
        assert size is not None
        return self.replay(batch, size)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{kind}{i}": kv[j] for i, kv in enumerate(self.kv) for j, kind in enumerate("kv")}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.inputs.dev if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> MetadataUploadRunner:
    return MetadataUploadRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> MetadataUploadRunner:
    return MetadataUploadRunner(mode, seed=seed, backend=backend, read_back_lengths=True)
