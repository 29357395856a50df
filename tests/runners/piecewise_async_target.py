"""The target contract over the piecewise/async runner (`piecewise_async.py`). The adapter plays the
engine's scheduler: it turns each `Batch` into the runner's `SchedulerOutput` (which requests are
new, which finished, which blocks the running ones gained) and adds nothing else. One factory per
bug, importable by name as replay snippets and child processes need."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from tests.runners.piecewise_async import (
    GraphRunner,
    NewRequest,
    RunnerConfig,
    ScheduledTokens,
    SchedulerOutput,
)

CONFIG = RunnerConfig()
FEATURES = frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"})
Mode = Literal["graph", "eager"]


class RequestTracker:
    """What a scheduler knows of the requests it sent last step. A request continues when it
    resumes exactly where it stopped with the same blocks and sampling; anything else (a finished
    request, a preempted one started again, a new request reusing an id) is finished and, where it
    is in the batch, admitted as new."""

    def __init__(self) -> None:
        self.running: dict[int, Request] = {}

    def schedule(self, batch: Batch) -> SchedulerOutput:
        new, new_blocks, continuing = [], {}, set()
        for r in batch.requests:
            last = self.running.get(r.req_id)
            if last is not None and self._continues(last, r):
                continuing.add(r.req_id)
                new_blocks[r.req_id] = r.block_ids[len(last.block_ids) :]
            else:
                new.append(NewRequest(r.req_id, r.block_ids, r.seed, r.temperature))
        finished = tuple(req_id for req_id in self.running if req_id not in continuing)
        self.running = {r.req_id: r for r in batch.requests}
        scheduled = tuple(
            ScheduledTokens(r.req_id, r.tokens, r.context_len) for r in batch.requests
        )
        return SchedulerOutput(finished, tuple(new), new_blocks, scheduled)

    @staticmethod
    def _continues(last: Request, now: Request) -> bool:
        return (
            now.context_len == last.seq_len
            and now.block_ids[: len(last.block_ids)] == last.block_ids
            and (now.seed, now.temperature) == (last.seed, last.temperature)
        )


class PiecewiseAsyncTarget:
    def __init__(self, mode: Mode, *, seed: int, backend: str, bug: str | None = None) -> None:
        # `backend` is not the runner's business: on sim the drop-in routes its torch.cuda
        config = dataclasses.replace(CONFIG, enforce_eager=mode == "eager")
        self.runner = GraphRunner(config, seed=seed, bug=bug)
        self.scheduler = RequestTracker()
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
        out = self.runner.execute(self.scheduler.schedule(batch))
        return StepResult(out.logits, out.tokens, out.mode, out.graph_key, out.reason)

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


def make_target(mode: Mode, *, seed: int, backend: str) -> PiecewiseAsyncTarget:
    return PiecewiseAsyncTarget(mode, seed=seed, backend=backend)


def _with_bug(bug: str) -> Callable[..., PiecewiseAsyncTarget]:
    """The factory of the runner with `bug`, named after it: a replay snippet imports it and a
    child process unpickles it by that name, so it is bound to that name below."""

    def make(mode: Mode, *, seed: int, backend: str) -> PiecewiseAsyncTarget:
        return PiecewiseAsyncTarget(mode, seed=seed, backend=backend, bug=bug)

    make.__name__ = make.__qualname__ = bug
    return make


uniform_decode_by_token_total = _with_bug("uniform_decode_by_token_total")
piecewise_pad_slots_stale = _with_bug("piecewise_pad_slots_stale")
batch_updated_before_prep_wait = _with_bug("batch_updated_before_prep_wait")
block_count_not_moved_on_condense = _with_bug("block_count_not_moved_on_condense")
decode_table_uploaded_unpadded = _with_bug("decode_table_uploaded_unpadded")
