"""DeepSeek-style Multi-head Latent Attention (MLA) graph runner in bfloat16.

What it is
----------
A two-layer decoder whose attention is MLA (DeepSeek-V2 style, no q-LoRA): each token writes one
row per layer into a paged, slot-major cache: its compressed latent `c_kv` (`KV_LORA_RANK`
values, after `kv_a_layernorm`) followed by its decoupled, already-rotated RoPE key `k_pe`
(`ROPE_DIM` values, shared by all heads). Like vLLM's and SGLang's MLA backends the runner has
two mathematically equal attention paths that round differently in bfloat16:

* the "naive" path (prefill, mixed, speculative and oversized batches, and every step of the
  eager twin): the latent is up-projected through `kv_b_proj` into per-head `k_nope` and `v`,
  `k_pe` is broadcast over heads, and ordinary attention runs;
* the "absorbed" path (the decode CUDA graphs, one query token per row): `W_UK` is absorbed into
  the query (`q_nope @ W_UK -> q_latent`), attention scores are taken against the latent itself,
  the probabilities reduce the latent, and `W_UV` is applied after attention. `W_UK_T` and
  `W_UV` are materialised from `kv_b_proj.weight` by `process_weights_after_loading()` (vLLM's
  name; SGLang calls the pair `w_kc` / `w_vc`, made in `post_load_weights`).

Scores and softmax are float32 on both paths (as FlashMLA / FlashAttention accumulate them), the
probabilities are cast to bfloat16 for the value reduction. Sampling is Gumbel-max with noise
hashed from (seed, position, token id), so it depends on nothing baked into a graph.
Graph mode captures one decode graph per capture size (1, 2, 4) into one shared pool at start-up,
written against plain `torch.cuda` (the harness's sim drop-in stands in for it).

The bug (`make_buggy_target`)
-----------------------------
`update_weights` (an RLHF weight sync) copies the new checkpoint into every parameter in place,
`kv_b_proj` included, but does not run `process_weights_after_loading()` again, so the absorbed
`W_UK_T` / `W_UV` that the decode graphs read still hold the old `kv_b_proj`. The naive path
(prefill, eager fallback, the eager twin) reads `kv_b_proj` directly and is right; only the
replayed decode steps use the stale absorbed weights. Modelled on SGLang's DeepSeek weight-update
bugs around the derived `w_kc` / `w_vc`: https://github.com/sgl-project/sglang/pull/4961
("[Fix] weights update for deepseek when enabling cuda graph": after `load_weights` the derived
w_kc / w_vc changed, conflicting with the captured graphs) and
https://github.com/sgl-project/sglang/pull/6265 ("Fix DeepSeekV3ForCausalLM.post_load_weights for
multiple update weight": the derivation step must be re-run, into the same tensors, on every RL
update). vLLM's equivalent is MLA's `process_weights_after_loading` (W_UK_T / W_UV), which a
weight reload that skips post-processing leaves stale.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec

SPEC = TargetSpec(
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, LAYERS = 64, 4, 2
NOPE_DIM, ROPE_DIM, V_DIM, KV_LORA_RANK = 16, 8, 16, 32
QK_DIM = NOPE_DIM + ROPE_DIM
ENTRY = KV_LORA_RANK + ROPE_DIM  # one cache row: [c_kv | k_pe]
SCALE = 1.0 / math.sqrt(QK_DIM)
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
DTYPE = torch.bfloat16
_M32 = 0xFFFFFFFF


@dataclass
class StepInputs:
    tokens: Tensor  # [T]
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    tables: Tensor  # [T, max_blocks_per_req]
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R]
    sampled: Tensor  # [R] bool
    last: Tensor | None = None  # [R] last token of each request (None: one token a request)


def _rms(x: Tensor, weight: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight


class MLAModel:
    """Parameters (`load_weights`) plus the derived absorbed matrices (`process_weights_after_loading`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        shapes: dict[str, tuple[int, ...]] = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            "final_norm": (HIDDEN,),
        }
        for i in range(LAYERS):
            shapes |= {
                f"attn_norm{i}": (HIDDEN,),
                f"q_proj{i}": (HIDDEN, HEADS * QK_DIM),
                f"kv_a_proj{i}": (HIDDEN, ENTRY),
                f"kv_a_norm{i}": (KV_LORA_RANK,),
                # nn.Linear layout: [out = heads * (nope + v), in = kv_lora_rank]
                f"kv_b_proj{i}": (HEADS * (NOPE_DIM + V_DIM), KV_LORA_RANK),
                f"o_proj{i}": (HEADS * V_DIM, HIDDEN),
                f"mlp_norm{i}": (HIDDEN,),
                f"up{i}": (HIDDEN, 2 * HIDDEN),
                f"down{i}": (2 * HIDDEN, HIDDEN),
            }
        self.params = {n: torch.empty(s, device=device, dtype=DTYPE) for n, s in shapes.items()}
        # Derived for the absorbed decode path, as vLLM's W_UK_T / W_UV (SGLang's w_kc / w_vc).
        self.w_uk_t = [
            torch.empty(HEADS, NOPE_DIM, KV_LORA_RANK, device=device, dtype=DTYPE)
            for _ in range(LAYERS)
        ]
        self.w_uv = [
            torch.empty(HEADS, KV_LORA_RANK, V_DIM, device=device, dtype=DTYPE)
            for _ in range(LAYERS)
        ]
        half = ROPE_DIM // 2
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(half, device=device).float() / half))
        self.offsets = torch.arange(SPEC.block_size, device=device)
        self.ctx_pos = torch.arange(CONTEXT, device=device)

    def load_weights(self, seed: int) -> None:
        """In place: captured graphs keep reading the same parameter tensors."""
        g = torch.Generator().manual_seed(seed)
        for name in sorted(self.params):
            p = self.params[name]
            if "norm" in name:
                fresh = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name == "embed":
                fresh = torch.randn(p.shape, generator=g)
            else:
                fresh = torch.randn(p.shape, generator=g) / math.sqrt(
                    p.shape[-1] if name.startswith("kv_b") else p.shape[0]
                )
            p.copy_(fresh.to(device=self.device, dtype=DTYPE))

    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj into the absorbed W_UK_T [H, nope, r] and W_UV [H, r, v], in place."""
        for i in range(LAYERS):
            w = self.params[f"kv_b_proj{i}"].view(HEADS, NOPE_DIM + V_DIM, KV_LORA_RANK)
            self.w_uk_t[i].copy_(w[:, :NOPE_DIM, :])
            self.w_uv[i].copy_(w[:, NOPE_DIM:, :].transpose(1, 2))

    # -- forward -------------------------------------------------------------------------------

    def rope(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate-half RoPE on the last dim of x [T, ..., ROPE_DIM]."""
        ang = positions.float()[:, None] * self.inv_freq[None, :]  # [T, half]
        shape = (ang.shape[0],) + (1,) * (x.dim() - 2) + (ang.shape[1],)
        cos, sin = ang.cos().view(shape), ang.sin().view(shape)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(self, inp: StepInputs, caches: list[Tensor], absorbed: bool) -> Tensor:
        p = self.params
        x = p["embed"][inp.tokens]  # [T, hidden]
        for i, cache in enumerate(caches):
            h = _rms(x, p[f"attn_norm{i}"])
            q = (h @ p[f"q_proj{i}"]).view(-1, HEADS, QK_DIM)
            q_nope, q_pe = q[..., :NOPE_DIM], self.rope(q[..., NOPE_DIM:], inp.positions)
            ckv = h @ p[f"kv_a_proj{i}"]  # [T, r + rope]
            latent = _rms(ckv[:, :KV_LORA_RANK], p[f"kv_a_norm{i}"])
            k_pe = self.rope(ckv[:, KV_LORA_RANK:], inp.positions)
            cache.index_copy_(0, inp.slots, torch.cat((latent, k_pe), dim=-1))
            lat, kpe, visible = self.gather(cache, inp)
            if absorbed:
                out = self.attend_absorbed(i, q_nope, q_pe, lat, kpe, visible)
            else:
                out = self.attend_naive(i, q_nope, q_pe, lat, kpe, visible)
            x = x + out.reshape(-1, HEADS * V_DIM) @ p[f"o_proj{i}"]
            m = _rms(x, p[f"mlp_norm{i}"])
            x = x + torch.nn.functional.silu(m @ p[f"up{i}"]) @ p[f"down{i}"]
        if inp.last is not None:
            x = x[inp.last]
        return (_rms(x, p["final_norm"]) @ p["head"]).float()

    def gather(self, cache: Tensor, inp: StepInputs) -> tuple[Tensor, Tensor, Tensor]:
        """Every context slot of each token's request; masked slots zeroed (the null block is NaN)."""
        slots = (inp.tables[:, :, None] * SPEC.block_size + self.offsets).flatten(1)  # [T, C]
        entries = cache[slots]  # [T, C, r + rope]
        visible = self.ctx_pos[None, :] <= inp.positions[:, None]  # [T, C]
        entries = torch.where(visible[:, :, None], entries, entries.new_zeros(()))
        return entries[..., :KV_LORA_RANK], entries[..., KV_LORA_RANK:], visible

    @staticmethod
    def _softmax(scores: Tensor, visible: Tensor) -> Tensor:
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        return scores.softmax(-1).to(DTYPE)

    def attend_naive(
        self, i: int, q_nope: Tensor, q_pe: Tensor, lat: Tensor, kpe: Tensor, visible: Tensor
    ) -> Tensor:
        """Up-project the latent to per-head K and V, then ordinary attention."""
        kv = (lat @ self.params[f"kv_b_proj{i}"].t()).view(*lat.shape[:2], HEADS, NOPE_DIM + V_DIM)
        k_nope, v = kv[..., :NOPE_DIM], kv[..., NOPE_DIM:]  # [T, C, H, *]
        k = torch.cat((k_nope, kpe[:, :, None, :].expand(-1, -1, HEADS, -1)), dim=-1)
        qf = torch.cat((q_nope, q_pe), dim=-1).float()
        scores = torch.einsum("thd,tchd->thc", qf, k.float()) * SCALE
        probs = self._softmax(scores, visible)
        return torch.einsum("thc,tchv->thv", probs, v)  # [T, H, v]

    def attend_absorbed(
        self, i: int, q_nope: Tensor, q_pe: Tensor, lat: Tensor, kpe: Tensor, visible: Tensor
    ) -> Tensor:
        """W_UK absorbed into the query, attention over the latent, W_UV after."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk_t[i]).transpose(0, 1)  # [T, H, r]
        scores = (
            torch.einsum("thr,tcr->thc", q_lat.float(), lat.float())
            + torch.einsum("thp,tcp->thc", q_pe.float(), kpe.float())
        ) * SCALE
        probs = self._softmax(scores, visible)
        o_lat = torch.einsum("thc,tcr->thr", probs, lat)  # [T, H, r]
        return torch.bmm(o_lat.transpose(0, 1), self.w_uv[i]).transpose(0, 1)  # [T, H, v]


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x7FEB352D) & _M32
    x = (((x >> 15) ^ x) * 0x846CA68B) & _M32
    return (x >> 16) ^ x


def sample(logits: Tensor, inp: StepInputs) -> Tensor:
    positions = inp.positions if inp.last is None else inp.positions[inp.last]
    key = _mix(_mix(inp.seeds) ^ ((positions * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x27D4EB2F) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / inp.temperatures[:, None] - torch.log(-torch.log(uniform))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


_PAD: dict[str, Any] = {
    "tokens": 0,
    "positions": 0,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _slot(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def _table(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def _sampling(r: Request) -> tuple[int, float, bool]:
    if r.seed is None:
        return 0, 1.0, False
    return r.seed & _M32, float(r.temperature), True


class MLARunner:
    refresh_absorbed_on_update = True

    def __init__(self, mode: Literal["graph", "eager"], *, seed: int) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(mode)
        self.spec = SPEC
        self.mode = mode
        self.device = torch.device("cuda")
        with torch.inference_mode():
            self.model = MLAModel(self.device)
            self.model.load_weights(seed)
            self.model.process_weights_after_loading()
            self.caches = [
                torch.zeros(
                    SPEC.num_blocks, SPEC.block_size, ENTRY, device=self.device, dtype=DTYPE
                )
                for _ in range(LAYERS)
            ]
            self.views = {
                f"kv{i}": c.view(SPEC.num_slots, ENTRY) for i, c in enumerate(self.caches)
            }
            self.graphs: dict[int, Any] = {}
            self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
            self.buffers: dict[str, Tensor] = {}
            if mode == "graph":
                self.buffers = self._allocate(SPEC.capture_sizes[-1])
                self._capture()

    # -- graph mode ----------------------------------------------------------------------------

    def _allocate(self, rows: int) -> dict[str, Tensor]:
        d, i64 = self.device, torch.int64
        return {
            "tokens": torch.zeros(rows, dtype=i64, device=d),
            "positions": torch.zeros(rows, dtype=i64, device=d),
            "slots": torch.zeros(rows, dtype=i64, device=d),
            "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=d),
            "seeds": torch.zeros(rows, dtype=i64, device=d),
            "temperatures": torch.ones(rows, dtype=torch.float32, device=d),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=d),
        }

    def _static(self, size: int) -> StepInputs:
        return StepInputs(**{n: b[:size] for n, b in self.buffers.items()})

    def _run(self, inp: StepInputs, absorbed: bool) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, list(self.views.values()), absorbed)
        return logits, sample(logits, inp)

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._prepare(Batch(()), size)
            inp = self._static(size)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up, as vLLM does, off the default stream
                self._run(inp, absorbed=True)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._run(inp, absorbed=True)
            self.graphs[size] = graph

    def _prepare(self, batch: Batch, size: int) -> None:
        reqs = batch.requests
        n = len(reqs)
        samp = [_sampling(r) for r in reqs]
        rows = {
            "tokens": [r.tokens[0] for r in reqs],
            "positions": [r.context_len for r in reqs],
            "slots": [_slot(r, r.context_len) for r in reqs],
            "tables": [_table(r) for r in reqs],
            "seeds": [s[0] for s in samp],
            "temperatures": [s[1] for s in samp],
            "sampled": [s[2] for s in samp],
        }
        for name, values in rows.items():
            buf = self.buffers[name]
            if n:
                buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
            buf[n:size].fill_(_PAD[name])

    def _replay(self, batch: Batch) -> StepResult:
        size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
        self._prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))

    # -- eager (naive MLA) ---------------------------------------------------------------------

    def _eager(self, batch: Batch, reason: str) -> StepResult:
        toks, pos, slots, tables, last = [], [], [], [], []
        for r in batch.requests:
            for j, t in enumerate(r.tokens):
                toks.append(t)
                pos.append(r.context_len + j)
                slots.append(_slot(r, r.context_len + j))
                tables.append(_table(r))
            last.append(len(toks) - 1)
        samp = [_sampling(r) for r in batch.requests]
        d = self.device
        inp = StepInputs(
            tokens=torch.tensor(toks, dtype=torch.int64, device=d),
            positions=torch.tensor(pos, dtype=torch.int64, device=d),
            slots=torch.tensor(slots, dtype=torch.int64, device=d),
            tables=torch.tensor(tables, dtype=torch.int64, device=d).view(
                -1, SPEC.max_blocks_per_req
            ),
            seeds=torch.tensor([s[0] for s in samp], dtype=torch.int64, device=d),
            temperatures=torch.tensor([s[1] for s in samp], dtype=torch.float32, device=d),
            sampled=torch.tensor([s[2] for s in samp], dtype=torch.bool, device=d),
            last=torch.tensor(last, dtype=torch.int64, device=d),
        )
        logits, tokens = self._run(inp, absorbed=False)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if any(r.context_len == 0 for r in batch.requests) or not batch.uniform:
            return f"{batch.phase} batch (naive MLA)"
        if batch.query_lens[0] != 1:
            return "speculative decode (naive MLA)"
        if batch.num_reqs > SPEC.capture_sizes[-1]:
            return "more requests than the largest decode graph"
        return None

    # -- contract ------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            if reason is None:
                return self._replay(batch)
            if batch.num_reqs == 0:
                empty = torch.empty(0, SPEC.vocab_size, device=self.device)
                return StepResult(
                    empty,
                    torch.empty(0, dtype=torch.int64, device=self.device),
                    "eager",
                    None,
                    reason=reason,
                )
            return self._eager(batch, reason)

    def state(self) -> Mapping[str, Tensor]:
        return self.views

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load_weights(seed)
            if self.refresh_absorbed_on_update:
                self.model.process_weights_after_loading()

    def close(self) -> None:
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()


class StaleAbsorbedRunner(MLARunner):
    # BUG: the RL weight sync reloads kv_b_proj but skips process_weights_after_loading(), so the
    # absorbed W_UK_T / W_UV the decode graphs read keep the old weights.
    refresh_absorbed_on_update = False


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> MLARunner:
    return MLARunner(mode, seed=seed)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> MLARunner:
    return StaleAbsorbedRunner(mode, seed=seed)
