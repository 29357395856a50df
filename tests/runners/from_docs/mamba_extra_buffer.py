"""A hybrid attention + Mamba decode runner with SGLang's "extra_buffer" state tracking.

Design (after SGLang's `CudaGraphRunner` with `HybridLinearAttnBackend` / `Mamba2AttnBackend`,
`--mamba-scheduler-strategy extra_buffer`): a one-layer attention block over a slot-major paged KV
cache followed by a selective-SSM (Mamba-style) mixer whose recurrent state lives in a state pool,
one working slot per request-pool index plus two ping-pong *track* slots. Whenever a sequence's
length reaches a multiple of the track interval (here one KV block), the mixer copies the state it
just produced into the request's next track slot, so that a prefix cache can later adopt the
state of that block-aligned prefix. The Mamba mixer serves mixed batches the SGLang way: extend
rows (prompts and chunks) first, decode rows last, and the decode part takes its per-row
metadata from the tail of each per-row tensor (`[-num_decodes:]`). Decode-only batches replay a
CUDA graph per capture size (largest first, one shared pool); everything else runs eagerly. As
in SGLang, the graphs read per-size static buffers of state indices (`state_indices_list[bs-1]`)
and one `(max_bs,)` track-destination buffer, refreshed at its front (`[:bs]`) before each replay.

The bug (sgl-project/sglang PR #32555, "[Nemotron] Fix decode track-save reading the stale tail
of the CUDA-graph track buffer", https://github.com/sgl-project/sglang/pull/32555): the replay
metadata handed the *whole* `(max_bs,)` track buffer to the forward instead of its refreshed
`[:bs]` prefix. Eagerly every per-row tensor has exactly `bs` rows, so `[-num_decodes:]` is the
batch; on a graph smaller than the largest, `track_indices[-num_decodes:]` is the buffer's tail,
never refreshed for this step (zeros at start-up, else another, earlier batch's destinations).
The captured track-save then copies each boundary row's state into a stale slot (the padding
slot, or another request's slot) and leaves the row's own track slot as it was. Eager steps
and the largest graph are right, and the step's own logits do not change (a stale destination
that is another request's working slot changes its later steps). `make_buggy_target` hands the
full buffer, `make_target` its `[:bs]` prefix (the fix).

What the contract could not express: prefix-cache hits. Nothing in a `Batch` lets a new request
start from a tracked state, so the track slots are never read back by a step; they are part of
`state()` (the pool, less its padding slot 0), which the harness compares between the twins.
The harness's request id stands for SGLang's request-pool index (both are small integers the
scheduler hands to the runner), so a request's slots follow from its id alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from pytest_graphmode.contract import (
    AddressView,
    Batch,
    StepResult,
    TargetSpec,
    batch_problems,
    kv_slot,
)
from pytest_graphmode.runtime import backends

SPEC = TargetSpec(
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "sampling", "weight_update"}),
    null_block=0,
)
D_MODEL, N_HEADS, HEAD_DIM = 32, 2, 16
D_INNER, D_STATE = 32, 8
TRACK_INTERVAL = SPEC.block_size  # track block-aligned prefixes, as a radix cache matches them
REQ_POOL_SIZE = 512  # request-pool indices (the harness's request ids)
PAD_SLOT = 0  # the state slot padding rows read and write; no request owns it
MAX_POS = SPEC.max_blocks_per_req * SPEC.block_size


def working_slot(req_pool_index: int) -> int:
    return 1 + 3 * req_pool_index


def track_slot(req_pool_index: int, seq_len: int) -> int:
    """The ping-pong track slot for the state after `seq_len` tokens (a boundary)."""
    return 2 + 3 * req_pool_index + (seq_len // TRACK_INTERVAL) % 2


def last_boundary(context_len: int, seq_len: int) -> int | None:
    """The last track boundary in positions (context_len, seq_len], if any."""
    top = seq_len - seq_len % TRACK_INTERVAL
    return top if top > context_len else None


# --------------------------------------------------------------------------------------------
# the model


@dataclass
class StepInputs:
    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [rows, max_blocks]
    token_rows: torch.Tensor | None  # [T]: each token's row (None: token i is row i)
    last_token: torch.Tensor | None  # [rows]: each row's last token (None: row i is token i)
    seeds: torch.Tensor  # [rows] int64
    sampled: torch.Tensor  # [rows] bool
    temperatures: torch.Tensor  # [rows] float32


@dataclass
class ExtendPlan:
    """Host-planned scan of the extend rows (eager only): per scan step, rows and tokens."""

    steps: list[tuple[torch.Tensor, torch.Tensor]]  # (rows, tokens) taking part in each step
    snapshots: list[torch.Tensor | None]  # rows whose track boundary is this step's token
    has_initial_state: torch.Tensor  # [num_prefills] bool


@dataclass
class MambaMetadata:
    num_prefills: int
    num_decodes: int
    num_extend_tokens: int
    state_indices: torch.Tensor  # [rows]: extend rows first, decode rows last
    track_mask: torch.Tensor  # [rows] bool
    track_indices: torch.Tensor  # [rows] int64
    extend: ExtendPlan | None = None


def _param_shapes() -> dict[str, tuple[int, ...]]:
    inner = N_HEADS * HEAD_DIM
    return {
        "embed": (SPEC.vocab_size, D_MODEL),
        "pos_embed": (MAX_POS, D_MODEL),
        "wq": (D_MODEL, inner),
        "wk": (D_MODEL, inner),
        "wv": (D_MODEL, inner),
        "wo": (inner, D_MODEL),
        "w_in": (D_MODEL, D_INNER),
        "w_gate": (D_MODEL, D_INNER),
        "w_dt": (D_MODEL, D_INNER),
        "dt_bias": (D_INNER,),
        "w_b": (D_MODEL, D_STATE),
        "w_c": (D_MODEL, D_STATE),
        "a_log": (D_INNER, D_STATE),
        "w_out": (D_INNER, D_MODEL),
        "lm_head": (D_MODEL, SPEC.vocab_size),
    }


def _host_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in _param_shapes().items():
        if name == "a_log":
            out[name] = torch.empty(shape).uniform_(0.0, 1.4, generator=gen)
        elif name == "dt_bias":
            out[name] = torch.empty(shape).uniform_(-2.5, -0.5, generator=gen)
        elif name in ("embed", "pos_embed"):
            out[name] = torch.randn(shape, generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen) / shape[0] ** 0.5
    return out


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Noise from a hash of (seed, position, token id): no generator, nothing baked."""
    tok = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * 1000003 + positions[:, None] * 7919 + tok[None, :] * 104729 + 12345
    x = x & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    u = ((x & 0xFFFFFF).to(torch.float32) + 0.5) / 16777216.0
    return -torch.log(-torch.log(u))


