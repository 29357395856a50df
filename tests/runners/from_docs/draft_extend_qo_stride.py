"""A decode and draft-extend graph runner built the way SGLang builds its CUDA-graph runners.

Design (after SGLang's `CudaGraphRunner`, `EAGLEDraftExtendCudaGraphRunner` and the attention
backends' `init_cuda_graph_state` / `init_forward_metadata_capture_cuda_graph` /
`init_forward_metadata_replay_cuda_graph`):

- A small two-layer decoder over a slot-major paged KV cache (float32). Its attention is one
  paged "extend" kernel driven by metadata, as SGLang's trtllm-mla and triton backends are: the
  query rows of request r are `qo_indptr[r] .. qo_indptr[r] + extend_seq_lens[r] - 1`; the kernel
  pads them into a `[bs, max_q, heads, dim]` block (`pad_draft_extend_query`), attends over the
  request's blocks up to its own position, and scatters the rows back (`unpad_draft_extend_output`).
- Two graph runners share one graph memory pool, each with its own persistent input buffers and
  the attention backend's persistent metadata (`qo_indptr`, kept per mode as SGLang keeps
  `decode_cuda_graph_metadata` and the draft-extend metadata):
  * decode graphs, keyed by batch size, one token a request;
  * draft-extend graphs, keyed by batch size, with a constant width of `NUM_DRAFT_TOKENS` token
    rows per request: a request with fewer query tokens (fewer accepted drafts, or fewer drafted)
    leaves the rest of its rows as padding that writes the null block. Speculative steps (every
    query at most `NUM_DRAFT_TOKENS` long, some longer than one) replay these graphs.
  Prefill chunks, longer queries and batches past the largest graph run eagerly (SGLang's extend
  path), with the packed layout and `qo_indptr = cumsum(extend_seq_lens)`.
- The capture builds the draft-extend metadata with the constant layout
  (`qo_indptr = arange(bs + 1) * width`); the replay writes the batch into the static buffers,
  then refreshes the metadata on the device before `replay()`. Results are copied out.
- Sampling is Gumbel-max with noise hashed from (seed, position, token id), so nothing random is
  baked into a graph.

The bug (`make_buggy_target`): the draft-extend replay builds `qo_indptr` from the requests'
query lengths, `cumsum(extend_seq_lens)`, the packed layout of the eager path, while the graph's
token buffers keep the constant per-request width the capture used. With two or more requests
whose query lengths are not all the width, request r's queries are gathered from another
request's rows (and its outputs land there), so its logits are wrong; a single request, a batch
of full-width requests and the eager path are unaffected. This is SGLang's trtllm_mla
draft-extend bug: "`cu_seqlens_q` tensor layout differs in capture and replay path. In
`init_forward_metadata_capture_cuda_graph`, `cu_seqlens_q` is built with a uniform stride via
`torch.arange`. In `init_forward_metadata_replay_cuda_graph`, the replay path was building
`cu_seqlens_q` with a variable stride via `torch.cumsum(accept_length + 1)`", fixed in
https://github.com/sgl-project/sglang/pull/21987 (same root cause as PR #19807; the triton
backend had the same stride mismatch, https://github.com/sgl-project/sglang/pull/27545).

What the contract could not express: SGLang's draft-extend step runs the draft model over the
tokens the target just accepted, and its query lengths come from the verify step's accepted
counts on the device. Here the harness's speculative steps stand for it: each request's query
length (one plus the drafts it sends) plays `accept_length + 1`, and the draft model is the
one model the runner has. Nothing else was missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode import AddressView, Batch, StepResult, TargetSpec
from pytest_graphmode.runtime import backends

BLOCK_SIZE = 4
MAX_BLOCKS_PER_REQ = 4
NUM_BLOCKS = 48
NULL_BLOCK = 0
VOCAB = 64
MAX_NUM_REQS = 8
MAX_NUM_TOKENS = 16
CAPTURE_SIZES = (1, 2, 4, 8)
NUM_DRAFT_TOKENS = 4  # the draft-extend graphs' width: one token plus up to three drafts
HIDDEN = 32
HEADS = 2
HEAD_DIM = 16
LAYERS = 2
MAX_POSITIONS = MAX_BLOCKS_PER_REQ * BLOCK_SIZE
SEQ_LEN_FILL_VALUE = 1  # padding requests' sequence length, as SGLang's backends ask
_LANE = 0xFFFFFFFF

SPEC = TargetSpec(
    num_blocks=NUM_BLOCKS,
    block_size=BLOCK_SIZE,
    max_blocks_per_req=MAX_BLOCKS_PER_REQ,
    vocab_size=VOCAB,
    max_num_reqs=MAX_NUM_REQS,
    max_num_tokens=MAX_NUM_TOKENS,
    capture_sizes=CAPTURE_SIZES,
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    null_block=NULL_BLOCK,
)


class AttnMetadata:
    """What the attention kernel reads: per request `qo_indptr` (query row starts, bs + 1),
    `extend_seq_lens` (query tokens), `seq_lens` (tokens in the cache after the step), the block
    table, and `max_q`, the host bound of a request's query rows (the kernel's grid)."""

    def __init__(self, qo_indptr, extend_seq_lens, seq_lens, block_table, max_q: int) -> None:
        self.qo_indptr = qo_indptr
        self.extend_seq_lens = extend_seq_lens
        self.seq_lens = seq_lens
        self.block_table = block_table
        self.max_q = max_q


class PagedExtendAttnBackend:
    """The attention backend: builds metadata for eager steps, captures and replays."""

    def __init__(self, device: torch.device, *, packed_replay_layout: bool) -> None:
        self.device = device
        self.packed_replay_layout = packed_replay_layout
        self.graph_qo_indptr: dict[str, Tensor] = {}
        self.graph_width: dict[str, int] = {}

    # -- eager ---------------------------------------------------------------------------------
    def init_forward_metadata(
        self, extend_seq_lens: Tensor, seq_lens: Tensor, block_table, max_q: int
    ) -> AttnMetadata:
        qo_indptr = torch.zeros(extend_seq_lens.shape[0] + 1, dtype=torch.int64, device=self.device)
        qo_indptr[1:] = torch.cumsum(extend_seq_lens, 0)
        return AttnMetadata(qo_indptr, extend_seq_lens, seq_lens, block_table, max_q)

    # -- graphs --------------------------------------------------------------------------------
    def init_cuda_graph_state(self, mode: str, max_bs: int, width: int) -> None:
        self.graph_width[mode] = width
        self.graph_qo_indptr[mode] = torch.zeros(max_bs + 1, dtype=torch.int64, device=self.device)

    def init_forward_metadata_capture_cuda_graph(
        self, mode: str, bs: int, extend_seq_lens, seq_lens, block_table
    ) -> AttnMetadata:
        width = self.graph_width[mode]
        qo_indptr = self.graph_qo_indptr[mode][: bs + 1]
        qo_indptr.copy_(torch.arange(bs + 1, dtype=torch.int64, device=self.device) * width)
        return AttnMetadata(qo_indptr, extend_seq_lens, seq_lens, block_table, width)

    def init_forward_metadata_replay_cuda_graph(
        self, mode: str, bs: int, extend_seq_lens: Tensor
    ) -> None:
        qo_indptr = self.graph_qo_indptr[mode][: bs + 1]
        if self.packed_replay_layout and mode == "draft_extend":
            # The eager layout: each request's rows right after the previous request's.
            qo_indptr[:1].zero_()
            qo_indptr[1:].copy_(torch.cumsum(extend_seq_lens, 0))
        else:
            # The layout the graph was captured with: a constant width per request.
            width = self.graph_width[mode]
            qo_indptr.copy_(torch.arange(bs + 1, dtype=torch.int64, device=self.device) * width)

    # -- the kernel ----------------------------------------------------------------------------
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out_cache_loc: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttnMetadata,
    ) -> Tensor:
        k_cache.index_put_((out_cache_loc,), k)  # save the KV cache before reading it
        v_cache.index_put_((out_cache_loc,), v)
        num_rows = q.shape[0]
        bs = meta.seq_lens.shape[0]
        steps = torch.arange(meta.max_q, device=q.device)
        q_rows = meta.qo_indptr[:bs, None] + steps[None, :]  # [bs, max_q]
        q_valid = steps[None, :] < meta.extend_seq_lens[:, None]
        q_rows = torch.where(q_valid, q_rows, num_rows)  # row num_rows: a dump row
        padded_q = torch.cat([q, q.new_zeros(1, HEADS, HEAD_DIM)])[q_rows]  # [bs, max_q, H, D]

        slots = meta.block_table[:, :, None] * BLOCK_SIZE + torch.arange(
            BLOCK_SIZE, device=q.device
        )
        slots = slots.reshape(bs, -1)  # [bs, L]
        key_pos = torch.arange(slots.shape[1], device=q.device)
        key_ok = (key_pos[None, :] < meta.seq_lens[:, None]) & (meta.extend_seq_lens[:, None] > 0)
        keys = torch.where(key_ok[:, :, None, None], k_cache[slots], 0.0)  # no NaN past the end
        values = torch.where(key_ok[:, :, None, None], v_cache[slots], 0.0)
        q_pos = (meta.seq_lens - meta.extend_seq_lens)[:, None] + steps[None, :]  # [bs, max_q]
        allowed = (key_pos[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
        allowed = allowed & key_ok[:, None, :]  # [bs, max_q, L]
        scores = torch.einsum("bwhd,blhd->bhwl", padded_q, keys) * HEAD_DIM**-0.5
        scores = torch.where(allowed[:, None], scores, -1e30)
        probs = torch.where(allowed[:, None], torch.softmax(scores, dim=-1), 0.0)
        out = torch.einsum("bhwl,blhd->bwhd", probs, values)

        unpadded = q.new_zeros(num_rows + 1, HEADS, HEAD_DIM)
        unpadded.index_put_((q_rows.reshape(-1),), out.reshape(-1, HEADS, HEAD_DIM))
        return unpadded[:num_rows]


class TinyDecoder:
    """Token and position embeddings, LAYERS x (attention + SiLU MLP, residual), an LM head."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        shapes = {
            "embed": (VOCAB, HIDDEN),
            "pos": (MAX_POSITIONS, HIDDEN),
            "lm_head": (HIDDEN, VOCAB),
        }
        for layer in range(LAYERS):
            shapes[f"qkv{layer}"] = (HIDDEN, 3 * HEADS * HEAD_DIM)
            shapes[f"o{layer}"] = (HEADS * HEAD_DIM, HIDDEN)
            shapes[f"up{layer}"] = (HIDDEN, 4 * HIDDEN)
            shapes[f"down{layer}"] = (2 * HIDDEN, HIDDEN)
        self.weights = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load_weights(seed)
        slots = NUM_BLOCKS * BLOCK_SIZE
        self.k_cache = [torch.zeros(slots, HEADS, HEAD_DIM, device=device) for _ in range(LAYERS)]
        self.v_cache = [torch.zeros(slots, HEADS, HEAD_DIM, device=device) for _ in range(LAYERS)]

    def load_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for weight in self.weights.values():
            fan_in = weight.shape[0]
            values = torch.randn(weight.shape, generator=generator) / fan_in**0.5
            weight.copy_(values.to(self.device))  # in place: the graphs keep these addresses

    def forward(
        self,
        input_ids,
        positions,
        out_cache_loc,
        last_index,
        meta: AttnMetadata,
        attn: PagedExtendAttnBackend,
    ) -> Tensor:
        w = self.weights
        x = w["embed"][input_ids] + w["pos"][positions]
        for layer in range(LAYERS):
            qkv = (x @ w[f"qkv{layer}"]).view(-1, 3, HEADS, HEAD_DIM)
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
            o = attn.forward(
                q,
                k.contiguous(),
                v.contiguous(),
                out_cache_loc,
                self.k_cache[layer],
                self.v_cache[layer],
                meta,
            )
            x = x + o.reshape(-1, HEADS * HEAD_DIM) @ w[f"o{layer}"]
            gate, up = (x @ w[f"up{layer}"]).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w[f"down{layer}"]
        return x[last_index] @ w["lm_head"]  # logits at each request's last query token


