"""A decode runner whose graph wrapper decides which graph inputs are static, as Inductor's
`cudagraphify` does, and gets that decision wrong for the sampler's inputs.

The engine mechanism (PyTorch Inductor's CUDA-graph wrapper behind
`torch.compile(mode="reduce-overhead")`: `cudagraphify_impl` in `torch/_inductor/compile_fx.py`,
and the three input classes that `torch/_inductor/cudagraph_trees.py` still uses): a compiled
function is called with a flat list of tensors. Before recording, the wrapper splits that list
in two. *Static* inputs (parameters and buffers, tensors marked with `mark_static_address`) are
assumed to keep their address for the life of the process: the graph reads them where they
were at recording time, and the wrapper neither copies them nor keeps a placeholder for them.
Every other input is *copied*: the wrapper allocates a placeholder of the same shape once,
records the graph on the placeholder, and before every replay copies the caller's new tensor
into it. Calling the wrapped function with a fresh tensor in a static position is therefore
silent: the replay reads the tensor that was passed when the graph was recorded (the wrapper
still holds it, so nothing is freed and nothing raises).

Here: a one-layer float32 decoder (token + learned position embedding, two-head attention over a
slot-major paged KV cache read through block tables, SiLU MLP, LM head) whose decode step is one
function `decode_step(*flat_inputs)`: the weights, the K and V caches, the batch tensors
(`input_ids`, `positions`, `slot_mapping`, `block_table`, `context_lens`) and, since sampling was
moved into the graph, the sampler's tensors (`seeds`, `temperatures`, `sampled`), built by a
sampling-metadata stage every step like the batch tensors. Gumbel-max sampling hashes
(seed, position, token id), so a request samples the same token in any batch. One graph per
capture size (1, 2, 4, 8 rows, one query token each) is recorded at start-up, largest first, in
one shared pool, on an all-padding batch (null block, greedy, temperature 1). A decode step
builds fresh full-size input tensors (its rows, then padding rows on the null block), hands them
to the wrapper of its padded size, and clones the rows it returns. Prefill, mixed, speculative
and oversized batches run the same function eagerly, as does the eager twin.

The bug (`make_buggy_target`, `static_by_name=True`): the static set is chosen by name, "static
unless it is a per-step input the wrapper knows of", the way Inductor's early cudagraphs
treated every backward input whose name did not contain "tangents" as static
(https://github.com/pytorch/torchdynamo/issues/755: hf_Bart's saved activations, fresh every
iteration, were read at their recording-time addresses; the benchmark reported "Accuracy failed
for key name logits ... INCORRECT", and only the debug-only `size_asserts` check caught it). The
per-step names here are the model's batch tensors; the sampler's three tensors, added to the
graph later, are not in that list, so they are treated as static. Each decode graph keeps sampling
with the recording batch's values: greedy, seed 0, temperature 1. Logits stay right; only a
replayed step holding a sampled request returns a wrong token, so greedy traffic never shows it.

The fix (`make_target`) is the one Inductor adopted: the static set is decided by provenance, not
by name: the first `num_fixed` inputs are the tensors the runner registered at construction
(weights and caches, `static_input_idxs = range(num_fixed)`, later `mark_static_address`), and
everything else is copied before every replay. The same index bookkeeping went wrong again
later in other ways (https://github.com/pytorch/pytorch/pull/175904, static indices not shifted
when effect tokens are prepended; https://github.com/pytorch/pytorch/pull/152287); CUDA graph
trees now check static addresses at replay and re-record (https://github.com/pytorch/pytorch/pull/126822),
which the plain wrapper modelled here never did.
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
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size
NULL_BLOCK = SPEC.null_block
WEIGHT_NAMES = ("embed", "pos", "wq", "wk", "wv", "wo", "up", "down", "lm_head")
CACHE_NAMES = ("k_cache", "v_cache")
BATCH_NAMES = ("input_ids", "positions", "slot_mapping", "block_table", "context_lens")
SAMPLER_NAMES = ("seeds", "temperatures", "sampled")
INPUT_NAMES = WEIGHT_NAMES + CACHE_NAMES + BATCH_NAMES + SAMPLER_NAMES
NUM_FIXED = len(WEIGHT_NAMES) + len(CACHE_NAMES)
_M32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """An integer mixer on int64 tensors holding 32-bit values."""
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M32
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def sample(logits: Tensor, seeds: Tensor, positions: Tensor, temps: Tensor, sampled: Tensor):
    """Gumbel-max with noise from (seed, position, token id); argmax for greedy rows."""
    key = _hash32((seeds & _M32) ^ _hash32((positions * 0x61C88647) & _M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _hash32(key[:, None] ^ ((ids * 0x3C6EF372) & _M32)[None, :])
    uniform = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


def decode_step(*flat: Tensor) -> tuple[Tensor, Tensor]:
    """The function the wrapper records: one token per row, its logits and sampled token.

    Eager steps call it too, with one row per query token (a prefill token's `context_lens` is its
    own position + 1). Nothing in it reads a device value on the host, so it can be captured.
    """
    a = dict(zip(INPUT_NAMES, flat, strict=True))
    tokens, pos, slots, table, lens = (a[n] for n in BATCH_NAMES)
    k_cache, v_cache = a["k_cache"], a["v_cache"]
    x = a["embed"][tokens] + a["pos"][pos]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    q = (h @ a["wq"]).view(-1, HEADS, HEAD_DIM)
    # store this step's keys and values before attending: the token sees itself
    k_cache.index_copy_(0, slots, (h @ a["wk"]).view(-1, HEADS, HEAD_DIM))
    v_cache.index_copy_(0, slots, (h @ a["wv"]).view(-1, HEADS, HEAD_DIM))
    offsets = torch.arange(SPEC.block_size, device=x.device)
    ctx_slots = (table[:, :, None] * SPEC.block_size + offsets).flatten(1)  # [T, MAX_POS]
    visible = torch.arange(MAX_POS, device=x.device)[None, :] < lens[:, None]
    zero = torch.zeros((), device=x.device)
    # the null block may hold anything (NaN poison): zero masked slots, never multiply them
    keys = torch.where(visible[:, :, None, None], k_cache[ctx_slots], zero)
    vals = torch.where(visible[:, :, None, None], v_cache[ctx_slots], zero)
    scores = torch.einsum("thd,tlhd->thl", q, keys) / math.sqrt(HEAD_DIM)
    scores = torch.where(visible[:, None, :], scores, torch.full((), -math.inf, device=x.device))
    attn = torch.einsum("thl,tlhd->thd", scores.softmax(-1), vals).flatten(1)
    x = x + attn @ a["wo"]
    x = x + torch.nn.functional.silu(x @ a["up"]) @ a["down"]
    logits = x @ a["lm_head"]
    return logits, sample(logits, a["seeds"], pos, a["temperatures"], a["sampled"])


class CudagraphifiedStep:
    """The wrapper: warm up, record on placeholders, copy the non-static inputs in, replay."""

    def __init__(self, be: Any, inputs: list[Tensor], static_idxs: set[int], pool: Any) -> None:
        self.be = be
        self.copy_idxs = [i for i in range(len(inputs)) if i not in static_idxs]
        # a static input is used as given; the wrapper keeps it (as cudagraphify's list does)
        self.inputs = [x if i in static_idxs else x.clone() for i, x in enumerate(inputs)]
        decode_step(*self.inputs)  # warm-up outside the graph (it writes only the null block)
        be.synchronize()
        self.graph = be.Graph()
        with be.graph(self.graph, pool=pool):
            self.outputs = decode_step(*self.inputs)

    def __call__(self, new_inputs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        for i in self.copy_idxs:
            self.inputs[i].copy_(new_inputs[i])
        self.graph.replay()
        return self.outputs

    def placeholders(self) -> dict[str, Tensor]:
        return {INPUT_NAMES[i]: self.inputs[i] for i in self.copy_idxs}


class StaticInputsRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, static_by_name: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
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
        self.weights = {n: torch.empty(s, device=dev) for n, s in shapes.items()}
        self.update_weights(seed)
        cache_shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.caches = {n: torch.zeros(cache_shape, device=dev) for n in CACHE_NAMES}
        if static_by_name:  # "static unless it is one of the batch inputs we know of"
            static = {i for i, n in enumerate(INPUT_NAMES) if n not in BATCH_NAMES}
        else:  # by provenance: what the runner registered at construction
            static = set(range(NUM_FIXED))
        self.graphs: dict[int, CudagraphifiedStep] = {}
        if mode == "graph":
            pool = self.be.graph_pool_handle()
            for size in sorted(SPEC.capture_sizes, reverse=True):
                self.graphs[size] = CudagraphifiedStep(
                    self.be, self.flat_inputs(Batch(()), size), static, pool
                )

    # -- inputs -----------------------------------------------------------------------------------

    def flat_inputs(self, batch: Batch, rows: int) -> list[Tensor]:
        """Fresh tensors for every query token of `batch`, padded to `rows` with null-block rows."""
        ids, pos, slots, tables, lens, seeds, temps, sampled = [], [], [], [], [], [], [], []
        for r in batch.requests:
            table = list(r.block_ids) + [NULL_BLOCK] * (SPEC.max_blocks_per_req - len(r.block_ids))
            for i, tok in enumerate(r.tokens):
                p = r.context_len + i
                ids.append(tok)
                pos.append(p)
                slots.append(kv_slot(r.block_ids, p, SPEC.block_size))
                tables.append(table)
                lens.append(p + 1)
                seeds.append(0 if r.seed is None else r.seed & _M32)
                temps.append(r.temperature)
                sampled.append(r.seed is not None)
        for _ in range(rows - len(ids)):  # padding rows: position 0 of the null block, greedy
            ids.append(0)
            pos.append(0)
            slots.append(NULL_BLOCK * SPEC.block_size)
            tables.append([NULL_BLOCK] * SPEC.max_blocks_per_req)
            lens.append(1)
            seeds.append(0)
            temps.append(1.0)
            sampled.append(False)
        dev, i64 = self.device, torch.int64
        per_step = [
            torch.tensor(ids, dtype=i64, device=dev),
            torch.tensor(pos, dtype=i64, device=dev),
            torch.tensor(slots, dtype=i64, device=dev),
            torch.tensor(tables, dtype=i64, device=dev).view(-1, SPEC.max_blocks_per_req),
            torch.tensor(lens, dtype=i64, device=dev),
            torch.tensor(seeds, dtype=i64, device=dev),
            torch.tensor(temps, dtype=torch.float32, device=dev),
            torch.tensor(sampled, dtype=torch.bool, device=dev),
        ]
        fixed = [self.weights[n] for n in WEIGHT_NAMES] + [self.caches[n] for n in CACHE_NAMES]
        return fixed + per_step

    # -- steps ------------------------------------------------------------------------------------

    def graph_size(self, batch: Batch) -> int | None:
        if self.mode != "graph" or any(q != 1 for q in batch.query_lens):
            return None
        return next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)

    def step(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        if n == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
            return StepResult(empty, tokens, "eager", None, "empty batch")
        size = self.graph_size(batch)
        if size is not None:
            logits, tokens = self.graphs[size](self.flat_inputs(batch, size))
            # the next replay overwrites the graph's outputs: hand out copies
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
        logits, tokens = decode_step(*self.flat_inputs(batch, batch.num_tokens))
        last = torch.tensor(_last_rows(batch.requests), dtype=torch.int64, device=self.device)
        reason = "eager twin" if self.mode == "eager" else "not a decode batch of <= 8 rows"
        return StepResult(logits[last], tokens[last], "eager", None, reason)

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return self.caches

    def static_buffers(self) -> Mapping[str, Tensor]:
        # the copied inputs' placeholders: every replay rewrites all of their rows
        return {
            f"{name}@{size}": t
            for size, g in self.graphs.items()
            for name, t in g.placeholders().items()
        }

    def address_views(self) -> Sequence[AddressView]:
        return []  # one shared pool: graphs reuse each other's temporaries by design

    def update_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in WEIGHT_NAMES:  # in place: the graphs read these tensors
            w = self.weights[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))

    def close(self) -> None:
        for g in self.graphs.values():
            g.graph.reset()
        self.graphs.clear()


def _last_rows(requests: Sequence[Request]) -> list[int]:
    """Each request's last query token, in the flat token order of `flat_inputs`."""
    rows, end = [], 0
    for r in requests:
        end += len(r.tokens)
        rows.append(end - 1)
    return rows


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return StaticInputsRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return StaticInputsRunner(mode, seed=seed, backend=backend, static_by_name=True)
