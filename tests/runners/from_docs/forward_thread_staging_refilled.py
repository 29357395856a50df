"""A plain `torch.cuda` decode-graph runner whose forward thread uploads a step's inputs and whose
`step` returns once that thread has queued the step, as overlap schedulers do.

Design: `forward_thread_skips_upload_wait`'s model and graphs. The scheduling thread (the caller
of `step`) writes a step's inputs into pinned staging buffers and hands the step to a forward
thread, which uploads the staging with non_blocking copies on its forward stream (after the
caller's stream, whose work the step reads: the KV cache, the weights), replays the graph there
and records an event. `step` makes the caller's stream wait for that event and returns the
device results at once, so the next step's inputs are prepared while the device still runs this
one (the contract allows it: results ordered on the caller's stream). Before it rewrites the
staging, the scheduling thread waits for the last upload's event: the copy may still be queued.

The bug (``make_buggy_target``): the staging is rewritten without that wait, so with the forward
stream behind, the last step's upload reads the next step's rows. The class of bug is SGLang's
overlap scheduler's: the CPU refills host buffers that a non_blocking copy queued by the forward
thread still reads (a copy from a pinned buffer is asynchronous for the host; only its event
says when the buffer may be written again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import Batch, Request, StepResult
from tests.runners.from_docs.forward_thread_skips_upload_wait import (
    PAD_ROW,
    SPEC,
    Runner,
    temperature,
    token_rows,
)


class OverlapRunner(Runner):
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, wait_before_refill: bool
    ) -> None:
        self.wait_before_refill = wait_before_refill
        super().__init__(mode, seed=seed, wait_for_uploads=True)

    def replay(self, batch: Batch) -> StepResult:
        n = batch.num_reqs
        size = next(s for s in SPEC.capture_sizes if s >= n)
        if self.wait_before_refill:
            self.uploaded.synchronize()  # the last step's upload has read the staging
        self.stage(batch.requests, size)
        caller = torch.cuda.current_stream()
        assert self.forward_thread is not None
        logits, tokens, done = self.forward_thread.submit(self.queue_step, size, n, caller).result()
        caller.wait_event(done)
        for result in (logits, tokens):  # made on the forward stream, read on the caller's
            result.record_stream(caller)
        return StepResult(logits, tokens, "full", ("decode", size))

    def stage(self, requests: Sequence[Request], size: int) -> None:
        """Every row of the graph's inputs, valid or padding, written into the pinned staging."""
        rows = [token_rows(r)[0] for r in requests] + [PAD_ROW] * (size - len(requests))
        temps = [temperature(r) for r in requests] + [1.0] * (size - len(requests))
        self.staging["ints"][:size].copy_(torch.tensor(rows, dtype=torch.int64))
        self.staging["temps"][:size].copy_(torch.tensor(temps, dtype=torch.float32))

    def queue_step(self, size: int, n: int, caller: Any) -> tuple[Tensor, Tensor, Any]:
        """On the forward thread: the upload and the replay queued on the forward stream, after
        the caller's stream; the step's results and the event that orders them."""
        torch.cuda.set_stream(self.forward_stream)
        self.forward_stream.wait_stream(caller)
        for name in ("ints", "temps"):
            self.buffers[name][:size].copy_(self.staging[name][:size], non_blocking=True)
        self.uploaded.record()
        self.graphs[size].replay()
        logits, tokens = self.outputs[size]
        kept = logits[:n].clone(), tokens[:n].clone()
        done = torch.cuda.Event()
        done.record()
        return (*kept, done)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OverlapRunner:
    return OverlapRunner(mode, seed=seed, wait_before_refill=True)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OverlapRunner:
    return OverlapRunner(mode, seed=seed, wait_before_refill=False)