def _mix(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _LANE
    x = x ^ (x >> 16)
    x = (x * 0x119DE1F3) & _LANE
    return x ^ (x >> 16)


def sample(logits: Tensor, seeds: Tensor, temperatures: Tensor, positions: Tensor) -> Tensor:
    """Gumbel-max over hashed noise; a negative seed is greedy."""
    token_ids = torch.arange(VOCAB, device=logits.device)
    h = _mix(token_ids[None, :] ^ 0x3C6EF372)
    h = _mix(h ^ (positions[:, None] & _LANE))
    h = _mix(h ^ (seeds[:, None] & _LANE))
    uniform = ((h >> 8).float() + 0.5) / float(1 << 24)
    gumbel = -torch.log(-torch.log(uniform))
    greedy = seeds < 0
    temps = torch.where(greedy, 1.0, temperatures)
    sampled = torch.argmax(logits / temps[:, None] + gumbel, dim=-1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


def _host_seed(seed: int | None) -> int:
    return -1 if seed is None else seed % 0x7FFFFFFF


class CudaGraphRunner:
    """Graphs of one mode ("decode": width 1, "draft_extend": width NUM_DRAFT_TOKENS), one per
    batch size, with persistent input buffers at their largest shape."""

    def __init__(
        self,
        mode: str,
        width: int,
        sizes: Sequence[int],
        model: TinyDecoder,
        attn: PagedExtendAttnBackend,
        be,
        pool,
    ) -> None:
        self.mode, self.width, self.sizes = mode, width, tuple(sizes)
        self.model, self.attn, self.be = model, attn, be
        dev = model.device
        max_bs = max(self.sizes)
        max_rows = max_bs * width
        self.buffers = {
            "input_ids": torch.zeros(max_rows, dtype=torch.int64, device=dev),
            "positions": torch.zeros(max_rows, dtype=torch.int64, device=dev),
            "out_cache_loc": torch.zeros(max_rows, dtype=torch.int64, device=dev),
            "extend_seq_lens": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "seq_lens": torch.full((max_bs,), SEQ_LEN_FILL_VALUE, dtype=torch.int64, device=dev),
            "block_table": torch.zeros(max_bs, MAX_BLOCKS_PER_REQ, dtype=torch.int64, device=dev),
            "last_index": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "seeds": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "temperatures": torch.ones(max_bs, device=dev),
            "sample_positions": torch.zeros(max_bs, dtype=torch.int64, device=dev),
        }
        attn.init_cuda_graph_state(mode, max_bs, width)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        for bs in sorted(self.sizes, reverse=True):  # largest first, one shared pool
            self.capture_one(bs, pool)

    def static_buffers(self) -> dict[str, Tensor]:
        named = {f"{self.mode}.{k}": v for k, v in self.buffers.items()}
        named[f"{self.mode}.qo_indptr"] = self.attn.graph_qo_indptr[self.mode]
        return named

    def _forward(self, bs: int, meta: AttnMetadata) -> tuple[Tensor, Tensor]:
        b, rows = self.buffers, bs * self.width
        logits = self.model.forward(
            b["input_ids"][:rows],
            b["positions"][:rows],
            b["out_cache_loc"][:rows],
            b["last_index"][:bs],
            meta,
            self.attn,
        )
        tokens = sample(logits, b["seeds"][:bs], b["temperatures"][:bs], b["sample_positions"][:bs])
        return logits, tokens

    def capture_one(self, bs: int, pool) -> None:
        self.write_inputs(Batch(()), bs)  # every row padding during warm-up and capture
        b = self.buffers
        meta = self.attn.init_forward_metadata_capture_cuda_graph(
            self.mode, bs, b["extend_seq_lens"][:bs], b["seq_lens"][:bs], b["block_table"][:bs]
        )
        self._forward(bs, meta)  # warm-up outside the graph
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=pool):
            self.outputs[bs] = self._forward(bs, meta)
        self.graphs[bs] = graph

    def graph_size(self, batch: Batch) -> int | None:
        return next((s for s in self.sizes if s >= batch.num_reqs), None)

    def write_inputs(self, batch: Batch, bs: int) -> None:
        """The batch into the buffers' first bs requests (bs * width rows), the rest padding."""
        width, null_slot = self.width, NULL_BLOCK * BLOCK_SIZE
        rows = bs * width
        ids, pos, loc = [0] * rows, [0] * rows, [null_slot] * rows
        q_lens, seq_lens = [0] * bs, [SEQ_LEN_FILL_VALUE] * bs
        table = [[NULL_BLOCK] * MAX_BLOCKS_PER_REQ for _ in range(bs)]
        last = [r * width for r in range(bs)]
        seeds, temps, sample_pos = [-1] * bs, [1.0] * bs, [0] * bs
        for r, req in enumerate(batch.requests):
            start = r * width
            for j, token in enumerate(req.tokens):
                p = req.context_len + j
                ids[start + j], pos[start + j] = token, p
                loc[start + j] = req.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            q_lens[r], seq_lens[r] = req.query_len, req.seq_len
            table[r][: len(req.block_ids)] = req.block_ids
            last[r] = start + req.query_len - 1
            seeds[r], temps[r] = _host_seed(req.seed), float(req.temperature)
            sample_pos[r] = req.seq_len - 1
        b = self.buffers
        for name, values, count in (
            ("input_ids", ids, rows),
            ("positions", pos, rows),
            ("out_cache_loc", loc, rows),
            ("extend_seq_lens", q_lens, bs),
            ("seq_lens", seq_lens, bs),
            ("block_table", table, bs),
            ("last_index", last, bs),
            ("seeds", seeds, bs),
            ("temperatures", temps, bs),
            ("sample_positions", sample_pos, bs),
        ):
            b[name][:count].copy_(torch.tensor(values, dtype=b[name].dtype))

    def replay(self, batch: Batch, bs: int) -> StepResult:
        self.write_inputs(batch, bs)
        self.attn.init_forward_metadata_replay_cuda_graph(
            self.mode, bs, self.buffers["extend_seq_lens"][:bs]
        )
        self.graphs[bs].replay()
        logits, tokens = self.outputs[bs]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", (self.mode, bs))

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


class DraftExtendTarget:
    def __init__(
        self,
        mode: Literal["graph", "eager"],
        *,
        seed: int,
        backend: str,
        packed_replay_layout: bool,
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.be = backends.get(backend)
        self.be.activate()
        self._closed = False
        try:
            with torch.inference_mode():
                device = self.be.device
                self.model = TinyDecoder(seed, device)
                self.attn = PagedExtendAttnBackend(
                    device, packed_replay_layout=packed_replay_layout
                )
                self.runners: list[CudaGraphRunner] = []
                if mode == "graph":
                    pool = self.be.graph_pool_handle()
                    sizes = [s for s in CAPTURE_SIZES if s <= MAX_NUM_REQS]
                    self.runners = [
                        CudaGraphRunner(
                            "draft_extend",
                            NUM_DRAFT_TOKENS,
                            sizes,
                            self.model,
                            self.attn,
                            self.be,
                            pool,
                        ),
                        CudaGraphRunner("decode", 1, sizes, self.model, self.attn, self.be, pool),
                    ]
        except BaseException:
            self.be.deactivate()
            raise

    # -- routing -------------------------------------------------------------------------------
    def _route(self, batch: Batch) -> tuple[CudaGraphRunner | None, int, str | None]:
        if not self.runners:
            return None, 0, "eager target"
        if any(r.context_len == 0 and r.query_len > 1 for r in batch.requests):
            return None, 0, "prefill chunk: extend runs eagerly"
        longest = max(batch.query_lens)
        if longest > NUM_DRAFT_TOKENS:
            return None, 0, f"query of {longest} tokens exceeds the draft width"
        runner = self.runners[1] if longest == 1 else self.runners[0]
        bs = runner.graph_size(batch)
        if bs is None:
            return None, 0, f"{batch.num_reqs} requests exceed the largest graph"
        return runner, bs, None

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            runner, bs, reason = self._route(batch)
            if runner is not None:
                return runner.replay(batch, bs)
            return self._eager(batch, reason)

    def _eager(self, batch: Batch, reason: str | None) -> StepResult:
        dev = self.be.device
        ids, pos, loc, last = [], [], [], []
        for req in batch.requests:
            for j, token in enumerate(req.tokens):
                p = req.context_len + j
                ids.append(token)
                pos.append(p)
                loc.append(req.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            last.append(len(ids) - 1)
        table = [
            list(r.block_ids) + [NULL_BLOCK] * (MAX_BLOCKS_PER_REQ - len(r.block_ids))
            for r in batch.requests
        ]

        def dev_tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=dev)

        meta = self.attn.init_forward_metadata(
            dev_tensor(list(batch.query_lens)),
            dev_tensor([r.seq_len for r in batch.requests]),
            dev_tensor(table),
            max(batch.query_lens),
        )
        logits = self.model.forward(
            dev_tensor(ids), dev_tensor(pos), dev_tensor(loc), dev_tensor(last), meta, self.attn
        )
        tokens = sample(
            logits,
            dev_tensor([_host_seed(r.seed) for r in batch.requests]),
            dev_tensor([float(r.temperature) for r in batch.requests], torch.float32),
            dev_tensor([r.seq_len - 1 for r in batch.requests]),
        )
        return StepResult(logits, tokens, "eager", None, reason)

    # -- the rest of the contract --------------------------------------------------------------
    def state(self) -> Mapping[str, Tensor]:
        state = {}
        for layer in range(LAYERS):
            state[f"k{layer}"] = self.model.k_cache[layer]
            state[f"v{layer}"] = self.model.v_cache[layer]
        return state

    def static_buffers(self) -> Mapping[str, Tensor]:
        buffers: dict[str, Tensor] = {}
        for runner in self.runners:
            buffers.update(runner.static_buffers())
        return buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load_weights(seed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for runner in self.runners:
                runner.close()
        finally:
            self.be.deactivate()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DraftExtendTarget:
    return DraftExtendTarget(mode, seed=seed, backend=backend, packed_replay_layout=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> DraftExtendTarget:
    return DraftExtendTarget(mode, seed=seed, backend=backend, packed_replay_layout=True)
