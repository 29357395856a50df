"""A decoder whose graph merges "multimodal" embeddings into its inputs, as VLM runners do.

The runner: a one-layer decoder over a slot-major paged KV cache (block tables, learned positions,
SiLU MLP, LM head, counter-based Gumbel sampling). Token ids in the reserved top range of the
vocabulary (`MM_START .. vocab - 1`, the last 16 ids) are "placeholder" tokens: their embedding
does not come from the token table but from a small encoder projection, an MLP of (id, position),
standing in for a vision tower whose features are scattered into `inputs_embeds`. As in vLLM V1 /
SGLang, the encoder runs eagerly before the step; the captured decode graph reads one persistent
`inputs_embeds` buffer of max shape and one persistent `is_mm` mask, and merges inside the graph:

    x = torch.where(is_mm[:, None], inputs_embeds, embed[input_ids]) + pos[positions]

Correct runner (`make_target`): before every replay `prepare` writes the encoder output of every
multimodal row into `inputs_embeds` and rewrites the whole `is_mm[:size]` mask (True for mm rows,
False for text rows and for padding rows). Text and padding rows of `inputs_embeds` may hold
anything (the poison, a previous step's image features): `torch.where` never reads them.

Bug (`make_buggy_target`): `prepare` updates the mm state only for the rows that carry a
multimodal token this step (scatter of the encoder output plus `is_mm[rows] = True`, "text rows
are embedded in the graph from input_ids anyway"). The mask is never cleared, so a text row (or a
padding row) in a slot that held a multimodal row at an earlier step still has `is_mm=True` and
reads that step's stale image embedding instead of its token's embedding.

Modelled on: the inputs_embeds / multimodal-mask persistent-buffer handling of vLLM and SGLang
graph runners, e.g.
  - https://github.com/vllm-project/vllm/pull/18973 (vLLM V1 copies the merged mm embeddings into
    the persistent `self.inputs_embeds` buffer; the PR debates when the copy/padding can be
    skipped),
  - https://github.com/sgl-project/sglang/pull/29018 (SGLang: graph replay must keep
    input_embeds=None for text-only requests, a registered static embeds tensor made multimodal
    models skip token embeddings),
  - https://github.com/alibaba/rtp-llm/pull/1233 (rtp-llm: multimodal injection depends on
    request-owned tensors/masks (`text_tokens_mask`) not copied into captured graph inputs),
  - https://github.com/vllm-project/vllm/pull/35917 (VLMs saw blank images only with CUDA graphs).
No engine code is copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
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
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NUM_MM_IDS = 16
MM_START = SPEC.vocab_size - NUM_MM_IDS  # ids MM_START.. are multimodal placeholders
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
_MASK32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    inputs_embeds: Tensor  # [T, hidden] encoder output where is_mm, anything elsewhere
    is_mm: Tensor  # [T] bool
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] last token of each request (eager path)


class TinyVLM:
    """Token table + an "encoder" MLP for placeholder ids; decoder has no host reads."""

    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "enc_tok": (NUM_MM_IDS, HIDDEN),
            "enc_pos": (CONTEXT, HIDDEN),
            "enc_up": (HIDDEN, 2 * HIDDEN),
            "enc_down": (2 * HIDDEN, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        self.device = device
        self.w = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):  # in place: graphs keep reading these tensors
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(self.device))

    def encode(self, ids: Tensor, positions: Tensor) -> Tensor:
        """The multimodal projection of placeholder ids (clamped into the mm range)."""
        w = self.w
        local = ids.clamp(min=MM_START) - MM_START
        h = w["enc_tok"][local] + w["enc_pos"][positions]
        return torch.nn.functional.silu(h @ w["enc_up"]) @ w["enc_down"]

    def forward(self, inp: StepInputs, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        w = self.w
        text = w["embed"][inp.tokens]
        x = torch.where(inp.is_mm[:, None], inp.inputs_embeds, text) + w["pos"][inp.positions]
        h = _rms(x)
        q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
        k_cache.index_copy_(0, inp.slots, k.view(-1, HEADS, HEAD_DIM))
        v_cache.index_copy_(0, inp.slots, v.view(-1, HEADS, HEAD_DIM))
        x = x + _attention(q, k_cache, v_cache, inp) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        if inp.last is not None:
            x = x[inp.last]
        return _rms(x) @ w["head"]


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, inp: StepInputs) -> Tensor:
    size = SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    ctx = (inp.tables[:, :, None] * size + offsets).flatten(1)  # [T, CONTEXT]
    keys, values = k_cache[ctx], v_cache[ctx]
    visible = torch.arange(CONTEXT, device=q.device)[None, :] <= inp.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs, values).flatten(1)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def sample(logits: Tensor, inp: StepInputs) -> Tensor:
    """Gumbel-max with noise hashed from (seed, position, token id): batch-independent."""
    positions = inp.positions if inp.last is None else inp.positions[inp.last]
    key = _mix(_mix(inp.seeds) ^ ((positions * 0x9E3779B1) & _MASK32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _MASK32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inp.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


def _slot(r: Request, position: int) -> int:
    return r.block_ids[position // SPEC.block_size] * SPEC.block_size + position % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & _MASK32, r.temperature, True


_PADDING: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


class EmbedsRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, stale_mask: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.stale_mask = stale_mask
        self.backend: Any = get_backend(backend)
        dev = self.backend.device
        self.model = TinyVLM(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=dev)
        self.v_cache = torch.zeros(shape, device=dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            rows = SPEC.capture_sizes[-1]
            i64 = torch.int64
            self.buffers = {
                "tokens": torch.zeros(rows, dtype=i64, device=dev),
                "positions": torch.zeros(rows, dtype=i64, device=dev),
                "slots": torch.full((rows,), NULL_SLOT, dtype=i64, device=dev),
                "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "inputs_embeds": torch.zeros(rows, HIDDEN, device=dev),
                "is_mm": torch.zeros(rows, dtype=torch.bool, device=dev),
                "seeds": torch.zeros(rows, dtype=i64, device=dev),
                "temperatures": torch.ones(rows, device=dev),
                "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
            }
            self.capture()

    # -- graph mode ---------------------------------------------------------------------------

    def static_inputs(self, size: int) -> StepInputs:
        return StepInputs(**{name: buf[:size] for name, buf in self.buffers.items()})

    def capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inputs = self.static_inputs(size)
            self.run_model(inputs)  # warm-up
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[size] = self.run_model(inputs)
            self.graphs[size] = graph

    def prepare(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        dev = self.backend.device
        rows: dict[str, list[Any]] = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "seeds": [_sampling(r)[0] for r in reqs],
            "temperatures": [_sampling(r)[1] for r in reqs],
            "sampled": [_sampling(r)[2] for r in reqs],
        }
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(_PADDING[name])
        # The "encoder" runs eagerly; its output is scattered into the persistent buffer.
        mm_rows = [i for i, r in enumerate(reqs) if r.tokens[0] >= MM_START]
        if mm_rows:
            idx = torch.tensor(mm_rows, dtype=torch.int64, device=dev)
            ids = torch.tensor([reqs[i].tokens[0] for i in mm_rows], dtype=torch.int64, device=dev)
            pos = torch.tensor(
                [reqs[i].context_len for i in mm_rows], dtype=torch.int64, device=dev
            )
            self.buffers["inputs_embeds"].index_copy_(0, idx, self.model.encode(ids, pos))
        if self.stale_mask:
            # BUG: only the rows with a multimodal token are flagged; the mask of text rows and
            # padding rows keeps whatever an earlier step left there.
            if mm_rows:
                self.buffers["is_mm"].index_fill_(0, idx, True)
        else:
            flags = [i in mm_rows for i in range(size)]  # padding rows: False
            self.buffers["is_mm"][:size].copy_(torch.tensor(flags, dtype=torch.bool))

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- both modes ---------------------------------------------------------------------------

    def run_model(self, inp: StepInputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, self.k_cache, self.v_cache)
        return logits, sample(logits, inp)

    def eager_inputs(self, batch: Batch) -> StepInputs:
        dev = self.backend.device
        tokens, positions, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for i, t in enumerate(r.tokens):
                tokens.append(t)
                positions.append(r.context_len + i)
                slots.append(_slot(r, r.context_len + i))
                tables.append(_table(r))
            last.append(len(tokens) - 1)
        samp = [_sampling(r) for r in batch.requests]

        def t(values: list[Any], dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        tok, pos = t(tokens), t(positions)
        return StepInputs(
            tokens=tok,
            positions=pos,
            slots=t(slots),
            tables=t(tables).view(-1, SPEC.max_blocks_per_req),
            inputs_embeds=self.model.encode(tok, pos),  # used only where is_mm
            is_mm=tok >= MM_START,
            seeds=t([s[0] for s in samp]),
            temperatures=t([s[1] for s in samp], torch.float32),
            sampled=t([s[2] for s in samp], torch.bool),
            last=t(last),
        )

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(q != 1 for q in batch.query_lens) or any(r.context_len == 0 for r in batch.requests):
            return "not a plain decode batch"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            return self.replay(batch)
        logits, tokens = self.run_model(self.eager_inputs(batch))
        return StepResult(logits, tokens, "eager", None, reason=reason)

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> EmbedsRunner:
    return EmbedsRunner(mode, seed=seed, backend=backend, stale_mask=False)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> EmbedsRunner:
    return EmbedsRunner(mode, seed=seed, backend=backend, stale_mask=True)
