"""A toy runner implementing the target contract, with switchable bugs (mutants).

The model: each query token writes `emb[token] * (1 + position / 100) + adapter_shift` into its KV
slot; a request's logits are the masked mean of its KV slots times `out`. The graph mode behaves
like a padded graph runner: it copies each step's metadata into static buffers sized for the
largest shape, fills padding with sentinels (slot = the null block) and computes only from those
buffers, so a buffer it forgets to rewrite is read stale. Sampling is Gumbel-max with noise hashed
from (seed, position, vocab index), so it is identical in both modes. Each name in `BUGS` breaks
one rule the harness enforces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec

FEATURES = frozenset({"decode", "prefill", "spec_decode", "sampling", "adapters", "weight_update"})
SPEC = TargetSpec(
    num_blocks=12,
    block_size=4,
    max_blocks_per_req=4,
    vocab_size=24,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8),
    features=FEATURES,
)
HIDDEN = 8
_TOKEN_KEYS = ("token_ids", "positions", "adapters", "slot_mapping")
BUGS = frozenset(
    {
        "padding_not_reset",  # padding rows keep stale slot ids and write someone's KV
        "output_view",  # returns a view of the static logits buffer
        "seed_baked",  # sampling seeds frozen at a bucket's first use (its "capture")
        "row_noise",  # sampling noise indexed by row: depends on batch company
        "slot_noise",  # sampling noise keyed by the KV slot, not the position: depends on placement
        "reads_scratch",  # valid rows read a static buffer no step rewrites
        "drift",  # graph logits off by 1%
        "global_noise",  # graph logits get noise from torch's global generator
        "raises_at_3",  # graph mode raises for 3-request batches
        "overlapping_views",  # two graphs' virtual ranges overlap
        "pool_growth",  # each graph maps fresh physical memory
        # padding rows keep an earlier step's rows staged on the host, out of the harness's reach,
        # and store a departed request's keys again: the bits its slot already holds
        "host_rows_stale",
        # a per-row value keyed by the row, not by the request that holds it (a persistent
        # batch's offset left behind when rows move): both modes compute it alike
        "row_bias",
    }
)


# In code both modes share (the sampler, the model): only a company twin tells.
_SHARED_BUGS = frozenset({"row_noise", "slot_noise", "row_bias"})


def _noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise per (seed, position, token): a counter hash, elementwise in float64."""
    v = torch.arange(vocab, dtype=torch.float64)
    x = seeds.double()[:, None] * 12.9898 + positions.double()[:, None] * 78.233 + v * 37.719
    u = (torch.sin(x) * 43758.5453).frac().abs().clamp(1e-12, 1 - 1e-12)
    return -torch.log(-torch.log(u))


