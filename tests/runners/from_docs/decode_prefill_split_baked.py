"""A token-padded FULL-graph runner for mixed batches, with a decode/prefill split in attention.

What it is. A one-layer decoder over a slot-major paged KV cache, written against the backend
facade. Like vLLM's FULL cudagraph mode with the FlashInfer / FlashAttention backends, it replays
one full graph per capture size *in tokens* for every batch that fits (pure decode, prefill
chunks, and mixed batches of both), captured at start-up from vLLM-style dummy batches
(`min(T, max_num_reqs)` requests sharing T tokens, the remainder on the last one). Before each step
the batch is reordered so that decode requests (query length 1, vLLM's reorder threshold) come
first, then prefill chunks (and speculative rows, query length > 1); attention runs the first
`num_decodes` requests through a decode path (one query token per request, attending to the
request's `seq_len` keys through its block table) and the remaining tokens through a varlen
prefill path (causal, per token). Per-request outputs (logits at the last query token, Gumbel-max
samples from a hash of seed and position) are produced in the batch's order through a `last`
index, so nothing has to be permuted back on the host.

Correct runner (`make_target`): the split is a device value (`num_decodes`, a one-element static
buffer rewritten every step). The graph computes both paths for every token and picks per token
on the device (`token index < num_decodes`), so one graph serves every split with the same padded
token count.

Buggy runner (`make_buggy_target`), one realistic bug: the split is the Python int of the batch at
hand, used to slice the query rows for each path (`q[:num_decodes]` through the decode path,
`q[num_decodes:]` through the prefill path), exactly what the eager forward does. In graph mode
that int is the one of the capture batch and is frozen into the graph, so a later batch padded to
the same size with fewer decodes runs its first prefill tokens through the decode path, each
paired with the metadata (block table, seq_len) of the request row of the same index: wrong
attention for those tokens. (With more decodes than at capture, the extra decode rows go through
the prefill path, which computes the same thing here.)

Public source. vLLM marks FlashInfer's FULL-cudagraph support PURE_DECODE_ONLY ("need to use
piecewise cudagraph or no cudagraph for mixed prefill-decode batches") because its decode/prefill
split (`num_decodes`, `num_prefills`, the wrappers planned on the host) is host metadata:
https://github.com/vllm-project/vllm/pull/21367 (and the separate-routine FULL graphs of
https://github.com/vllm-project/vllm/pull/20059). Where mixed batches did reach FULL graphs, the
captured split / per-step offsets were replayed stale: torchtitan's vLLM generator produced
corrupted output with FULL over mixed prefill+decode batches ("our varlen forward bakes per-step
cu_seqlens / max_query_len into the captured graph, so a FULL graph over a mixed prefill+decode
batch replays stale offsets", https://github.com/pytorch/torchtitan/pull/3776, fix
https://github.com/pytorch/torchtitan/pull/3685), and vLLM's GDN builder refreshes its FULL-graph
buffers only in its `num_prefills == 0` branch, so a prefill reaching a FULL replay reuses
capture-time indices (https://github.com/vllm-project/vllm/issues/53051). No engine code copied.
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
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=20,
    capture_sizes=(1, 2, 4, 8, 16),  # in tokens, like vLLM's cudagraph_capture_sizes
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
MAX_T = SPEC.capture_sizes[-1]
ROWS = SPEC.max_num_reqs + 1  # request rows; the last one is always padding (padding tokens' row)
PAD_ROW = ROWS - 1
DECODE_THRESHOLD = 1  # a request with at most this many query tokens is a decode
M32 = 0xFFFFFFFF


def _hash(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32  # every product stays below 2**63
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.device = device
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed * 7919 + 11)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))


def _context(tables: Tensor) -> Tensor:
    offsets = torch.arange(SPEC.block_size, device=tables.device)
    return (tables[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [n, CONTEXT] slots


def _attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, visible: Tensor) -> Tensor:
    ctx = _context(tables)
    keys, values = k_cache[ctx], v_cache[ctx]  # [n, CONTEXT, heads, dim]
    scores = torch.einsum("nhd,nchd->nhc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("nhc,nchd->nhd", probs, values).flatten(1)


def decode_attention(q: Tensor, kc: Tensor, vc: Tensor, tables: Tensor, seq_lens: Tensor) -> Tensor:
    """One query token per request row: it sees the row's first seq_len positions."""
    visible = torch.arange(CONTEXT, device=q.device)[None, :] < seq_lens[:, None]
    return _attend(q, kc, vc, tables, visible)


def prefill_attention(
    q: Tensor, kc: Tensor, vc: Tensor, tables: Tensor, positions: Tensor
) -> Tensor:
    """Varlen causal attention, per token: it sees its request's positions up to its own."""
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= positions[:, None]
    return _attend(q, kc, vc, tables, visible)


class SplitRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, host_split: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.host_split = host_split  # the bug: the split is a Python int baked into the graph
        self.be: Any = get_backend(backend)
        dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            self.buffers = self._allocate()
            self._capture()

    # -- inputs -----------------------------------------------------------------------------------

    def _allocate(self) -> dict[str, Tensor]:
        dev, i64 = self.be.device, torch.int64
        return {
            # per token, internal (decode-first) order
            "tokens": torch.zeros(MAX_T, dtype=i64, device=dev),
            "positions": torch.zeros(MAX_T, dtype=i64, device=dev),
            "slots": torch.zeros(MAX_T, dtype=i64, device=dev),
            "tok_row": torch.zeros(MAX_T, dtype=i64, device=dev),
            # per request row, internal order
            "row_tables": torch.zeros(ROWS, SPEC.max_blocks_per_req, dtype=i64, device=dev),
            "row_seq_lens": torch.zeros(ROWS, dtype=i64, device=dev),
            "row_qstart": torch.zeros(ROWS, dtype=i64, device=dev),
            # the split, as a device value
            "num_decodes": torch.zeros(1, dtype=i64, device=dev),
            # per request, in the batch's order
            "last": torch.zeros(SPEC.max_num_reqs, dtype=i64, device=dev),
            "sample_pos": torch.zeros(SPEC.max_num_reqs, dtype=i64, device=dev),
            "seeds": torch.zeros(SPEC.max_num_reqs, dtype=i64, device=dev),
            "temperatures": torch.ones(SPEC.max_num_reqs, device=dev),
            "sampled": torch.zeros(SPEC.max_num_reqs, dtype=torch.bool, device=dev),
        }

    @staticmethod
    def host_inputs(
        batch: Batch, size: int, query_lens: Sequence[int] | None = None
    ) -> dict[str, Any]:
        """Host rows for `batch` padded to `size` tokens. `query_lens` without a batch: a dummy
        batch of padding requests (capture), whose rows point at the null block."""
        if query_lens is None:
            reqs: list[Request | None] = list(batch.requests)
            lens = [r.query_len for r in batch.requests]
        else:
            reqs, lens = [None] * len(query_lens), list(query_lens)
        order = sorted(range(len(lens)), key=lambda i: lens[i] > DECODE_THRESHOLD)  # stable
        num_decodes = sum(1 for q in lens if q <= DECODE_THRESHOLD)
        null_table = [SPEC.null_block] * SPEC.max_blocks_per_req
        h: dict[str, Any] = {
            "tokens": [],
            "positions": [],
            "slots": [],
            "tok_row": [],
            "row_tables": [],
            "row_seq_lens": [],
            "row_qstart": [],
            "last": [0] * len(lens),
            "sample_pos": [0] * len(lens),
            "seeds": [0] * len(lens),
            "temperatures": [1.0] * len(lens),
            "sampled": [False] * len(lens),
        }
        for row, i in enumerate(order):
            r = reqs[i]
            h["row_qstart"].append(len(h["tokens"]))
            if r is None:
                h["row_tables"].append(null_table)
                h["row_seq_lens"].append(0)
                for _ in range(lens[i]):
                    h["tokens"].append(0)
                    h["positions"].append(0)
                    h["slots"].append(NULL_SLOT)
                    h["tok_row"].append(row)
            else:
                h["row_tables"].append(
                    list(r.block_ids)
                    + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))
                )
                h["row_seq_lens"].append(r.seq_len)
                for j, tok in enumerate(r.tokens):
                    pos = r.context_len + j
                    h["tokens"].append(tok)
                    h["positions"].append(pos)
                    h["slots"].append(
                        r.block_ids[pos // SPEC.block_size] * SPEC.block_size
                        + pos % SPEC.block_size
                    )
                    h["tok_row"].append(row)
                h["sample_pos"][i] = r.seq_len - 1
                if r.seed is not None:
                    h["seeds"][i], h["temperatures"][i], h["sampled"][i] = (
                        r.seed & M32,
                        r.temperature,
                        True,
                    )
            h["last"][i] = len(h["tokens"]) - 1
        n_tok = len(h["tokens"])
        for _ in range(size - n_tok):  # padding tokens: null slot, the always-padding row
            h["tokens"].append(0)
            h["positions"].append(0)
            h["slots"].append(NULL_SLOT)
            h["tok_row"].append(PAD_ROW)
        for _ in range(
            ROWS - len(lens)
        ):  # padding rows: null table, empty, query start past the end
            h["row_tables"].append(null_table)
            h["row_seq_lens"].append(0)
            h["row_qstart"].append(size)
        h["num_decodes"] = [num_decodes]
        return h

    def _stage(self, h: Mapping[str, Any], size: int) -> None:
        n = len(h["last"])
        for name, buf in self.buffers.items():
            vals = h[name]
            if name in ("tokens", "positions", "slots", "tok_row"):
                buf[:size].copy_(torch.tensor(vals, dtype=buf.dtype))
            elif name in ("last", "sample_pos", "seeds", "temperatures", "sampled"):
                if n:
                    buf[:n].copy_(torch.tensor(vals, dtype=buf.dtype))
                buf[n:].fill_({"temperatures": 1.0, "sampled": False}.get(name, 0))
            else:
                buf.copy_(torch.tensor(vals, dtype=buf.dtype).view(buf.shape))

    def _device_inputs(self, h: Mapping[str, Any]) -> dict[str, Tensor]:
        dev = self.be.device
        dtypes = {"temperatures": torch.float32, "sampled": torch.bool}
        return {
            k: torch.tensor(v, dtype=dtypes.get(k, torch.int64), device=dev) for k, v in h.items()
        }

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, x_in: Mapping[str, Tensor], split: int | Tensor) -> tuple[Tensor, Tensor]:
        """`split` is num_decodes (== num_decode_tokens, one token per decode): a Python int
        slices the rows for each path; a device tensor selects per token on the device."""
        w = self.model.w
        positions = x_in["positions"]
        x = w["embed"][x_in["tokens"]] + w["pos"][positions]
        h = _rms(x)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        self.k_cache.index_copy_(0, x_in["slots"], k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, x_in["slots"], v.view(-1, HEADS, HEAD_DIM))
        tables, seq_lens, tok_row = x_in["row_tables"], x_in["row_seq_lens"], x_in["tok_row"]
        kc, vc = self.k_cache, self.v_cache
        if isinstance(split, int):
            nd = split  # decode rows are rows 0..nd-1 and tokens 0..nd-1 (decode-first order)
            out_d = decode_attention(q[:nd], kc, vc, tables[:nd], seq_lens[:nd])
            out_p = prefill_attention(q[nd:], kc, vc, tables[tok_row[nd:]], positions[nd:])
            attn = torch.cat([out_d, out_p])
        else:
            q_pad = torch.cat([q, torch.zeros_like(q[:1])])
            out_d = decode_attention(q_pad[x_in["row_qstart"]], kc, vc, tables, seq_lens)[tok_row]
            out_p = prefill_attention(q, kc, vc, tables[tok_row], positions)
            is_decode = torch.arange(q.shape[0], device=q.device) < split
            attn = torch.where(is_decode[:, None], out_d, out_p)
        x = x + attn @ w["wo"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        logits = _rms(x[x_in["last"]]) @ w["head"]
        return logits, self._sample(logits, x_in)

    @staticmethod
    def _sample(logits: Tensor, x_in: Mapping[str, Tensor]) -> Tensor:
        key = _hash(_hash(x_in["seeds"]) ^ ((x_in["sample_pos"] * 0x9E3779B1) & M32))
        ids = torch.arange(logits.shape[-1], device=logits.device)
        bits = _hash(key[:, None] ^ ((ids * 0x85EBCA6B) & M32)[None, :])
        u = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
        noisy = logits / x_in["temperatures"][:, None] - torch.log(-torch.log(u))
        return torch.where(x_in["sampled"], noisy.argmax(-1), logits.argmax(-1))

    # -- graphs -----------------------------------------------------------------------------------

    def _static(self, size: int) -> dict[str, Tensor]:
        per_token = ("tokens", "positions", "slots", "tok_row")
        return {k: (b[:size] if k in per_token else b) for k, b in self.buffers.items()}

    def _split(self, num_decodes: int) -> int | Tensor:
        return num_decodes if self.host_split else self.buffers["num_decodes"]

    def _capture(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            n = min(size, SPEC.max_num_reqs)  # vLLM-style dummy batch: T tokens over n requests
            lens = [size // n] * n
            lens[-1] += size % n
            h = self.host_inputs(Batch(()), size, query_lens=lens)
            self._stage(h, size)
            inputs = self._static(size)
            self.forward(inputs, self._split(h["num_decodes"][0]))  # warm-up
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self.forward(inputs, self._split(h["num_decodes"][0]))
            self.graphs[size] = graph

    # -- contract ---------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        if n == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.be.device)
            return StepResult(
                empty,
                torch.zeros(0, dtype=torch.int64, device=self.be.device),
                "eager",
                None,
                "empty batch",
            )
        size = next((s for s in SPEC.capture_sizes if s >= batch.num_tokens), None)
        if self.mode == "eager" or size is None:
            h = self.host_inputs(batch, batch.num_tokens)
            logits, tokens = self.forward(self._device_inputs(h), h["num_decodes"][0])
            reason = "eager twin" if self.mode == "eager" else "more tokens than the largest graph"
            return StepResult(logits, tokens, "eager", None, reason)
        h = self.host_inputs(batch, size)
        self._stage(h, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("tokens", size))

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.k_cache, "v0": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SplitRunner:
    return SplitRunner(mode, seed=seed, backend=backend, host_split=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> SplitRunner:
    return SplitRunner(mode, seed=seed, backend=backend, host_split=True)
