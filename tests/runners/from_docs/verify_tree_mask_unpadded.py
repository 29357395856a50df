"""A speculative-verify graph runner whose attention takes a flattened custom (tree) mask.

Design (after SGLang's EAGLE ``TARGET_VERIFY`` path with the FlashInfer backend): every
uniform step (each request carries its next token plus the same number of drafts, ``q`` query
tokens) replays a full graph keyed by ``(rows, q)``; rows are padded up to a captured row count.
As in SGLang, the verify mask is built on the host as one flat boolean list, request after
request, each request's segment ``q * seq_len`` long (its whole context visible, the drafts a
causal chain); ``mask_indptr`` is the cumulative sum of those segment lengths over *all* the
graph's rows, the padding rows with SGLang's fill ``seq_len = 1``. Before each replay the runner
unpacks the flat mask through ``mask_indptr`` into the graph's static dense mask (the step that
FlashInfer's ``segment_packbits`` does in ``init_forward_metadata_replay_cuda_graph``), outside
the graph. Prefill, mixed batches and batches above the largest graph run eagerly, one request
at a time, through the same forward. Sampling is Gumbel-max from a hash of (seed, position,
token), so the seeds are graph inputs and nothing is baked in at capture.

The bug (``make_buggy_target``): the flat mask is built for the real requests only, while
``mask_indptr`` covers the padded rows too, so a padded replay unpacks past the end of the mask
(``custom_mask.numel() < mask_indptr[-1]``). On a GPU that is the illegal memory access of
SGLang's verify under CUDA graphs whenever the running batch size is not a captured one; the fix
pads the custom mask for the padding rows.
Source: https://github.com/sgl-project/sglang/pull/9687 (fix: "Add padding for tree_mask to fit
for cuda_graph_bs"), diagnosed in https://github.com/sgl-project/sglang/issues/6309 (mask length
below ``mask_indptr[-1]`` only when the batch size is not a captured size) and
https://github.com/sgl-project/sglang/pull/19741 ("pad spec_info mask for target_verify").

What the contract could not express: the drafts and their acceptance are the harness's, so the
runner verifies nothing itself (it returns logits at each request's last query token and samples
there); the tree is a chain (top-k 1), since a request's drafts are a sequence.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from pytest_graphmode.contract import Batch, StepResult, TargetSpec, batch_problems
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=64,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=32,
    capture_sizes=(1, 2, 4, 8),
    features=frozenset({"decode", "prefill", "spec_decode", "sampling"}),
)
HIDDEN = 32
QUERY_LENS = (1, 2, 3)  # verify graphs for 0, 1 and 2 drafts per request
KEYS = SPEC.max_blocks_per_req * SPEC.block_size
PAD_SEQ_LEN = 1  # SGLang's seq_len fill value for padding rows


def _hash(x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        x = x ^ (x >> 13)
    return x


class VerifyRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, pad_mask: bool) -> None:
        self.mode = mode
        self.spec = SPEC
        self.pad_mask = pad_mask
        self.backend = get_backend(backend)
        dev = self.backend.device
        self.dev = dev
        gen = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / math.sqrt(shape[0])).to(dev)

        self.emb = torch.randn(SPEC.vocab_size, HIDDEN, generator=gen).to(dev)
        self.pos = (0.1 * torch.randn(KEYS, HIDDEN, generator=gen)).to(dev)
        self.wq, self.wk, self.wv, self.wo = (w(HIDDEN, HIDDEN) for _ in range(4))
        self.w1, self.w2 = w(HIDDEN, 2 * HIDDEN), w(2 * HIDDEN, HIDDEN)
        self.lm = w(HIDDEN, SPEC.vocab_size)
        slots = SPEC.num_blocks * SPEC.block_size
        self.k_cache = torch.zeros(slots, 1, HIDDEN, device=dev)
        self.v_cache = torch.zeros(slots, 1, HIDDEN, device=dev)
        self.graphs: dict[tuple[int, int], object] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.bufs: dict[str, torch.Tensor] = {}
        if mode == "graph":
            self._alloc()
            self._capture()

    # ---- static buffers and capture -------------------------------------------------------
    def _alloc(self) -> None:
        rows, q, dev = SPEC.max_num_reqs, max(QUERY_LENS), self.dev
        self.bufs = {
            "tokens": torch.zeros(rows * q, dtype=torch.long, device=dev),
            "positions": torch.zeros(rows * q, dtype=torch.long, device=dev),
            "slots": torch.zeros(rows * q, dtype=torch.long, device=dev),
            "tables": torch.zeros(rows * SPEC.max_blocks_per_req, dtype=torch.long, device=dev),
            "mask": torch.zeros(rows * q * KEYS, dtype=torch.bool, device=dev),
            "seeds": torch.zeros(rows, dtype=torch.long, device=dev),
            "temperatures": torch.ones(rows, device=dev),
            "greedy": torch.ones(rows, dtype=torch.bool, device=dev),
        }

    def _views(self, rows: int, q: int) -> dict[str, torch.Tensor]:
        b = self.bufs
        return {
            "tokens": b["tokens"][: rows * q].view(rows, q),
            "positions": b["positions"][: rows * q].view(rows, q),
            "slots": b["slots"][: rows * q].view(rows, q),
            "tables": b["tables"][: rows * SPEC.max_blocks_per_req].view(rows, -1),
            "mask": b["mask"][: rows * q * KEYS].view(rows, q, KEYS),
            "seeds": b["seeds"][:rows],
            "temperatures": b["temperatures"][:rows],
            "greedy": b["greedy"][:rows],
        }

    def _capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        keys = [(r, q) for r in SPEC.capture_sizes for q in QUERY_LENS]
        for rows, q in sorted(keys, key=lambda k: k[0] * k[1], reverse=True):
            self._prepare(Batch(()), rows, q, capture=True)
            inputs = self._views(rows, q)
            self._forward(inputs)  # warm-up outside the graph
            self.backend.synchronize()
            graph = self.backend.Graph()
            with self.backend.graph(graph, pool=pool):
                self.outputs[(rows, q)] = self._forward(inputs)
            self.graphs[(rows, q)] = graph

    # ---- host-side metadata ---------------------------------------------------------------
    def _inputs(
        self, batch: Batch, rows: int, q: int, capture: bool = False
    ) -> dict[str, torch.Tensor]:
        """The batch's rows padded to `rows`, each with `q` query tokens (host tensors)."""
        bs, null = SPEC.block_size, SPEC.null_block
        n = batch.num_reqs
        tokens = torch.zeros(rows, q, dtype=torch.long)
        positions = torch.zeros(rows, q, dtype=torch.long)
        slots = torch.full((rows, q), null * bs, dtype=torch.long)
        tables = torch.full((rows, SPEC.max_blocks_per_req), null, dtype=torch.long)
        seeds = torch.zeros(rows, dtype=torch.long)
        temps = torch.ones(rows)
        greedy = torch.ones(rows, dtype=torch.bool)
        seq_lens = [PAD_SEQ_LEN] * rows
        flat: list[bool] = []  # SGLang's custom_mask: q * seq_len per request, in order
        for i, r in enumerate(batch.requests):
            seq_lens[i] = r.seq_len
            for j, t in enumerate(r.tokens):
                p = r.context_len + j
                tokens[i, j], positions[i, j] = t, p
                slots[i, j] = r.block_ids[p // bs] * bs + p % bs
                flat += [k <= p for k in range(r.seq_len)]
            tables[i, : len(r.block_ids)] = torch.tensor(r.block_ids)
            if r.seed is not None:
                seeds[i], temps[i], greedy[i] = r.seed, r.temperature, False
        # The capture builds its dummy mask for every row, as SGLang's capture path does; the
        # fix pads the replay's mask too, so the padding rows get their segments.
        if self.pad_mask or capture:
            flat += [True] * (q * PAD_SEQ_LEN * (rows - n))
        dev = self.dev
        indptr = torch.tensor([0] + [q * s for s in seq_lens], device=dev).cumsum(0)
        flat_mask = torch.tensor(flat, dtype=torch.bool, device=dev)
        mask = self._unpack(flat_mask, indptr, torch.tensor(seq_lens, device=dev), q)
        return {
            "tokens": tokens,
            "positions": positions,
            "slots": slots,
            "tables": tables,
            "mask": mask,
            "seeds": seeds,
            "temperatures": temps,
            "greedy": greedy,
        }

    @staticmethod
    def _unpack(
        flat: torch.Tensor, indptr: torch.Tensor, seq_lens: torch.Tensor, q: int
    ) -> torch.Tensor:
        """Dense [rows, q, KEYS] mask from the flat one, row r at indptr[r] (segment_packbits)."""
        sl = seq_lens[:, None, None]
        j = torch.arange(q, device=flat.device)[None, :, None]
        k = torch.arange(KEYS, device=flat.device)[None, None, :]
        inside = k < sl
        index = indptr[:-1, None, None] + j * sl + k
        return flat[torch.where(inside, index, indptr[:-1, None, None])] & inside

    def _prepare(self, batch: Batch, rows: int, q: int, capture: bool = False) -> None:
        views = self._views(rows, q)
        for name, host in self._inputs(batch, rows, q, capture).items():
            views[name].copy_(host)

    # ---- model ----------------------------------------------------------------------------
    def _forward(self, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x["tokens"].shape[0]
        bs = SPEC.block_size
        h = self.emb[x["tokens"]] + self.pos[x["positions"]]  # [rows, q, H]
        k, v = h @ self.wk, h @ self.wv
        flat_slots = x["slots"].reshape(-1)
        self.k_cache.index_copy_(0, flat_slots, k.reshape(-1, 1, HIDDEN))
        self.v_cache.index_copy_(0, flat_slots, v.reshape(-1, 1, HIDDEN))
        key_slots = (x["tables"][:, :, None] * bs + torch.arange(bs, device=self.dev)).reshape(
            rows, KEYS
        )
        mask = x["mask"]
        visible = mask.any(dim=1)[:, :, None]  # [rows, KEYS, 1]
        keys = torch.where(visible, self.k_cache[key_slots][:, :, 0], 0.0)
        vals = torch.where(visible, self.v_cache[key_slots][:, :, 0], 0.0)
        scores = (h @ self.wq) @ keys.transpose(1, 2) / math.sqrt(HIDDEN)
        probs = torch.softmax(torch.where(mask, scores, -torch.inf), dim=-1)
        h = h + (probs @ vals) @ self.wo
        h = h + torch.nn.functional.silu(h @ self.w1) @ self.w2
        logits = h[:, -1] @ self.lm  # each request's last query token
        pos = x["positions"][:, -1:]
        ids = torch.arange(SPEC.vocab_size, device=self.dev)[None, :]
        u = (_hash(x["seeds"][:, None] * 7919 + pos * 104729 + ids) & 0xFFFFFF) + 1
        gumbel = -torch.log(-torch.log(u.float() / float(0x1000001)))
        sampled = torch.argmax(logits / x["temperatures"][:, None] + gumbel, dim=-1)
        tokens = torch.where(x["greedy"], torch.argmax(logits, dim=-1), sampled)
        return logits, tokens

    # ---- contract -------------------------------------------------------------------------
    def _graph_key(self, batch: Batch) -> tuple[int, int] | None:
        if self.mode != "graph" or not batch.requests or not batch.uniform:
            return None
        q = batch.query_lens[0]
        rows = next((s for s in SPEC.capture_sizes if s >= batch.num_reqs), None)
        if q not in QUERY_LENS or rows is None:
            return None
        return rows, q

    def step(self, batch: Batch) -> StepResult:
        problems = batch_problems(batch, SPEC)
        if problems:
            raise ValueError("; ".join(problems))
        key = self._graph_key(batch)
        n = batch.num_reqs
        if key is not None:
            self._prepare(batch, *key)
            self.graphs[key].replay()
            logits, tokens = self.outputs[key]
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", key)
        outs = []
        for r in batch.requests:  # eager: one request at a time, no padding
            sub = Batch((r,))
            host = self._inputs(sub, 1, r.query_len)
            outs.append(self._forward({k: t.to(self.dev) for k, t in host.items()}))
        logits = torch.cat([o[0] for o in outs]) if outs else torch.zeros(0, SPEC.vocab_size)
        tokens = torch.cat([o[1] for o in outs]) if outs else torch.zeros(0, dtype=torch.long)
        reason = "eager twin" if self.mode == "eager" else "no verify graph for this batch"
        return StepResult(logits, tokens, "eager", None, reason)

    def state(self) -> dict[str, torch.Tensor]:
        return {"k": self.k_cache, "v": self.v_cache}

    def static_buffers(self) -> dict[str, torch.Tensor]:
        return dict(self.bufs)

    def address_views(self) -> list:
        return []

    def update_weights(self, seed: int) -> None:
        raise NotImplementedError("no weight_update feature")

    def close(self) -> None:
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> VerifyRunner:
    return VerifyRunner(mode, seed=seed, backend=backend, pad_mask=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> VerifyRunner:
    return VerifyRunner(mode, seed=seed, backend=backend, pad_mask=False)
