"""The target contract over the TensorRT-LLM-style runner (`trtllm_style.py`); it adds no logic.
One factory per bug, importable by name as replay snippets and child processes need."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from pytest_graphmode.contract import AddressView, Batch, Path, StepResult, TargetSpec
from tests.runners.trtllm_style import GraphRunner, RunnerConfig, SeqInput

CONFIG = RunnerConfig()
FEATURES = frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"})
Mode = Literal["graph", "eager"]


class TrtllmStyleTarget:
    def __init__(self, mode: Mode, *, seed: int, backend: str, bug: str | None = None) -> None:
        # `backend` is not the runner's business: on sim the drop-in routes its torch.cuda
        config = dataclasses.replace(CONFIG, enforce_eager=mode == "eager")
        self.runner = GraphRunner(config, seed=seed, bug=bug)
        m = CONFIG.model
        self.spec = TargetSpec(
            num_blocks=m.num_blocks,
            block_size=m.block_size,
            max_blocks_per_req=m.max_blocks_per_seq,
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
        self.runner.model.load_weights(seed)

    def close(self) -> None:
        self.runner.shutdown()


def make_target(mode: Mode, *, seed: int, backend: str) -> TrtllmStyleTarget:
    return TrtllmStyleTarget(mode, seed=seed, backend=backend)


def _with_bug(bug: str) -> Callable[..., TrtllmStyleTarget]:
    """The factory of the runner with `bug`, named after it: a replay snippet imports it and a
    child process unpickles it by that name, so it is bound to that name below."""

    def make(mode: Mode, *, seed: int, backend: str) -> TrtllmStyleTarget:
        return TrtllmStyleTarget(mode, seed=seed, backend=backend, bug=bug)

    make.__name__ = make.__qualname__ = bug
    return make


query_start_loc_tail_stale = _with_bug("query_start_loc_tail_stale")
seeds_not_moved_on_condense = _with_bug("seeds_not_moved_on_condense")
upload_over_running_replay = _with_bug("upload_over_running_replay")
kv_append_on_unforked_stream = _with_bug("kv_append_on_unforked_stream")
kv_append_count_baked = _with_bug("kv_append_count_baked")
graph_key_without_kv_blocks = _with_bug("graph_key_without_kv_blocks")
