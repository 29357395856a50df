"""A token-padded graph runner whose MLP input is fake-quantized with a dynamic per-tensor scale.

Two-layer decoder, float32, learned position embeddings, paged attention over a slot-major KV cache.
Before each MLP the normed activation is quantized to 15 levels (-7..7) with one scale for the
whole step: amax(|h|) over all token rows / 7, as FP8 dynamic per-tensor activation quantization
does. Because that scale mixes the rows of a batch, a request's logits depend on its company by
design (spec `batch_invariant=False`).

Graph mode (backend facade) captures one graph per capture size *in tokens* at start-up: decode,
prefill, speculative and mixed batches are all packed token by token (each token names its request
row through `req_index`), padded to the smallest capture size that holds them; the requests'
last-token logits are gathered through a per-request `last` index. Padding tokens read token 0 at
position 0 through a padding request row whose block table is all null blocks, and write the null
block only. Batches above the largest capture size run eagerly. The eager twin runs the real
tokens only.

make_target:        the amax is masked to the real token rows (`arange(T) < num_valid`, a static
                    buffer), so padding rows cannot change the scale.
make_buggy_target:  the amax is taken over the whole padded batch, so the padding rows' activations
                    (here the pad token's) can raise the scale and change every real row's logits.
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
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=4,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
    batch_invariant=False,  # the dynamic quantization scale is shared by the batch's rows
)
HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS = 32, 2, 16, 64, 2
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
QMAX = 7  # 15 levels
NULL_SLOT = SPEC.null_block * SPEC.block_size
PAD_ROW = SPEC.max_num_reqs  # the request row padding tokens name: all null blocks
M32 = 0xFFFFFFFF


@dataclass
class Inputs:
    tokens: Tensor  # [T] int64
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    req_index: Tensor  # [T] row of `tables` each token belongs to
    tables: Tensor  # [R(+1), max_blocks_per_req]
    last: Tensor  # [R] index of each request's last query token
    seeds: Tensor  # [R]
    temperatures: Tensor  # [R] float32
    sampled: Tensor  # [R] bool
    num_valid: Tensor | None  # [1] real token count (graph mode); None: every row is real


def fake_quant(h: Tensor, num_valid: Tensor | None) -> Tensor:
    """Quantize-dequantize h [T, D] with one dynamic scale for the whole tensor."""
    mag = h.abs()
    if num_valid is not None:
        valid = torch.arange(h.shape[0], device=h.device) < num_valid  # [T]
        mag = torch.where(valid[:, None], mag, torch.zeros((), device=h.device))
    scale = mag.amax().clamp_min(1e-6) / QMAX
    return torch.round(h / scale).clamp(-QMAX, QMAX) * scale


def rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5)


class Model:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes: dict[str, tuple[int, ...]] = {
            "tok": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_POS, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
        }
        for i in range(LAYERS):
            shapes[f"q{i}"] = (HIDDEN, HIDDEN)
            shapes[f"k{i}"] = (HIDDEN, HIDDEN)
            shapes[f"v{i}"] = (HIDDEN, HIDDEN)
            shapes[f"o{i}"] = (HIDDEN, HIDDEN)
            shapes[f"up{i}"] = (HIDDEN, FFN)
            shapes[f"down{i}"] = (FFN, HIDDEN)
        self.w = {k: torch.empty(s, device=device) for k, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(1000 + seed)
        for name in sorted(self.w):
            t = self.w[name]
            fan_in = t.shape[0] if name not in ("tok", "pos") else 1
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(fan_in)).to(t.device))

    def forward(self, inp: Inputs, kv: list[tuple[Tensor, Tensor]]) -> Tensor:
        w = self.w
        x = w["tok"][inp.tokens] + w["pos"][inp.positions]
        table = inp.tables[inp.req_index]  # [T, MB]
        bs = SPEC.block_size
        ctx_slots = (table[:, :, None] * bs + torch.arange(bs, device=x.device)).flatten(1)
        ctx_pos = torch.arange(ctx_slots.shape[1], device=x.device)
        ok = ctx_pos[None, :] <= inp.positions[:, None]  # [T, C]
        for i, (kc, vc) in enumerate(kv):
            h = rms(x)
            q = (h @ w[f"q{i}"]).view(-1, HEADS, HEAD_DIM)
            kc.index_copy_(0, inp.slots, (h @ w[f"k{i}"]).view(-1, HEADS, HEAD_DIM))
            vc.index_copy_(0, inp.slots, (h @ w[f"v{i}"]).view(-1, HEADS, HEAD_DIM))
            keys = torch.where(
                ok[:, :, None, None], kc[ctx_slots], torch.zeros((), device=x.device)
            )
            vals = torch.where(
                ok[:, :, None, None], vc[ctx_slots], torch.zeros((), device=x.device)
            )
            s = torch.einsum("thd,tchd->thc", q, keys) / math.sqrt(HEAD_DIM)
            p = torch.softmax(s.masked_fill(~ok[:, None, :], float("-inf")), dim=-1)
            x = x + torch.einsum("thc,tchd->thd", p, vals).reshape(-1, HIDDEN) @ w[f"o{i}"]
            hq = fake_quant(rms(x), inp.num_valid)  # dynamic per-tensor activation quant
            x = x + torch.relu(hq @ w[f"up{i}"]) @ w[f"down{i}"]
        return rms(x[inp.last]) @ w["head"]


def fmix(x: Tensor) -> Tensor:
    x = x & M32
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & M32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def sample(logits: Tensor, inp: Inputs) -> Tensor:
    pos = inp.positions[inp.last]
    key = fmix(fmix(inp.seeds) + pos * 0x9E3779B1)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    bits = fmix(key[:, None] * 31 + vocab[None, :] + 0x5BD1E995)
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / inp.temperatures[:, None] - torch.log(-torch.log(u))
    return torch.where(inp.sampled, noisy.argmax(-1), logits.argmax(-1))


def slot_of(r: Request, pos: int) -> int:
    return r.block_ids[pos // SPEC.block_size] * SPEC.block_size + pos % SPEC.block_size


def table_of(r: Request) -> list[int]:
    return list(r.block_ids) + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(r.block_ids))


def host_rows(batch: Batch) -> dict[str, list[Any]]:
    rows: dict[str, list[Any]] = {k: [] for k in ("tokens", "positions", "slots", "req_index")}
    req: dict[str, list[Any]] = {
        k: [] for k in ("tables", "last", "seeds", "temperatures", "sampled")
    }
    for i, r in enumerate(batch.requests):
        for j, t in enumerate(r.tokens):
            p = r.context_len + j
            rows["tokens"].append(t)
            rows["positions"].append(p)
            rows["slots"].append(slot_of(r, p))
            rows["req_index"].append(i)
        req["tables"].append(table_of(r))
        req["last"].append(len(rows["tokens"]) - 1)
        req["seeds"].append(0 if r.seed is None else r.seed & M32)
        req["temperatures"].append(1.0 if r.seed is None else float(r.temperature))
        req["sampled"].append(r.seed is not None)
    return rows | req


TOKEN_PAD = {"tokens": 0, "positions": 0, "slots": NULL_SLOT, "req_index": PAD_ROW}
REQ_PAD = {"tables": SPEC.null_block, "last": 0, "seeds": 0, "temperatures": 1.0, "sampled": False}


class DynQuantRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, mask_padding: bool) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"bad mode {mode!r}")
        self.spec = SPEC
        self.mode = mode
        self.mask_padding = mask_padding
        self.be: Any = get_backend(backend)
        dev = self.dev = self.be.device
        self.model = Model(seed, dev)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.kv = [
            (torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)) for _ in range(LAYERS)
        ]
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if mode == "graph":
            t, r, i64 = SPEC.capture_sizes[-1], SPEC.max_num_reqs, torch.int64
            self.buffers = {
                "tokens": torch.zeros(t, dtype=i64, device=dev),
                "positions": torch.zeros(t, dtype=i64, device=dev),
                "slots": torch.zeros(t, dtype=i64, device=dev),
                "req_index": torch.zeros(t, dtype=i64, device=dev),
                "tables": torch.zeros(r + 1, SPEC.max_blocks_per_req, dtype=i64, device=dev),
                "last": torch.zeros(r, dtype=i64, device=dev),
                "seeds": torch.zeros(r, dtype=i64, device=dev),
                "temperatures": torch.ones(r, device=dev),
                "sampled": torch.zeros(r, dtype=torch.bool, device=dev),
                "num_valid": torch.zeros(1, dtype=i64, device=dev),
            }
            self.capture_all()

    # graph mode
    def graph_inputs(self, size: int) -> Inputs:
        b = self.buffers
        return Inputs(
            b["tokens"][:size],
            b["positions"][:size],
            b["slots"][:size],
            b["req_index"][:size],
            b["tables"],
            b["last"],
            b["seeds"],
            b["temperatures"],
            b["sampled"],
            b["num_valid"] if self.mask_padding else None,  # BUG when None: padding in the amax
        )

    def capture_all(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self.prepare(Batch(()), size)
            inp = self.graph_inputs(size)
            self.forward(inp)  # warm-up
            self.be.synchronize()
            g = self.be.Graph()
            with self.be.graph(g, pool=pool):
                self.outputs[size] = self.forward(inp)
            self.graphs[size] = g

    def prepare(self, batch: Batch, size: int) -> None:
        """Write the batch into the buffers' prefix and reset every padding row."""
        rows = host_rows(batch)
        nt, nr = batch.num_tokens if batch.requests else 0, batch.num_reqs
        for name, pad in TOKEN_PAD.items():
            buf = self.buffers[name]
            if nt:
                buf[:nt].copy_(torch.tensor(rows[name], dtype=buf.dtype))
            buf[nt:].fill_(pad)
        for name, pad in REQ_PAD.items():
            buf = self.buffers[name]
            if nr:
                buf[:nr].copy_(torch.tensor(rows[name], dtype=buf.dtype).view(nr, *buf.shape[1:]))
            buf[nr:].fill_(pad)
        self.buffers["num_valid"].fill_(nt)

    def replay(self, batch: Batch, size: int) -> StepResult:
        self.prepare(batch, size)
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        n = batch.num_reqs
        return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("tokens", size))

    # both modes
    def forward(self, inp: Inputs) -> tuple[Tensor, Tensor]:
        logits = self.model.forward(inp, self.kv)
        return logits, sample(logits, inp)

    def eager(self, batch: Batch, reason: str) -> StepResult:
        if not batch.requests:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.dev)
            return StepResult(
                empty, torch.zeros(0, dtype=torch.int64, device=self.dev), "eager", None, reason
            )
        rows = host_rows(batch)

        def t(name: str, dt: torch.dtype = torch.int64) -> Tensor:
            return torch.tensor(rows[name], dtype=dt, device=self.dev)

        inp = Inputs(
            t("tokens"),
            t("positions"),
            t("slots"),
            t("req_index"),
            t("tables").view(-1, SPEC.max_blocks_per_req),
            t("last"),
            t("seeds"),
            t("temperatures", torch.float32),
            t("sampled", torch.bool),
            None,
        )
        logits, tokens = self.forward(inp)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def step(self, batch: Batch) -> StepResult:
        if self.mode == "eager":
            return self.eager(batch, "eager twin")
        if not batch.requests:
            return self.eager(batch, "empty batch")
        size = next((s for s in SPEC.capture_sizes if s >= batch.num_tokens), None)
        if size is None:
            return self.eager(batch, "above the largest capture size")
        return self.replay(batch, size)

    def state(self) -> Mapping[str, Tensor]:
        return {f"{n}{i}": kv[j] for i, kv in enumerate(self.kv) for j, n in enumerate("kv")}

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


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> DynQuantRunner:
    return DynQuantRunner(mode, seed=seed, backend=backend, mask_padding=True)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> DynQuantRunner:
    return DynQuantRunner(mode, seed=seed, backend=backend, mask_padding=False)
