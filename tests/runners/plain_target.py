"""The target contract over the plain torch.cuda runner (`plain_cuda.py`), which stays unchanged.

The adapter only translates: a harness batch into the runner's rows (slots and block tables from
the harness's block ids), the runner's results into a `StepResult`. Which backend runs it is not
the runner's business: `backend` is accepted and ignored, and on sim the harness's drop-in makes
the runner's `torch.cuda` the sim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from torch import Tensor

from pytest_graphmode.contract import (
    AddressView,
    Batch,
    Request,
    StepResult,
    TargetSpec,
    kv_slot,
)
from tests.runners.plain_cuda import NULL_BLOCK, PlainDecodeRunner, Row, Shape

SHAPE = Shape()
SPEC = TargetSpec(
    num_blocks=SHAPE.num_blocks,
    block_size=SHAPE.block_size,
    max_blocks_per_req=SHAPE.max_blocks_per_req,
    vocab_size=SHAPE.vocab_size,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=SHAPE.capture_sizes,
    features=frozenset({"decode", "prefill", "spec_decode", "weight_update"}),
    null_block=NULL_BLOCK,
)


def rows_of(request: Request) -> list[Row]:
    return [
        Row(
            token,
            request.context_len + i,
            kv_slot(request.block_ids, request.context_len + i, SPEC.block_size),
            request.block_ids,
        )
        for i, token in enumerate(request.tokens)
    ]


class PlainTarget:
    """Graph twin: decode batches replay the runner's graphs. Eager twin: the runner without them."""

    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, runner: type[PlainDecodeRunner]
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec = SPEC
        self.mode = mode
        self.runner = runner(SHAPE, graphs=mode == "graph", seed=seed)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if batch.phase != "decode":
            return f"{batch.phase} batch"
        if batch.query_lens[0] != 1:
            return "speculative decode (query length > 1)"
        if self.runner.capture_size(batch.num_reqs) is None:
            return "more requests than the largest capture size"
        return None

    def step(self, batch: Batch) -> StepResult:
        reason = self.fallback_reason(batch)
        if reason is None:
            rows = [rows_of(r)[0] for r in batch.requests]
            logits, tokens, size = self.runner.decode(rows)
            return StepResult(logits, tokens, "full", ("decode", size))
        rows, last = [], []
        for request in batch.requests:
            rows.extend(rows_of(request))
            last.append(len(rows) - 1)
        logits, tokens = self.runner.eager(rows, last)
        return StepResult(logits, tokens, "eager", None, reason=reason)

    def state(self) -> Mapping[str, Tensor]:
        return {"k": self.runner.k_cache, "v": self.runner.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {"rows": self.runner.static} if self.runner.graphs else {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.runner.load_weights(seed)

    def close(self) -> None:
        self.runner.close()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PlainTarget:
    return PlainTarget(mode, seed=seed, runner=PlainDecodeRunner)
