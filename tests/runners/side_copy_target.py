"""The target contract over the side-copy runner (`side_copy.py`); it adds no logic. One factory
per bug, importable by name as replay snippets and child processes need."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec
from tests.runners.side_copy import EngineConfig, ModelRunner, SeqInput

CONFIG = EngineConfig()
FEATURES = frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"})
Mode = Literal["graph", "eager"]


class SideCopyTarget:
    def __init__(self, mode: Mode, *, seed: int, backend: str, bug: str | None = None) -> None:
        # `backend` is not the runner's business: on sim the drop-in routes its torch.cuda
        config = dataclasses.replace(CONFIG, enforce_eager=mode == "eager")
        self.runner = ModelRunner(config, seed=seed, bug=bug)
        m = CONFIG.model
        self.spec = TargetSpec(
            num_blocks=m.num_blocks,
            block_size=m.block_size,
            max_blocks_per_req=m.max_blocks_per_seq,
            vocab_size=m.vocab_size,
            max_num_reqs=CONFIG.max_num_seqs,
            max_num_tokens=CONFIG.max_num_batched_tokens,
            capture_sizes=CONFIG.cudagraph_capture_sizes,
            features=FEATURES,
            null_block=CONFIG.pad_block,
        )

    def step(self, batch: Batch) -> StepResult:
        seqs = [
            SeqInput(list(r.tokens), r.context_len, list(r.block_ids), r.seed, r.temperature)
            for r in batch.requests
        ]
        out = self.runner.execute(seqs)
        path = "eager" if out.graph_key is None else "full"
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
        return self.runner.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.model.load_weights(seed)

    def close(self) -> None:
        self.runner.shutdown()


def make_target(mode: Mode, *, seed: int, backend: str) -> SideCopyTarget:
    return SideCopyTarget(mode, seed=seed, backend=backend)


def _with_bug(bug: str) -> Callable[..., SideCopyTarget]:
    """The factory of the runner with `bug`, named after it: a replay snippet imports it and a
    child process unpickles it by that name, so it is bound to that name below."""

    def make(mode: Mode, *, seed: int, backend: str) -> SideCopyTarget:
        return SideCopyTarget(mode, seed=seed, backend=backend, bug=bug)

    make.__name__ = make.__qualname__ = bug
    return make


padding_slot_zero = _with_bug("padding_slot_zero")
padding_slot_zero_in_steps = _with_bug("padding_slot_zero_in_steps")
key_without_query_len = _with_bug("key_without_query_len")
temperature_baked = _with_bug("temperature_baked")
tokens_read_before_download = _with_bug("tokens_read_before_download")
replay_without_upload_wait = _with_bug("replay_without_upload_wait")
upload_over_live_inputs = _with_bug("upload_over_live_inputs")
