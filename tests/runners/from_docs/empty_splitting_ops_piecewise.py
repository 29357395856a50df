"""vLLM-style FULL_AND_PIECEWISE graph dispatch whose piecewise graphs may lose their split points.

The mechanism. vLLM keeps two kinds of CUDA graphs. FULL graphs capture the whole forward,
attention included, and serve only uniform decode batches (one query token per request, keyed
by the padded request count). PIECEWISE graphs serve every other batch (prefills, prefill chunks
beside decodes, speculative verification), keyed by the padded TOKEN count alone: their
compiled model is split at the ops listed in `splitting_ops` (the attention op), the dense pieces
around it are captured, and attention runs eagerly between the piece replays with the live
batch's metadata. That is what makes one graph per token count enough for any batch
composition. Attention backends decide things on the host from the batch (how many requests,
whether it is decode-only, the longest query), which is harmless only because attention is
outside the piecewise graphs.

The model: one decoder layer (token + learned position embeddings, RMS norm, q/k/v, attention
over a slot-major paged KV cache read through block tables, output projection, SiLU MLP, LM
head) in float32, with Gumbel-max sampling hashed from (seed, position, token id). Its attention
op stores the step's keys and values, then takes one of two paths chosen on the host, as real
backends do: a decode path when the longest query is one token (query row i IS request i: it
reads block-table row i and sequence length i) and a varlen path otherwise (each token finds its
request through a per-token request index). Both compute the same attention for a decode batch.

The bug (https://github.com/vllm-project/vllm/issues/53030). `set_splitting_ops_for_v1`
returns early when the compilation mode is not VLLM_COMPILE (the breakable-cudagraph path
here), leaving `splitting_ops` empty and skipping the guard that, for empty `splitting_ops`,
turns PIECEWISE off (FULL_AND_PIECEWISE becomes FULL). The "piecewise" graphs then hold one
piece: the whole forward, attention inside, captured on the dummy batch vLLM's capture run builds
for a token count T (min(T, max_num_reqs) requests sharing T tokens), and still keyed by T
alone. Here a T of at most max_num_reqs is captured as T one-token requests, so the attention's
decode path and its request count are frozen into the graph: a prefill, a mixed step or a
speculative step padded to that T treats every token as its own request and reads other rows'
block tables and lengths (the padding rows' null block among them). The graph for T = 16 was
captured on 8 requests of 2 tokens, took the varlen path, and happens to serve any composition:
only steps of 2 to 8 tokens that are not uniform decodes go wrong. In vLLM the report's symptom
is speculative decoding rejecting every draft.

The fix (https://github.com/vllm-project/vllm/pull/53061, open): apply the empty-splitting-ops
guard before the early return, so such a configuration runs FULL graphs for uniform decodes
and everything else eagerly. `make_target` is that; `make_buggy_target` the early return;
`make_split_target` the VLLM_COMPILE configuration, whose default `splitting_ops` name the
attention op, so its piecewise graphs really are split and replay for every composition.

No vLLM code was copied; the dispatch, the dummy composition and the config resolution are
written from the issue's description.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8, 16),  # in tokens; FULL decode graphs use those <= max_num_reqs
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
TOKEN_ROWS = SPEC.max_num_tokens
REQ_ROWS = SPEC.max_num_tokens  # a capture's dummy batch may give every token its own request
PAD_REQ = REQ_ROWS - 1  # padding tokens belong to this request row, never a live one
OUT_ROWS = SPEC.max_num_reqs  # logits rows of a piecewise graph
NULL_SLOT = SPEC.null_block * SPEC.block_size
FULL_SIZES = tuple(s for s in SPEC.capture_sizes if s <= SPEC.max_num_reqs)
ATTENTION_OP = "vllm::unified_attention"
_M32 = 0xFFFFFFFF


def resolve_compilation(
    mode: Literal["vllm_compile", "breakable"],
    cudagraph_mode: str,
    splitting_ops: tuple[str, ...] | None,
    *,
    guard_before_early_return: bool,
) -> tuple[str, tuple[str, ...]]:
    """The config step of the issue: (cudagraph mode, splitting ops) as the runner will use them."""
    if splitting_ops is None:  # the default: split at attention only where vLLM compiles itself
        splitting_ops = (ATTENTION_OP,) if mode == "vllm_compile" else ()
    if mode != "vllm_compile" and not guard_before_early_return:
        return cudagraph_mode, splitting_ops  # the early return: the guard below never runs
    if not splitting_ops:  # a piecewise graph without a split would capture attention
        downgrade = {"PIECEWISE": "NONE", "FULL_AND_PIECEWISE": "FULL"}
        cudagraph_mode = downgrade.get(cudagraph_mode, cudagraph_mode)
    return cudagraph_mode, splitting_ops


@dataclass(frozen=True)
class HostMeta:
    """What the attention backend reads on the host: frozen into any graph that captures it."""

    num_reqs: int
    max_query_len: int


@dataclass(frozen=True)
class Meta:
    """The step's device inputs (views of the static buffers in graph mode)."""

    tokens: Tensor
    positions: Tensor
    slots: Tensor
    token_req: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    logits_idx: Tensor
    seeds: Tensor
    temps: Tensor
    sampled: Tensor
    sample_pos: Tensor