class HybridModel:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.params = {k: v.to(device) for k, v in _host_weights(seed).items()}
        slots = SPEC.num_slots
        self.k_cache = torch.zeros(slots, N_HEADS, HEAD_DIM, device=device)
        self.v_cache = torch.zeros(slots, N_HEADS, HEAD_DIM, device=device)
        self.ssm_pool = torch.zeros(1 + 3 * REQ_POOL_SIZE, D_INNER, D_STATE, device=device)

    def load_weights(self, seed: int) -> None:
        for name, value in _host_weights(seed).items():
            self.params[name].copy_(value)  # in place: the graphs keep reading these tensors

    def forward(self, inp: StepInputs, meta: MambaMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.params
        x = p["embed"][inp.tokens] + p["pos_embed"][inp.positions]
        x = x + self._attention(_rms_norm(x), inp)
        x = x + self._mamba(_rms_norm(x), meta)
        if inp.last_token is not None:
            x = x[inp.last_token]
            last_pos = inp.positions[inp.last_token]
        else:
            last_pos = inp.positions
        logits = _rms_norm(x) @ p["lm_head"]
        noise = _gumbel(inp.seeds, last_pos, SPEC.vocab_size)
        scaled = logits / inp.temperatures[:, None] + noise
        tokens = torch.where(inp.sampled, scaled.argmax(-1), logits.argmax(-1))
        return logits, tokens

    def _attention(self, x: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        p, n_tok = self.params, x.shape[0]
        q = (x @ p["wq"]).view(n_tok, N_HEADS, HEAD_DIM)
        k = (x @ p["wk"]).view(n_tok, N_HEADS, HEAD_DIM)
        v = (x @ p["wv"]).view(n_tok, N_HEADS, HEAD_DIM)
        self.k_cache.index_copy_(0, inp.slot_mapping, k)  # store before reading
        self.v_cache.index_copy_(0, inp.slot_mapping, v)
        tables = inp.block_tables if inp.token_rows is None else inp.block_tables[inp.token_rows]
        bs = SPEC.block_size
        offsets = torch.arange(bs, device=x.device)
        slots = (tables[:, :, None] * bs + offsets).reshape(n_tok, -1)
        slot_pos = torch.arange(slots.shape[1], device=x.device)
        visible = slot_pos[None, :] <= inp.positions[:, None]  # [T, S]
        keys, values = self.k_cache[slots], self.v_cache[slots]  # [T, S, H, Dh]
        scores = torch.einsum("thd,tshd->ths", q, keys) * HEAD_DIM**-0.5
        scores = torch.where(visible[:, None, :], scores, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        values = torch.where(visible[:, :, None, None], values, 0.0)
        out = torch.einsum("ths,tshd->thd", probs, values).reshape(n_tok, -1)
        return out @ p["wo"]

    def _mamba(self, x: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        p = self.params
        dt = F.softplus(x @ p["w_dt"] + p["dt_bias"])  # [T, E]
        decay = torch.exp(-dt[:, :, None] * torch.exp(p["a_log"]))  # [T, E, N]
        drive = (dt * (x @ p["w_in"]))[:, :, None] * (x @ p["w_b"])[:, None, :]
        c = x @ p["w_c"]
        parts = []
        if meta.num_prefills:
            ne = meta.num_extend_tokens
            parts.append(self._extend(decay[:ne], drive[:ne], c[:ne], meta))
        if meta.num_decodes:
            nd = meta.num_decodes
            parts.append(self._decode(decay[-nd:], drive[-nd:], c[-nd:], meta))
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return (y * F.silu(x @ p["w_gate"])) @ p["w_out"]

    def _decode(self, decay, drive, c, meta: MambaMetadata) -> torch.Tensor:
        nd = meta.num_decodes
        idx = meta.state_indices[-nd:]
        h = decay * self.ssm_pool[idx] + drive
        self.ssm_pool.index_copy_(0, idx, h)
        # The track-save: boundary rows copy their new state into their next track slot.
        mask = meta.track_mask[-nd:]
        dst = meta.track_indices[-nd:]
        self.ssm_pool.index_copy_(0, torch.where(mask, dst, PAD_SLOT), h)
        return (h * c[:, None, :]).sum(-1)

    def _extend(self, decay, drive, c, meta: MambaMetadata) -> torch.Tensor:
        plan, np_ = meta.extend, meta.num_prefills
        assert plan is not None
        idx = meta.state_indices[:np_]
        init = plan.has_initial_state[:, None, None]
        h = torch.where(init, self.ssm_pool[idx], 0.0)
        snap = torch.zeros_like(h)
        y = torch.zeros(decay.shape[0], D_INNER, device=decay.device)
        for (rows, toks), snap_rows in zip(plan.steps, plan.snapshots, strict=True):
            h_rows = decay[toks] * h[rows] + drive[toks]
            h[rows] = h_rows
            y[toks] = (h_rows * c[toks][:, None, :]).sum(-1)
            if snap_rows is not None:
                snap[snap_rows] = h[snap_rows]
        self.ssm_pool.index_copy_(0, idx, h)
        mask, dst = meta.track_mask[:np_], meta.track_indices[:np_]
        self.ssm_pool.index_copy_(0, torch.where(mask, dst, PAD_SLOT), snap)
        return y


# --------------------------------------------------------------------------------------------
# the runner


def _is_decode_row(request) -> bool:
    return request.context_len > 0 and request.query_len == 1


class ExtraBufferRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, full_track_buffer: bool
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.be = backends.get(backend)
        self.device = torch.device(self.be.device)
        self.full_track_buffer = full_track_buffer
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.inference_mode():
            self.model = HybridModel(seed, self.device)
            if mode == "graph":
                self._init_graph_state()
                self._capture_all()

    # ---- static state of the graphs ---------------------------------------------------------

    def _init_graph_state(self) -> None:
        m, dev = max(SPEC.capture_sizes), self.device
        i64 = {"dtype": torch.int64, "device": dev}
        self.inputs = {
            "input_ids": torch.zeros(m, **i64),
            "positions": torch.zeros(m, **i64),
            "out_cache_loc": torch.zeros(m, **i64),
            "block_tables": torch.zeros(m, SPEC.max_blocks_per_req, **i64),
            "mamba_track_mask": torch.zeros(m, dtype=torch.bool, device=dev),
            "mamba_track_indices": torch.zeros(m, **i64),
            "seeds": torch.zeros(m, **i64),
            "sampled": torch.zeros(m, dtype=torch.bool, device=dev),
            "temperatures": torch.ones(m, device=dev),
        }
        # The linear-attention backend's own graph state: per-size state indices, and one
        # (max_bs,) track-destination buffer refreshed in place at each replay.
        self.state_indices_list = {
            size: torch.full((size,), PAD_SLOT, **i64) for size in SPEC.capture_sizes
        }
        self.mamba_track_indices_buf = torch.zeros(m, **i64)

    def _graph_inputs(self, size: int) -> StepInputs:
        b = self.inputs
        return StepInputs(
            tokens=b["input_ids"][:size],
            positions=b["positions"][:size],
            slot_mapping=b["out_cache_loc"][:size],
            block_tables=b["block_tables"][:size],
            token_rows=None,
            last_token=None,
            seeds=b["seeds"][:size],
            sampled=b["sampled"][:size],
            temperatures=b["temperatures"][:size],
        )

    def _graph_metadata(self, size: int) -> MambaMetadata:
        track = self.mamba_track_indices_buf
        return MambaMetadata(
            num_prefills=0,
            num_decodes=size,
            num_extend_tokens=0,
            state_indices=self.state_indices_list[size],
            track_mask=self.inputs["mamba_track_mask"][:size],
            # The fix hands out the refreshed prefix; the bug, the whole buffer.
            track_indices=track if self.full_track_buffer else track[:size],
        )

    def _fill(self, batch: Batch, size: int) -> None:
        """Write the batch into rows [:n] of the static buffers and padding into [n:size]."""
        bs, null = SPEC.block_size, SPEC.null_block
        rows = {k: [] for k in self.inputs}
        state_idx = []
        for r in batch.requests:
            pos = r.context_len
            table = list(r.block_ids) + [null] * (SPEC.max_blocks_per_req - len(r.block_ids))
            rows["input_ids"].append(r.tokens[0])
            rows["positions"].append(pos)
            rows["out_cache_loc"].append(kv_slot(r.block_ids, pos, bs))
            rows["block_tables"].append(table)
            rows["mamba_track_mask"].append(r.seq_len % TRACK_INTERVAL == 0)
            rows["mamba_track_indices"].append(track_slot(r.req_id, r.seq_len))
            rows["seeds"].append(0 if r.seed is None else r.seed)
            rows["sampled"].append(r.seed is not None)
            rows["temperatures"].append(float(r.temperature))
            state_idx.append(working_slot(r.req_id))
        for _ in range(size - batch.num_reqs):
            rows["input_ids"].append(0)
            rows["positions"].append(0)
            rows["out_cache_loc"].append(null * bs)
            rows["block_tables"].append([null] * SPEC.max_blocks_per_req)
            rows["mamba_track_mask"].append(False)
            rows["mamba_track_indices"].append(PAD_SLOT)
            rows["seeds"].append(0)
            rows["sampled"].append(False)
            rows["temperatures"].append(1.0)
            state_idx.append(PAD_SLOT)
        for name, values in rows.items():
            buf = self.inputs[name]
            buf[:size].copy_(torch.tensor(values, dtype=buf.dtype))
        # the backend's replay metadata, refreshed before the graph runs
        self.state_indices_list[size].copy_(torch.tensor(state_idx, dtype=torch.int64))
        self.mamba_track_indices_buf[:size].copy_(self.inputs["mamba_track_indices"][:size])

    def _capture_all(self) -> None:
        pool = self.be.graph_pool_handle()
        for size in sorted(SPEC.capture_sizes, reverse=True):
            self._fill(Batch(()), size)
            inputs, meta = self._graph_inputs(size), self._graph_metadata(size)
            self.model.forward(inputs, meta)  # warm-up: padding rows only
            self.be.synchronize()
            graph = self.be.Graph()
            with self.be.graph(graph, pool=pool):
                self.outputs[size] = self.model.forward(inputs, meta)
            self.graphs[size] = graph

    # ---- steps ------------------------------------------------------------------------------

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if not all(_is_decode_row(r) for r in batch.requests):
            return "extend rows: SGLang runs prefill and mixed batches eagerly"
        if batch.num_reqs > max(SPEC.capture_sizes):
            return "more rows than the largest graph"
        return None

    def step(self, batch: Batch) -> StepResult:
        problems = batch_problems(batch, SPEC)
        if problems:
            raise ValueError("; ".join(problems))
        with torch.inference_mode():
            reason = self.fallback_reason(batch)
            if reason is None:
                size = next(s for s in SPEC.capture_sizes if s >= batch.num_reqs)
                self._fill(batch, size)
                self.graphs[size].replay()
                logits, tokens = self.outputs[size]
                n = batch.num_reqs
                return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", ("decode", size))
            logits, tokens = self._eager(batch)
            return StepResult(logits, tokens, "eager", None, reason)

    def _eager(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        reqs = list(batch.requests)
        # SGLang's mixed layout: extend rows first, decode rows last.
        order = [i for i, r in enumerate(reqs) if not _is_decode_row(r)]
        num_prefills = len(order)
        order += [i for i, r in enumerate(reqs) if _is_decode_row(r)]
        bs, null, dev = SPEC.block_size, SPEC.null_block, self.device
        tokens, positions, slots, token_rows, last_token = [], [], [], [], []
        tables, state_idx, track_mask, track_dst = [], [], [], []
        seeds, sampled, temps = [], [], []
        for row, i in enumerate(order):
            r = reqs[i]
            for j, tok in enumerate(r.tokens):
                tokens.append(tok)
                positions.append(r.context_len + j)
                slots.append(kv_slot(r.block_ids, r.context_len + j, bs))
                token_rows.append(row)
            last_token.append(len(tokens) - 1)
            tables.append(list(r.block_ids) + [null] * (SPEC.max_blocks_per_req - len(r.block_ids)))
            state_idx.append(working_slot(r.req_id))
            boundary = last_boundary(r.context_len, r.seq_len)
            track_mask.append(boundary is not None)
            track_dst.append(track_slot(r.req_id, boundary or r.seq_len))
            seeds.append(0 if r.seed is None else r.seed)
            sampled.append(r.seed is not None)
            temps.append(float(r.temperature))

        def dev_tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=dev)

        prefills = [reqs[i] for i in order[:num_prefills]]
        meta = MambaMetadata(
            num_prefills=num_prefills,
            num_decodes=len(order) - num_prefills,
            num_extend_tokens=sum(r.query_len for r in prefills),
            state_indices=dev_tensor(state_idx),
            track_mask=dev_tensor(track_mask, torch.bool),
            track_indices=dev_tensor(track_dst),
            extend=self._plan_extend(prefills, dev_tensor) if prefills else None,
        )
        inputs = StepInputs(
            tokens=dev_tensor(tokens),
            positions=dev_tensor(positions),
            slot_mapping=dev_tensor(slots),
            block_tables=dev_tensor(tables),
            token_rows=dev_tensor(token_rows),
            last_token=dev_tensor(last_token),
            seeds=dev_tensor(seeds),
            sampled=dev_tensor(sampled, torch.bool),
            temperatures=dev_tensor(temps, torch.float32),
        )
        logits, next_tokens = self.model.forward(inputs, meta)
        back = [0] * len(order)  # undo the extend-first reordering
        for row, i in enumerate(order):
            back[i] = row
        back_t = dev_tensor(back)
        return logits[back_t], next_tokens[back_t]

    @staticmethod
    def _plan_extend(prefills, dev_tensor) -> ExtendPlan:
        starts, start = [], 0
        for r in prefills:
            starts.append(start)
            start += r.query_len
        steps, snapshots = [], []
        for t in range(max(r.query_len for r in prefills)):
            live = [p for p, r in enumerate(prefills) if t < r.query_len]
            steps.append((dev_tensor(live), dev_tensor([starts[p] + t for p in live])))
            snap = [
                p
                for p in live
                if last_boundary(prefills[p].context_len, prefills[p].seq_len)
                == prefills[p].context_len + t + 1
            ]
            snapshots.append(dev_tensor(snap) if snap else None)
        has_init = dev_tensor([r.context_len > 0 for r in prefills], torch.bool)
        return ExtendPlan(steps, snapshots, has_init)

    # ---- the contract's other methods --------------------------------------------------------

    def state(self) -> Mapping[str, torch.Tensor]:
        m = self.model
        return {"k_cache": m.k_cache, "v_cache": m.v_cache, "ssm_pool": m.ssm_pool[1:]}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        if self.mode == "eager":
            return {}
        out = dict(self.inputs)
        out.update({f"state_indices_{s}": t for s, t in self.state_indices_list.items()})
        out["mamba_track_indices_buf"] = self.mamba_track_indices_buf
        return out

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load_weights(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ExtraBufferRunner:
    return ExtraBufferRunner(mode, seed=seed, backend=backend, full_track_buffer=False)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> ExtraBufferRunner:
    return ExtraBufferRunner(mode, seed=seed, backend=backend, full_track_buffer=True)