class ToyTarget:
    def __init__(self, mode: str, *, seed: int, backend: str, bugs: frozenset[str] = frozenset()):
        unknown = bugs - BUGS
        if unknown:
            raise ValueError(f"unknown toy bugs {sorted(unknown)}")
        self.spec = SPEC
        self.mode, self.bugs = mode, bugs if mode == "graph" else bugs & _SHARED_BUGS
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(SPEC.vocab_size, HIDDEN, generator=g)
        self.adapter_shift = torch.cat(
            [torch.zeros(1, HIDDEN), torch.randn(1, HIDDEN, generator=g)]
        )
        self.out = torch.randn(SPEC.vocab_size, HIDDEN, generator=g)
        self.kv = torch.zeros(SPEC.num_slots, HIDDEN)
        ctx = SPEC.max_blocks_per_req * SPEC.block_size
        t, r = SPEC.max_num_tokens, SPEC.max_num_reqs
        self.static = {
            "token_ids": torch.zeros(t, dtype=torch.long),
            "positions": torch.zeros(t, dtype=torch.long),
            "adapters": torch.zeros(t, dtype=torch.long),
            "slot_mapping": torch.zeros(t, dtype=torch.long),
            "ctx_slots": torch.zeros(r, ctx, dtype=torch.long),
            "ctx_lens": torch.zeros(r, dtype=torch.long),
            "seeds": torch.zeros(r, dtype=torch.long),
            "temps": torch.ones(r),
            "logits": torch.zeros(r, SPEC.vocab_size),
            "scratch": torch.zeros(r),
        }
        # Host staging for the per-token inputs ("host_rows_stale" leaves its padding rows stale).
        self._host = {key: torch.zeros(t, dtype=torch.long) for key in _TOKEN_KEYS}
        self._captured: dict[int, torch.Tensor] = {}
        self._buckets: set[int] = set()

    # -- contract ------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        inputs = self._inputs(batch)
        bucket = next((s for s in SPEC.capture_sizes if s >= batch.num_tokens), 0)
        if self.mode == "eager" or bucket == 0:
            logits, tokens = self._forward(*inputs, rows=batch.num_reqs)
            reason = "above capture sizes" if bucket == 0 else None
            return StepResult(logits, tokens, "eager", None, reason)
        if "raises_at_3" in self.bugs and batch.num_reqs == 3:
            raise RuntimeError("toy graph mode cannot run 3 requests")
        self._write_static(inputs, batch.num_tokens, batch.num_reqs)
        s = self.static
        seeds = s["seeds"]
        if "seed_baked" in self.bugs:
            seeds = self._captured.setdefault(bucket, s["seeds"].clone())
        logits, tokens = self._forward(
            s["token_ids"][:bucket],
            s["positions"][:bucket],
            s["adapters"][:bucket],
            s["slot_mapping"][:bucket],
            s["ctx_slots"],
            s["ctx_lens"],
            seeds,
            s["temps"],
            rows=SPEC.max_num_reqs,
        )
        if "reads_scratch" in self.bugs:
            logits = logits + s["scratch"].nan_to_num(0.0, 0.0, 0.0).clamp(-1e-6, 1e-6)[:, None]
        if "drift" in self.bugs:
            logits = logits * 1.01
        if "global_noise" in self.bugs:
            logits = logits + torch.rand(logits.shape, dtype=logits.dtype)
        s["logits"].copy_(logits)
        n = batch.num_reqs
        out = s["logits"][:n] if "output_view" in self.bugs else s["logits"][:n].clone()
        return StepResult(out, tokens[:n].clone(), "full", bucket)

    def state(self) -> Mapping[str, torch.Tensor]:
        return {"kv": self.kv, "out": self.out}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return self.static if self.mode == "graph" else {}

    def address_views(self) -> Sequence[AddressView]:
        # bucket b needs 4 * b MiB; correct: 64 MiB apart, all mapping the pool from offset 0
        spacing = 1 << 20 if "overlapping_views" in self.bugs else 1 << 26
        views, offset = [], 0
        for i, bucket in enumerate(sorted(self._buckets)):
            size = bucket << 22
            views.append(AddressView(bucket, (1 << 32) + i * spacing, size, "pool", offset))
            if "pool_growth" in self.bugs:
                offset += size
        return views

    def update_weights(self, seed: int) -> None:
        self.out.copy_(
            torch.randn(SPEC.vocab_size, HIDDEN, generator=torch.Generator().manual_seed(seed))
        )

    def close(self) -> None:
        self.static.clear()

    # -- the model -----------------------------------------------------------------------------

    def _inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        size = SPEC.block_size
        tokens, positions, adapters, slots = [], [], [], []
        ctx = torch.full((batch.num_reqs, SPEC.max_blocks_per_req * size), SPEC.null_block * size)
        for row, r in enumerate(batch.requests):
            for i, token in enumerate(r.tokens):
                pos = r.context_len + i
                tokens.append(token)
                positions.append(pos)
                adapters.append(r.adapter)
                slots.append(r.block_ids[pos // size] * size + pos % size)
            for pos in range(r.seq_len):
                ctx[row, pos] = r.block_ids[pos // size] * size + pos % size
        lens = [r.seq_len for r in batch.requests]
        seeds = [-1 if r.seed is None else r.seed for r in batch.requests]
        temps = [r.temperature for r in batch.requests]
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        return (
            as_long(tokens),
            as_long(positions),
            as_long(adapters),
            as_long(slots),
            ctx,
            as_long(lens),
            as_long(seeds),
            torch.tensor(temps),
        )

    def _write_static(self, inputs: tuple[torch.Tensor, ...], n_tokens: int, n_reqs: int) -> None:
        s = self.static
        null_slot = SPEC.null_block * SPEC.block_size
        for key, value in zip(_TOKEN_KEYS, inputs[:4], strict=True):
            if "host_rows_stale" in self.bugs:
                self._host[key][:n_tokens].copy_(value)
                s[key].copy_(self._host[key])
                continue
            s[key][:n_tokens].copy_(value)
            if key != "slot_mapping" or "padding_not_reset" not in self.bugs:
                s[key][n_tokens:].fill_(null_slot if key == "slot_mapping" else 0)
        for key, value, pad in zip(
            ("ctx_slots", "ctx_lens", "seeds", "temps"),
            inputs[4:],
            (null_slot, 0, -1, 1.0),
            strict=True,
        ):
            s[key][:n_reqs].copy_(value)
            s[key][n_reqs:].fill_(pad)
        self._buckets.add(next(c for c in SPEC.capture_sizes if c >= n_tokens))

    def _forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        adapters: torch.Tensor,
        slots: torch.Tensor,
        ctx_slots: torch.Tensor,
        ctx_lens: torch.Tensor,
        seeds: torch.Tensor,
        temps: torch.Tensor,
        *,
        rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values = self.emb[token_ids] * (1 + positions[:, None] / 100) + self.adapter_shift[adapters]
        self.kv.index_copy_(
            0, slots.remainder(SPEC.num_slots), values
        )  # no bounds check, as a kernel
        gathered = self.kv[ctx_slots.remainder(SPEC.num_slots)]  # [R, C, H]
        mask = torch.arange(ctx_slots.shape[1])[None, :] < ctx_lens[:, None]
        summed = torch.where(mask[:, :, None], gathered, 0.0).sum(dim=1)
        logits = (summed / ctx_lens.clamp_min(1)[:, None]) @ self.out.T  # [R, V]
        if "row_bias" in self.bugs:
            logits = logits + 0.1 * torch.arange(rows)[:, None]
        last = ctx_lens.clamp_min(1) - 1
        noise_seeds = seeds + torch.arange(rows) if "row_noise" in self.bugs else seeds
        counters = last
        if "slot_noise" in self.bugs:
            counters = ctx_slots.gather(1, last[:, None].clamp_max(ctx_slots.shape[1] - 1))[:, 0]
        noise = _noise(noise_seeds, counters, SPEC.vocab_size)
        sampled = (logits.double() / temps[:, None].double() + noise).argmax(dim=-1)
        tokens = torch.where(seeds >= 0, sampled, logits.argmax(dim=-1))
        return logits, tokens


def factory(bugs: Sequence[str] = ()) -> Any:
    """A TargetFactory making toy targets with the given bugs in graph mode."""

    def make(mode: str, *, seed: int, backend: str) -> ToyTarget:
        return ToyTarget(mode, seed=seed, backend=backend, bugs=frozenset(bugs))

    return make


def make_target(mode: str, *, seed: int, backend: str) -> ToyTarget:
    """The correct toy, importable by name (replay snippets refer to it)."""
    return ToyTarget(mode, seed=seed, backend=backend)