WEIGHT_SHAPES = {
    "embed": (SPEC.vocab_size, HIDDEN),
    "pos": (MAX_POS, HIDDEN),
    "wq": (HIDDEN, HIDDEN),
    "wk": (HIDDEN, HIDDEN),
    "wv": (HIDDEN, HIDDEN),
    "wo": (HIDDEN, HIDDEN),
    "up": (HIDDEN, 2 * HIDDEN),
    "down": (2 * HIDDEN, HIDDEN),
    "head": (HIDDEN, SPEC.vocab_size),
}


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        self.t = {n: torch.empty(s, device=device) for n, s in WEIGHT_SHAPES.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # copied in place: captured graphs hold these addresses
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _hash32(x: Tensor) -> Tensor:
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def sample_tokens(logits: Tensor, seeds: Tensor, pos: Tensor, sampled: Tensor, temps: Tensor):
    """Gumbel-max with noise from (seed, position, token id): the same in any batch or graph."""
    key = _hash32((seeds & _M32) ^ _hash32(pos & _M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash32(key[:, None] ^ ((ids * 0x9E3779B1) & _M32)[None, :])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def stage_lists(batch: Batch, tok_rows: int, req_rows: int, out_rows: int) -> dict[str, Tensor]:
    """Host tensors of the step's inputs, padded: padding tokens write and read the null block."""
    mb = SPEC.max_blocks_per_req
    tokens, positions = [0] * tok_rows, [0] * tok_rows
    slots, token_req = [NULL_SLOT] * tok_rows, [min(PAD_REQ, req_rows - 1)] * tok_rows
    tables = [[SPEC.null_block] * mb for _ in range(req_rows)]
    seq_lens = [1] * req_rows
    logits_idx, seeds, sample_pos = [0] * out_rows, [0] * out_rows, [0] * out_rows
    temps, sampled = [1.0] * out_rows, [False] * out_rows
    t = 0
    for i, r in enumerate(batch.requests):
        for j, tok in enumerate(r.tokens):
            pos = r.context_len + j
            tokens[t], positions[t], token_req[t] = tok, pos, i
            slots[t] = kv_slot(r.block_ids, pos, SPEC.block_size)
            t += 1
        tables[i][: len(r.block_ids)] = list(r.block_ids)
        seq_lens[i], logits_idx[i], sample_pos[i] = r.seq_len, t - 1, r.seq_len - 1
        seeds[i] = 0 if r.seed is None else r.seed & _M32
        temps[i], sampled[i] = r.temperature, r.seed is not None
    i64 = torch.int64
    return {
        "tokens": torch.tensor(tokens, dtype=i64),
        "positions": torch.tensor(positions, dtype=i64),
        "slots": torch.tensor(slots, dtype=i64),
        "token_req": torch.tensor(token_req, dtype=i64),
        "block_tables": torch.tensor(tables, dtype=i64),
        "seq_lens": torch.tensor(seq_lens, dtype=i64),
        "logits_idx": torch.tensor(logits_idx, dtype=i64),
        "seeds": torch.tensor(seeds, dtype=i64),
        "temps": torch.tensor(temps, dtype=torch.float32),
        "sampled": torch.tensor(sampled, dtype=torch.bool),
        "sample_pos": torch.tensor(sample_pos, dtype=i64),
    }


class SplittingOpsRunner:
    def __init__(
        self,
        mode: str,
        *,
        seed: int,
        backend: str,
        compile_mode: Literal["vllm_compile", "breakable"] = "breakable",
        guard_before_early_return: bool = True,
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.v_cache = torch.zeros(SPEC.num_slots, HEADS, HEAD_DIM, device=dev)
        self.cudagraph_mode, self.splitting_ops = "NONE", ()
        self.graphs: dict[tuple, list[Any]] = {}
        self.outputs: dict[tuple, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        self.bridge: dict[str, Tensor] = {}
        if mode == "graph":
            self.cudagraph_mode, self.splitting_ops = resolve_compilation(
                compile_mode,
                "FULL_AND_PIECEWISE",
                None,
                guard_before_early_return=guard_before_early_return,
            )
            host = stage_lists(Batch(()), TOKEN_ROWS, REQ_ROWS, OUT_ROWS)
            self.buffers = {n: h.to(dev) for n, h in host.items()}
            self.buffers["attn_out"] = torch.zeros(TOKEN_ROWS, HIDDEN, device=dev)
            # written by the first piece of a split graph, read by attention and the last piece
            self.bridge = {
                "resid": torch.zeros(TOKEN_ROWS, HIDDEN, device=dev),
                "q": torch.zeros(TOKEN_ROWS, HEADS, HEAD_DIM, device=dev),
                "k": torch.zeros(TOKEN_ROWS, HEADS, HEAD_DIM, device=dev),
                "v": torch.zeros(TOKEN_ROWS, HEADS, HEAD_DIM, device=dev),
            }
            self.capture_all()

    # -- the model ------------------------------------------------------------------------------

    def embed_qkv(self, tokens: Tensor, positions: Tensor):
        w = self.w.t
        x = w["embed"][tokens] + w["pos"][positions]
        h = _rms(x)
        shape = (-1, HEADS, HEAD_DIM)
        return x, (h @ w["wq"]).view(shape), (h @ w["wk"]).view(shape), (h @ w["wv"]).view(shape)

    def attend(self, q: Tensor, tables: Tensor, limit: Tensor) -> Tensor:
        """q [N, H, D] against the cache through one block-table row each; key j seen if j < limit."""
        offs = torch.arange(SPEC.block_size, device=q.device)
        slots = (tables[:, :, None] * SPEC.block_size + offs).reshape(tables.shape[0], -1)
        keys, vals = self.k_cache[slots], self.v_cache[slots]  # [N, P, H, D]
        hidden = torch.arange(slots.shape[1], device=q.device)[None, :] >= limit[:, None]
        scores = torch.einsum("nhd,nphd->nhp", q, keys) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(hidden[:, None, :], -math.inf)  # NaN in unseen slots too
        vals = vals.masked_fill(hidden[:, :, None, None], 0.0)
        return torch.einsum("nhp,nphd->nhd", scores.softmax(-1), vals).reshape(-1, HIDDEN)

    def unified_attention(self, q, k, v, md: Meta, meta: HostMeta) -> Tensor:
        """The splitting op: store this step's keys and values, then attend on a host-chosen path."""
        self.k_cache.index_copy_(0, md.slots, k)
        self.v_cache.index_copy_(0, md.slots, v)
        if meta.max_query_len == 1:  # decode path: row i is request i
            r = meta.num_reqs
            return self.attend(q[:r], md.block_tables[:r], md.seq_lens[:r])
        tables = md.block_tables[md.token_req]  # varlen path: each token finds its request
        return self.attend(q, tables, md.positions + 1)

    def mlp_head(self, x: Tensor, attn: Tensor, md: Meta) -> tuple[Tensor, Tensor]:
        w = self.w.t
        x = x + attn @ w["wo"]
        x = x + F.silu(_rms(x) @ w["up"]) @ w["down"]
        logits = _rms(x[md.logits_idx]) @ w["head"]
        tokens = sample_tokens(logits, md.seeds, md.sample_pos, md.sampled, md.temps)
        return logits, tokens

    def forward(self, md: Meta, meta: HostMeta) -> tuple[Tensor, Tensor]:
        x, q, k, v = self.embed_qkv(md.tokens, md.positions)
        return self.mlp_head(x, self.unified_attention(q, k, v, md, meta), md)

    # -- graphs ---------------------------------------------------------------------------------

    def views(self, tok_rows: int, out_rows: int) -> Meta:
        b = self.buffers
        return Meta(
            tokens=b["tokens"][:tok_rows],
            positions=b["positions"][:tok_rows],
            slots=b["slots"][:tok_rows],
            token_req=b["token_req"][:tok_rows],
            block_tables=b["block_tables"],
            seq_lens=b["seq_lens"],
            logits_idx=b["logits_idx"][:out_rows],
            seeds=b["seeds"][:out_rows],
            temps=b["temps"][:out_rows],
            sampled=b["sampled"][:out_rows],
            sample_pos=b["sample_pos"][:out_rows],
        )

    def stage(self, batch: Batch) -> None:
        """Every row of every static buffer is rewritten, padding rows included."""
        for name, host in stage_lists(batch, TOKEN_ROWS, REQ_ROWS, OUT_ROWS).items():
            self.buffers[name].copy_(host)

    def capture(self, key: tuple, fns: list, pool: Any) -> None:
        self.stage(Batch(()))  # capture on the all-padding dummy, which writes the null block only
        for fn in fns:  # warm-up outside the graphs
            fn()
        graphs, out = [], None
        for fn in fns:
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                out = fn()
            graphs.append(g)
        self.graphs[key] = graphs
        assert out is not None
        self.outputs[key] = out

    def capture_all(self) -> None:
        pool = self.be.graph_pool_handle()
        if self.cudagraph_mode in ("FULL", "FULL_AND_PIECEWISE"):
            for r in sorted(FULL_SIZES, reverse=True):
                md, meta = self.views(r, r), HostMeta(num_reqs=r, max_query_len=1)
                self.capture(("full", r), [lambda md=md, meta=meta: self.forward(md, meta)], pool)
        if self.cudagraph_mode not in ("PIECEWISE", "FULL_AND_PIECEWISE"):
            return
        for t in sorted(SPEC.capture_sizes, reverse=True):
            md = self.views(t, OUT_ROWS)
            if ATTENTION_OP in self.splitting_ops:
                self.capture(("piecewise", t), self.split_pieces(md, t), pool)
            else:  # one piece: attention inside, on the capture run's dummy composition
                reqs = min(t, SPEC.max_num_reqs)
                meta = HostMeta(num_reqs=reqs, max_query_len=-(-t // reqs))
                self.capture(("piecewise", t), [lambda md=md, m=meta: self.forward(md, m)], pool)

    def split_pieces(self, md: Meta, t: int) -> list:
        br = self.bridge

        def first_piece() -> tuple[Tensor, Tensor]:
            x, q, k, v = self.embed_qkv(md.tokens, md.positions)
            for name, val in (("resid", x), ("q", q), ("k", k), ("v", v)):
                br[name][:t].copy_(val)
            return br["q"], br["k"]  # not an output anyone reads

        def last_piece() -> tuple[Tensor, Tensor]:
            return self.mlp_head(br["resid"][:t], self.buffers["attn_out"][:t], md)

        return [first_piece, last_piece]

    def route(self, batch: Batch) -> tuple[tuple | None, str | None]:
        n, r = batch.num_tokens, batch.num_reqs
        if self.mode == "eager":
            return None, "eager twin"
        full = self.cudagraph_mode in ("FULL", "FULL_AND_PIECEWISE")
        if full and set(batch.query_lens) == {1} and r <= FULL_SIZES[-1]:
            return ("full", next(s for s in FULL_SIZES if s >= r)), None
        if self.cudagraph_mode in ("PIECEWISE", "FULL_AND_PIECEWISE") and n <= TOKEN_ROWS:
            return ("piecewise", next(s for s in SPEC.capture_sizes if s >= n)), None
        return None, f"no graph for {n} tokens of {r} requests in mode {self.cudagraph_mode}"

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        key, reason = self.route(batch)
        if key is None:
            return self.run_eager(batch, reason)
        self.stage(batch)
        graphs = self.graphs[key]
        graphs[0].replay()
        if len(graphs) == 2:  # split: attention runs eagerly on the live batch between pieces
            n, br = batch.num_tokens, self.bridge
            md = self.views(n, OUT_ROWS)
            meta = HostMeta(batch.num_reqs, max(batch.query_lens))
            out = self.unified_attention(br["q"][:n], br["k"][:n], br["v"][:n], md, meta)
            self.buffers["attn_out"][:n].copy_(out)
            self.buffers["attn_out"][n : key[1]].zero_()
            graphs[1].replay()
        logits, tokens = self.outputs[key]
        r = batch.num_reqs
        path = "full" if key[0] == "full" else "piecewise"
        return StepResult(logits[:r].clone(), tokens[:r].clone(), path, key)

    def run_eager(self, batch: Batch, reason: str | None) -> StepResult:
        n, r = batch.num_tokens, batch.num_reqs
        host = stage_lists(batch, n, r, r)
        md = Meta(**{name: h.to(self.device) for name, h in host.items()})
        logits, tokens = self.forward(md, HostMeta(r, max(batch.query_lens)))
        return StepResult(logits, tokens, "eager", None, reason)

    # -- contract -------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        for graphs in self.graphs.values():
            for g in graphs:
                g.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return SplittingOpsRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return SplittingOpsRunner(mode, seed=seed, backend=backend, guard_before_early_return=False)


def make_split_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return SplittingOpsRunner(mode, seed=seed, backend=backend, compile_mode="vllm_compile")
