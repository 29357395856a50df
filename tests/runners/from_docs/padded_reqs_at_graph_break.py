"""A piecewise-graph runner modelled on vLLM's breakable piecewise CUDA graphs, with one real bug.

The mechanism: vLLM's piecewise mode captures the dense parts of the forward (embedding, QKV
projection, output projection, MLP, LM head) as CUDA graphs per captured token count and leaves
attention out of them: at each attention layer the graph breaks and the attention op runs eagerly,
reading the batch's attention metadata (request count, query starts, sequence lengths, block
tables) from the forward context. The tokens are padded up to a captured size, the metadata is the
real batch's, and the attention op works on the first `num_actual_tokens` rows only. Attention
backends take a batch whose requests all continue a sequence with the same query length (plain
decode, or speculative decode with k drafts each) down a "uniform decode" path that views the
query rows as `[num_reqs, next_n]` and expands each request's sequence length `next_n` times
(DeepSeek's DSA indexer decode does this before DeepGEMM's paged MQA logits, which asserts
`batch_size * next_n == rows`); other batches go down a varlen path over `query_start_loc`.

Here one layer: piece A (embedding + learned positions, norm, Q/K/V) and piece B (output
projection, SiLU MLP, LM head) are captured per capture size in one pool; between their replays
the eager attention op stores this step's keys and values through the slot mapping and attends
over the paged, slot-major KV cache. Logits are gathered at each request's last query token
after piece B, then sampled with Gumbel noise hashed from (seed, position, token id).

The bug (`pad_metadata_to_capture=True`): vllm-project/vllm PR #48822 made breakable piecewise
replay pad the batch metadata to the captured shape: the request count padded to
`min(num_tokens, max_num_reqs)` with zero-length trailing requests, the rows to the captured token
count. In-graph kernels can take that, but the attention that runs eagerly at the graph break
reads the padded metadata as the batch: the DSA indexer's uniform decode path then expands the
padded request count by `next_n` and DeepGEMM's shape check fails, and the sparse-MLA prefill path
cannot build its descriptors for zero-length requests. It crashed DeepSeek-V4-Flash on the V2
model runner; fixed by https://github.com/vllm-project/vllm/pull/49302 ("Fix DSA crash under
breakable piecewise cudagraphs"), which gives piecewise replays the real, unpadded request count
and sizes again. The check is modelled as the indexer's: a uniform decode batch whose metadata
rows do not equal `num_reqs * next_n` raises, as DeepGEMM's assertion does. The zero-length
padding requests are otherwise harmless on the varlen path here (they own no query rows), so a
plain decode batch fails only when its padded request count and its padded token count differ
(more tokens padded than `max_num_reqs`), and a speculative batch whenever a row is padded.
No engine code was copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8, 16),  # in tokens; 8 and 16 exceed max_num_reqs
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
MAX_SLOTS_PER_REQ = MAX_POS
_M32 = 0xFFFFFFFF


@dataclass
class AttnMetadata:
    """What the attention op at the graph break reads as 'the batch'."""

    num_reqs: int
    rows: int  # query rows the op works on
    query_start_loc: Tensor  # [num_reqs + 1]
    context_lens: Tensor  # [num_reqs] tokens cached before this step
    block_tables: Tensor  # [num_reqs, max_blocks_per_req], null block past a request's blocks
    slot_mapping: Tensor  # [num_actual_tokens], where this step's keys and values go
    uniform_next_n: int | None  # query length of a uniform decode batch, else None


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_POS, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # copied in place: the captured pieces read these tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def piece_a(w: dict[str, Tensor], ids: Tensor, pos: Tensor) -> tuple[Tensor, ...]:
    """Graphed: everything before the first attention layer."""
    x = w["embed"][ids] + w["pos"][pos]
    h = _rms(x)
    q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
    k = (h @ w["wk"]).view(-1, HEADS, HEAD_DIM)
    v = (h @ w["wv"]).view(-1, HEADS, HEAD_DIM)
    return x, q, k, v


def piece_b(w: dict[str, Tensor], x: Tensor, attn: Tensor) -> Tensor:
    """Graphed: everything after it, up to the logits of every (padded) row."""
    y = x + attn.flatten(1) @ w["wo"]
    y = y + torch.nn.functional.silu(_rms(y) @ w["up"]) @ w["down"]
    return _rms(y) @ w["lm_head"]


def attention_op(q, k, v, k_cache, v_cache, md: AttnMetadata, out: Tensor) -> None:
    """Eager at the graph break: store this step's keys/values, then attend over the cache."""
    n_actual = md.slot_mapping.shape[0]
    k_cache.index_copy_(0, md.slot_mapping, k[:n_actual])
    v_cache.index_copy_(0, md.slot_mapping, v[:n_actual])
    dev = q.device
    if md.uniform_next_n is not None:
        # uniform decode: rows are [num_reqs, next_n]; each request's length is expanded per row
        next_n = md.uniform_next_n
        if md.num_reqs * next_n != md.rows:  # the shape check DeepGEMM's paged MQA logits makes
            raise RuntimeError(
                f"uniform decode: batch_size * next_n ({md.num_reqs} * {next_n}) "
                f"!= query rows ({md.rows})"
            )
        row_req = torch.arange(md.num_reqs, device=dev).repeat_interleave(next_n)
        row_pos = md.context_lens.repeat_interleave(next_n) + torch.arange(
            next_n, device=dev
        ).repeat(md.num_reqs)
    else:  # varlen: each row belongs to the request whose query range holds it
        rows = torch.arange(md.rows, device=dev)
        row_req = torch.searchsorted(md.query_start_loc[1:], rows, right=True)
        starts = md.query_start_loc[:-1]
        row_req = row_req.clamp(max=max(md.num_reqs - 1, 0))
        row_pos = md.context_lens[row_req] + rows - starts[row_req]
    # a row past every request's query range (none in a correct batch) attends nothing
    owned = torch.arange(md.rows, device=dev) < md.query_start_loc[-1]
    offsets = torch.arange(MAX_SLOTS_PER_REQ, device=dev)
    tables = md.block_tables[row_req]  # [rows, max_blocks]
    slots = tables[:, offsets // SPEC.block_size] * SPEC.block_size + offsets % SPEC.block_size
    visible = (offsets[None, :] <= row_pos[:, None]) & owned[:, None]  # [rows, slots]
    keys = torch.where(visible[:, :, None, None], k_cache[slots], torch.zeros((), device=dev))
    vals = torch.where(visible[:, :, None, None], v_cache[slots], torch.zeros((), device=dev))
    scores = torch.einsum("rhd,rshd->rhs", q[: md.rows], keys) / math.sqrt(HEAD_DIM)
    scores = torch.where(visible[:, None, :], scores, torch.full((), -math.inf, device=dev))
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)  # a row that sees nothing gets zeros
    out.zero_()  # every row piece B reads is rewritten, padding rows with zeros
    out[: md.rows] = torch.einsum("rhs,rshd->rhd", probs, vals)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def sample(logits: Tensor, reqs: Sequence[Request]) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): nothing depends on the row."""
    dev = logits.device
    seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], device=dev)
    pos = torch.tensor([r.seq_len - 1 for r in reqs], device=dev)
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    sampled = torch.tensor([r.seed is not None for r in reqs], device=dev)
    key = _mix(_mix(seeds) ^ ((pos * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=dev)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class BreakablePiecewiseRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, pad_metadata_to_capture=False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        self.pad_metadata_to_capture = pad_metadata_to_capture
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        with torch.inference_mode():
            self.w = Weights(seed, dev)
            self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
            self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
            self.buffers: dict[str, Tensor] = {}
            self.graphs: dict[int, tuple[Any, Any]] = {}
            self.outputs: dict[int, tuple[tuple[Tensor, ...], Tensor]] = {}
            if mode == "graph":
                top = SPEC.capture_sizes[-1]
                self.buffers = {
                    "input_ids": torch.zeros(top, dtype=torch.int64, device=dev),
                    "positions": torch.zeros(top, dtype=torch.int64, device=dev),
                    "attn_out": torch.zeros(top, HEADS, HEAD_DIM, device=dev),
                }
                self.capture()

    # -- graphs -----------------------------------------------------------------------------------

    def capture(self) -> None:
        pool = self.be.graph_pool_handle()
        buf = self.buffers
        for size in sorted(SPEC.capture_sizes, reverse=True):
            buf["input_ids"].zero_()
            buf["positions"].zero_()
            buf["attn_out"].zero_()
            ids, pos, attn = (
                buf["input_ids"][:size],
                buf["positions"][:size],
                buf["attn_out"][:size],
            )
            piece_b(self.w.t, piece_a(self.w.t, ids, pos)[0], attn)  # warm-up outside the graphs
            self.be.synchronize()
            graph_a, graph_b = self.be.Graph(), self.be.Graph()
            with self.be.graph(graph_a, pool=pool):
                out_a = piece_a(self.w.t, ids, pos)
            with self.be.graph(graph_b, pool=pool):
                logits = piece_b(self.w.t, out_a[0], attn)
            self.graphs[size] = (graph_a, graph_b)
            self.outputs[size] = (out_a, logits)

    # -- metadata ---------------------------------------------------------------------------------

    def build_metadata(self, reqs: Sequence[Request], rows: int, num_reqs: int) -> AttnMetadata:
        """Metadata for `num_reqs` requests over `rows` query rows; requests past the batch's
        own are zero-length padding (null-block tables, no query tokens)."""
        dev = self.device
        qsl, ctx, tables = [0], [], []
        for i in range(num_reqs):
            r = reqs[i] if i < len(reqs) else None
            qsl.append(qsl[-1] + (len(r.tokens) if r else 0))
            ctx.append(r.context_len if r else 0)
            blocks = list(r.block_ids) if r else []
            tables.append(blocks + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(blocks)))
        slots = [
            kv_slot(r.block_ids, r.context_len + j, SPEC.block_size)
            for r in reqs
            for j in range(len(r.tokens))
        ]
        lens = {len(r.tokens) for r in reqs}
        uniform = len(lens) == 1 and all(r.context_len > 0 for r in reqs)
        return AttnMetadata(
            num_reqs=num_reqs,
            rows=rows,
            query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            uniform_next_n=lens.pop() if uniform else None,
        )

    # -- steps ------------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            if batch.num_reqs == 0:
                empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
                return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
            size = next((s for s in SPEC.capture_sizes if s >= batch.num_tokens), None)
            if self.mode == "eager" or size is None:
                return self.run_eager(batch)
            return self.run_piecewise(batch, size)

    def last_rows(self, reqs: Sequence[Request]) -> Tensor:
        ends, n = [], 0
        for r in reqs:
            n += len(r.tokens)
            ends.append(n - 1)
        return torch.tensor(ends, dtype=torch.int64, device=self.device)

    def run_eager(self, batch: Batch) -> StepResult:
        reqs, n, dev = batch.requests, batch.num_tokens, self.device
        ids = torch.tensor([t for r in reqs for t in r.tokens], dtype=torch.int64, device=dev)
        pos = torch.tensor(
            [r.context_len + j for r in reqs for j in range(len(r.tokens))], device=dev
        )
        x, q, k, v = piece_a(self.w.t, ids, pos)
        attn = torch.empty(n, HEADS, HEAD_DIM, device=dev)
        md = self.build_metadata(reqs, rows=n, num_reqs=len(reqs))
        attention_op(q, k, v, self.k_cache, self.v_cache, md, attn)
        logits = piece_b(self.w.t, x, attn).index_select(0, self.last_rows(reqs))
        reason = "eager twin" if self.mode == "eager" else "above the largest capture size"
        return StepResult(logits, sample(logits, reqs), "eager", None, reason)

    def run_piecewise(self, batch: Batch, size: int) -> StepResult:
        reqs, n, buf = batch.requests, batch.num_tokens, self.buffers
        dev = self.device
        ids = [t for r in reqs for t in r.tokens] + [0] * (size - n)  # padding: token 0, pos 0
        pos = [r.context_len + j for r in reqs for j in range(len(r.tokens))] + [0] * (size - n)
        buf["input_ids"][:size].copy_(torch.tensor(ids, dtype=torch.int64, device=dev))
        buf["positions"][:size].copy_(torch.tensor(pos, dtype=torch.int64, device=dev))
        if self.pad_metadata_to_capture:  # PR #48822: metadata padded to the captured shape
            md = self.build_metadata(reqs, rows=size, num_reqs=min(size, SPEC.max_num_reqs))
        else:  # PR #49302: the attention at the break sees the real batch
            md = self.build_metadata(reqs, rows=n, num_reqs=len(reqs))
        graph_a, graph_b = self.graphs[size]
        (_x, q, k, v), logits = self.outputs[size]
        graph_a.replay()
        attention_op(q, k, v, self.k_cache, self.v_cache, md, buf["attn_out"][:size])
        graph_b.replay()
        picked = logits.index_select(0, self.last_rows(reqs))  # a copy: the graph output stays
        return StepResult(picked, sample(picked, reqs), "piecewise", ("piecewise", size))

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.w.load(seed)

    def close(self) -> None:
        for graph_a, graph_b in self.graphs.values():
            graph_a.reset()
            graph_b.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return BreakablePiecewiseRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return BreakablePiecewiseRunner(mode, seed=seed, backend=backend, pad_metadata_to_capture=True)
