"""A runner shaped like text-generation-inference's `FlashCausalLM` decode CUDA graphs.

What it models (written from scratch against the backend facade, no TGI code): a dict
`cuda_graphs` keyed by padded row count, each entry holding its graph, its logits and its static
`input_ids`, `position_ids`, `slots`, `block_tables`, `input_lengths` and `cache_lengths` (slices
of the largest entry's buffers, captured largest first into one pool). Every row is one query
token: a speculative step expands each request into 1 + k rows that share its block table, with
`cache_lengths` counting the tokens before the row's own, as TGI does for its drafts with prefix
caching. Before a replay the batch is copied into the prefix of those buffers and the padding rows
get slot 0 (the reserved block) and zero lengths. Attention is varlen over the paged cache: a
`Seqlen` turns the lengths into `cu_seqlen_q` / `cu_seqlen_k` (prefix sums of
`input_lengths + cache_lengths`), and the kernel reads the key count of row b as
`cu_seqlen_k[b + 1] - cu_seqlen_k[b]`. Prefill steps, longer query chunks and steps past the
largest graph run eagerly (varlen over requests); sampling runs after the forward, outside the
graph, from a hash of each request's seed and position.

The bug (`make_buggy_target`): huggingface/text-generation-inference PR #2163, "Fixing graph
capture for flash decoding" (https://github.com/huggingface/text-generation-inference/pull/2163,
commit 022f6515), which fixed what PR #1940 (the move to FlashDecoding, 4327210e) introduced. In
`cuda_graph_warmup` the `Seqlen` was built once, before the warm-up forward and outside
`torch.cuda.graph(...)`, and that object was passed into the capture. Its prefix sums were
therefore computed eagerly, once, from the warm-up lengths (`max_s` for every row), and the
captured attention kernel reads that tensor instead of summing the lengths each replay copies in:
every replayed row attends over `max_s` keys whatever its real length, i.e. over stale slots and
unused block-table columns, and the `Seqlen` itself was a local of the warm-up function, freed when
it returned, so the graph also reads memory the allocator may hand to someone else. The fix builds
the `Seqlen` inside the capture, so the sums are part of the graph. The flag reproduces the
pre-fix code path in this runner's layout (`cache_lengths` came later, with prefix caching).
On sim the first decode replay raises `UseAfterFreeError` (the freed prefix sums); with the
`Seqlen` kept alive instead, the same replay attends over `max_s` keys, reaches the poisoned
null block through unused block-table columns and returns NaN logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_S = SPEC.max_blocks_per_req * SPEC.block_size  # longest sequence a request can reach
SPECULATE = 3  # drafts a decode graph row set may carry per request
_MASK32 = 0xFFFFFFFF


class Seqlen:
    """Varlen metadata: query and key prefix sums over the rows (TGI's `Seqlen`)."""

    def __init__(self, input_lengths: Tensor, cache_lengths: Tensor, cu_seqlen_q: Tensor) -> None:
        self.input_lengths = input_lengths
        self.cache_lengths = cache_lengths
        self.cu_seqlen_q = cu_seqlen_q
        total = input_lengths + cache_lengths
        self.cu_seqlen_k = torch.zeros(total.shape[0] + 1, dtype=torch.int64, device=total.device)
        torch.cumsum(total, 0, out=self.cu_seqlen_k[1:])


class Model:
    """Embedding + learned positions, one attention layer over a slot-major paged cache, an MLP."""

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_S, HIDDEN),
            "qkv": (HIDDEN, 3 * HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        """In place, so captured graphs read the new weights."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(weight.device))

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        block_tables: Tensor,
        slots: Tensor,
        seqlen: Seqlen,
        lm_head_indices: Tensor | None = None,
    ) -> Tensor:
        w = self.weights
        x = w["embed"][input_ids] + w["pos"][position_ids]
        q, k, v = (_rms(x) @ w["qkv"]).split(HIDDEN, dim=-1)
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, slots, k.reshape(-1, HEADS, HEAD_DIM))  # store before attending
        v_cache.index_copy_(0, slots, v.reshape(-1, HEADS, HEAD_DIM))
        x = x + _paged_attention(q, k_cache, v_cache, block_tables, seqlen) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if lm_head_indices is not None:
            x = x[lm_head_indices]
        return _rms(x) @ w["lm_head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seqlen: Seqlen
) -> Tensor:
    """Varlen causal attention, bottom-right aligned: query i of a sequence with q_len queries and
    k_len keys sees keys 0 .. k_len - q_len + i. Key counts come from `cu_seqlen_k` alone."""
    device = q.device
    cu_q, cu_k = seqlen.cu_seqlen_q, seqlen.cu_seqlen_k
    token = torch.arange(q.shape[0], device=device)
    seq = torch.searchsorted(cu_q[1:].contiguous(), token, right=True)
    q_len = (cu_q[1:] - cu_q[:-1])[seq]
    k_len = (cu_k[1:] - cu_k[:-1])[seq]
    visible_keys = k_len - q_len + (token - cu_q[seq]) + 1  # [T]
    offsets = torch.arange(SPEC.block_size, device=device)
    context = (block_tables[seq][:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, MAX_S]
    visible = torch.arange(MAX_S, device=device)[None, :] < visible_keys[:, None]
    keys, values = k_cache[context], v_cache[context]  # [T, MAX_S, heads, dim]
    scores = torch.einsum("thd,tchd->thc", q.reshape(-1, HEADS, HEAD_DIM), keys)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf")) / math.sqrt(HEAD_DIM)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible.any(-1)[:, None, None], probs, torch.zeros((), device=device))
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=device))
    return torch.einsum("thc,tchd->thd", probs, values).reshape(-1, HIDDEN)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 15) ^ x) * 0x2C1B3C6D) & _MASK32
    x = (((x >> 12) ^ x) * 0x297A2D39) & _MASK32
    return (x >> 15) ^ x


def sample(logits: Tensor, seeds: Tensor, temps: Tensor, sampled: Tensor, pos: Tensor) -> Tensor:
    """Gumbel-max keyed by (seed, position, token id); greedy rows take the argmax."""
    key = _mix(_mix(seeds) ^ ((pos * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x7FEB352D) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def _rows(batch: Batch) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """One (token, position, slot, block_ids) per query token, requests in batch order."""
    return [
        (
            t,
            r.context_len + i,
            kv_slot(r.block_ids, r.context_len + i, SPEC.block_size),
            r.block_ids,
        )
        for r in batch.requests
        for i, t in enumerate(r.tokens)
    ]


def _table(block_ids: Sequence[int]) -> list[int]:
    return list(block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(block_ids))


class FlashCausalLMRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, bug: bool = False
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.bug = SPEC, mode, bug
        self.backend: Any = get_backend(backend)
        self.device = self.backend.device
        self.model = Model(seed, self.device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv_cache = (
            torch.zeros(shape, device=self.device),
            torch.zeros(shape, device=self.device),
        )
        self.cuda_graphs: dict[int, dict[str, Any]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.pool = self.backend.graph_pool_handle()
            for bs in sorted(SPEC.capture_sizes, reverse=True):
                self.cuda_graph_warmup(bs)

    # -- graphs -----------------------------------------------------------------------------------

    def cuda_graph_warmup(self, bs: int) -> None:
        """Capture the graph for `bs` rows; smaller graphs use slices of the largest's buffers."""
        if not self.buffers:
            n, i64 = bs, torch.int64
            self.buffers = {
                "input_ids": torch.zeros(n, dtype=i64, device=self.device),
                "position_ids": torch.zeros(n, dtype=i64, device=self.device),
                "slots": torch.zeros(n, dtype=i64, device=self.device),
                "block_tables": torch.zeros(
                    n, SPEC.max_blocks_per_req, dtype=i64, device=self.device
                ),
                "input_lengths": torch.zeros(n, dtype=i64, device=self.device),
                "cache_lengths": torch.zeros(n, dtype=i64, device=self.device),
            }
        graph_inputs = {name: buf[:bs] for name, buf in self.buffers.items()}
        cu_seqlen_q = torch.arange(bs + 1, dtype=torch.int64, device=self.device)
        # Warm-up values: every row the longest sequence, writing the reserved block only.
        self._pad(0, bs)
        graph_inputs["input_lengths"].fill_(MAX_S)
        entry: dict[str, Any] = {"graph": self.backend.Graph(), "cu_seqlen_q": cu_seqlen_q}
        entry.update(graph_inputs)
        self.cuda_graphs[bs] = entry
        lengths = (graph_inputs["input_lengths"], graph_inputs["cache_lengths"], cu_seqlen_q)
        seqlen = Seqlen(*lengths)  # eager, outside the capture
        self._run(graph_inputs, seqlen)  # warm-up outside the graph
        self.backend.synchronize()
        with self.backend.graph(entry["graph"], pool=self.pool):
            if not self.bug:  # the fix: the prefix sums are computed by the graph itself
                seqlen = Seqlen(*lengths)
            entry["logits"] = self._run(graph_inputs, seqlen)
        self.backend.synchronize()
        self._pad(0, bs)
        # With the bug, `seqlen` dies here: the graph keeps its address, not the tensor.

    def _pad(self, start: int, stop: int) -> None:
        """Padding rows: token 0 at position 0 writing slot 0 of the reserved block, no lengths."""
        b = self.buffers
        b["input_ids"][start:stop].zero_()
        b["position_ids"][start:stop].zero_()
        b["slots"][start:stop].fill_(SPEC.null_block * SPEC.block_size)
        b["block_tables"][start:stop].fill_(SPEC.null_block)
        b["input_lengths"][start:stop].zero_()
        b["cache_lengths"][start:stop].zero_()

    def _run(self, inputs: Mapping[str, Tensor], seqlen: Seqlen) -> Tensor:
        return self.model.forward(
            inputs["input_ids"],
            inputs["position_ids"],
            self.kv_cache,
            inputs["block_tables"],
            inputs["slots"],
            seqlen,
        )

    def replay(self, batch: Batch) -> tuple[Tensor, int]:
        rows = _rows(batch)
        n = len(rows)
        bs = min(s for s in self.cuda_graphs if s >= n)
        entry = self.cuda_graphs[bs]

        def put(name: str, values: list[Any]) -> None:
            entry[name][:n].copy_(torch.tensor(values, dtype=torch.int64, device=self.device))

        put("input_ids", [row[0] for row in rows])
        put("position_ids", [row[1] for row in rows])
        put("slots", [row[2] for row in rows])
        put("block_tables", [_table(row[3]) for row in rows])
        put("input_lengths", [1] * n)
        put("cache_lengths", [row[1] for row in rows])  # the tokens before this row's own
        self._pad(n, bs)
        entry["graph"].replay()
        last = torch.tensor(_last_indices(batch), dtype=torch.int64, device=self.device)
        return entry["logits"].index_select(0, last), bs

    def graph_fallback(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.context_len == 0 for r in batch.requests):
            return "prefill (cu_seqlen_prefill is set)"
        if max(batch.query_lens) > 1 + SPECULATE:
            return f"query chunk longer than 1 + {SPECULATE} tokens"
        if batch.num_tokens > max(SPEC.capture_sizes):
            return f"no cuda graph for {batch.num_tokens} rows"
        return None

    # -- eager ------------------------------------------------------------------------------------

    def run_eager(self, batch: Batch) -> Tensor:
        rows = _rows(batch)

        def tensor(values: list[Any]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        query_lens = list(batch.query_lens)
        cu_q = [0]
        for length in query_lens:
            cu_q.append(cu_q[-1] + length)
        seqlen = Seqlen(
            tensor(query_lens), tensor([r.context_len for r in batch.requests]), tensor(cu_q)
        )
        return self.model.forward(
            tensor([row[0] for row in rows]),
            tensor([row[1] for row in rows]),
            self.kv_cache,
            tensor([_table(r.block_ids) for r in batch.requests]).view(-1, SPEC.max_blocks_per_req),
            tensor([row[2] for row in rows]),
            seqlen,
            lm_head_indices=tensor(_last_indices(batch)),
        )

    # -- contract ---------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        reason = self.graph_fallback(batch)
        if reason is None:
            logits, bs = self.replay(batch)
            path, key = "full", ("decode", bs)
        else:
            logits, path, key = self.run_eager(batch), "eager", None
        return StepResult(logits, self._sample(batch, logits), path, key, reason=reason)

    def _sample(self, batch: Batch, logits: Tensor) -> Tensor:
        reqs = batch.requests
        on = [r.seed is not None for r in reqs]
        return sample(
            logits,
            torch.tensor([(r.seed or 0) & _MASK32 for r in reqs], device=self.device),
            torch.tensor(
                [r.temperature if r.seed is not None else 1.0 for r in reqs], device=self.device
            ),
            torch.tensor(on, dtype=torch.bool, device=self.device),
            torch.tensor([r.seq_len - 1 for r in reqs], device=self.device),
        )

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.kv_cache[0], "v": self.kv_cache[1]}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for entry in self.cuda_graphs.values():
            entry["graph"].reset()
        self.cuda_graphs.clear()


def _last_indices(batch: Batch) -> list[int]:
    out, total = [], 0
    for request in batch.requests:
        total += request.query_len
        out.append(total - 1)
    return out


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> FlashCausalLMRunner:
    return FlashCausalLMRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> FlashCausalLMRunner:
    return FlashCausalLMRunner(mode, seed=seed, backend=backend, bug=True)
