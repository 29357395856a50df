"""The target contract over the static-cache-style runner (`static_cache_style.py`); it adds no
logic. One factory per bug, importable by name as replay snippets and child processes need."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from pytest_graphmode.contract import AddressView, Batch, Path, StepResult, TargetSpec
from tests.runners.static_cache_style import BUGS, RunnerConfig, SeqInput, StaticCacheRunner

CONFIG = RunnerConfig()
FEATURES = frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"})
Mode = Literal["graph", "eager"]


class StaticCacheStyleTarget:
    def __init__(self, mode: Mode, *, seed: int, backend: str, bug: str | None = None) -> None:
        # `backend` is not the runner's business: on sim the drop-in routes its torch.cuda
        config = dataclasses.replace(CONFIG, enforce_eager=mode == "eager")
        self.runner = StaticCacheRunner(config, seed=seed, bug=bug)
        m = CONFIG.model
        self.spec = TargetSpec(
            num_blocks=m.num_blocks,
            block_size=m.block_size,
            max_blocks_per_req=m.max_blocks_per_req,
            vocab_size=m.vocab_size,
            max_num_reqs=CONFIG.max_num_reqs,
            max_num_tokens=CONFIG.max_num_tokens,
            capture_sizes=CONFIG.capture_sizes,
            features=FEATURES,
            null_block=CONFIG.null_block,
        )

    def step(self, batch: Batch) -> StepResult:
        seqs = [
            SeqInput(r.req_id, r.tokens, r.context_len, r.block_ids, r.seed, r.temperature)
            for r in batch.requests
        ]
        out = self.runner.execute(seqs)
        path: Path = "eager" if out.graph_key is None else "full"
        return StepResult(out.logits, out.tokens, path, out.graph_key, out.fallback_reason)

    def state(self) -> Mapping[str, torch.Tensor]:
        model = self.runner.model
        slots = model.cfg.num_blocks * model.cfg.block_size
        state = {}
        for i, (k, v) in enumerate(zip(model.k_caches, model.v_caches, strict=True)):
            state[f"k{i}"] = k.view(slots, *k.shape[2:])
            state[f"v{i}"] = v.view(slots, *v.shape[2:])
        return state

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return self.runner.static_buffers()

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.loader.load(seed)

    def close(self) -> None:
        self.runner.shutdown()


def make_target(mode: Mode, *, seed: int, backend: str) -> StaticCacheStyleTarget:
    return StaticCacheStyleTarget(mode, seed=seed, backend=backend)


def _with_bug(bug: str) -> Callable[..., StaticCacheStyleTarget]:
    """The factory of the runner with `bug`, bound below to the module name `bug`: a replay
    snippet imports it and a child process unpickles it by that name."""

    def make(mode: Mode, *, seed: int, backend: str) -> StaticCacheStyleTarget:
        return StaticCacheStyleTarget(mode, seed=seed, backend=backend, bug=bug)

    make.__name__ = make.__qualname__ = bug
    return make


positions_trusted_by_request_id = _with_bug("positions_trusted_by_request_id")
masked_values_multiplied = _with_bug("masked_values_multiplied")
activation_scale_over_padded_batch = _with_bug("activation_scale_over_padded_batch")
oversized_batch_clamped_to_largest_graph = _with_bug("oversized_batch_clamped_to_largest_graph")
weights_staged_through_one_pinned_buffer = _with_bug("weights_staged_through_one_pinned_buffer")
assert {name for name in BUGS if callable(globals().get(name))} == BUGS
