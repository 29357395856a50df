"""The target contract over the SGLang-style runner (`sglang_style.py`); it adds no logic. One
factory per bug, importable by name as replay snippets and child processes need."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from pytest_graphmode.contract import AddressView, Batch, Path, StepResult, TargetSpec
from tests.runners.sglang_style import ModelRunner, Req, RunnerConfig

CONFIG = RunnerConfig()
FEATURES = frozenset({"decode", "prefill", "sampling", "weight_update"})
Mode = Literal["graph", "eager"]


class SglangStyleTarget:
    def __init__(self, mode: Mode, *, seed: int, backend: str, bug: str | None = None) -> None:
        # `backend` is not the runner's business: on sim the drop-in routes its torch.cuda
        config = dataclasses.replace(CONFIG, disable_cuda_graph=mode == "eager")
        self.runner = ModelRunner(config, seed=seed, bug=bug)
        m = CONFIG.model
        self.spec = TargetSpec(
            num_blocks=m.num_blocks,
            block_size=m.block_size,
            max_blocks_per_req=m.max_blocks_per_req,
            vocab_size=m.vocab_size,
            max_num_reqs=CONFIG.max_running_requests,
            max_num_tokens=CONFIG.max_prefill_tokens,
            capture_sizes=CONFIG.capture_bs,
            features=FEATURES,
            null_block=m.null_block,
        )

    def step(self, batch: Batch) -> StepResult:
        reqs = [
            Req(r.tokens, r.context_len, r.block_ids, r.seed, r.temperature) for r in batch.requests
        ]
        out = self.runner.forward(reqs)
        path: Path = "eager" if out.graph_bs is None else "full"
        key = None if out.graph_bs is None else ("decode", out.graph_bs)
        return StepResult(out.logits, out.next_token_ids, path, key, out.fallback_reason)

    def state(self) -> Mapping[str, torch.Tensor]:
        model = self.runner.model
        slots = model.cfg.num_blocks * model.cfg.block_size
        state = {}
        for i, (k, v) in enumerate(zip(model.k_caches, model.v_caches, strict=True)):
            state[f"k{i}"] = k.view(slots, *k.shape[2:])
            state[f"v{i}"] = v.view(slots, *v.shape[2:])
        return state

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        graph_runner = self.runner.graph_runner
        return {} if graph_runner is None else graph_runner.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.update_weights(seed)

    def close(self) -> None:
        self.runner.shutdown()


def make_target(mode: Mode, *, seed: int, backend: str) -> SglangStyleTarget:
    return SglangStyleTarget(mode, seed=seed, backend=backend)


def _with_bug(bug: str) -> Callable[..., SglangStyleTarget]:
    """The factory of the runner with `bug`, named after it: a replay snippet imports it and a
    child process unpickles it by that name, so it is bound to that name below."""

    def make(mode: Mode, *, seed: int, backend: str) -> SglangStyleTarget:
        return SglangStyleTarget(mode, seed=seed, backend=backend, bug=bug)

    make.__name__ = make.__qualname__ = bug
    return make


pad_row_aliases_first_request = _with_bug("pad_row_aliases_first_request")
sampling_info_skipped_when_greedy = _with_bug("sampling_info_skipped_when_greedy")
packed_head_not_refreshed = _with_bug("packed_head_not_refreshed")
staging_freed_without_record_stream = _with_bug("staging_freed_without_record_stream")
noise_keyed_by_cache_slot = _with_bug("noise_keyed_by_cache_slot")
extend_stream_not_fenced = _with_bug("extend_stream_not_fenced")
