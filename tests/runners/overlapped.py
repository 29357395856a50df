"""A minimal runner that overlaps its steps, as engines with asynchronous scheduling do: a step
returns while its work is still queued, and the next step's input preparation runs meanwhile.

The integer inputs are staged on the host in one pinned buffer, uploaded into one packed device
buffer on a copy stream, and replayed on a compute stream; the current stream waits for the compute
stream, so results are ready for whoever reads them there. Every reuse waits for the work that last
used the buffer: the host waits for the previous upload before it rewrites the staging buffer, and
the copy stream waits for the previous replay before it rewrites the packed buffer. Correct under
the pipelined pairs of the harness; the mutant `upload_event_skipped` drops one of the waits.
"""

from __future__ import annotations

from typing import Literal

import torch

from pytest_graphmode.contract import Batch, StepResult
from tests.runners import minimal

PACKED = ("tokens", "positions", "slots", "tables", "seeds")  # the int64 inputs, in one buffer


def unpack(packed: torch.Tensor, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    fields, offset = {}, 0
    for name in PACKED:
        width = shapes[name].numel()
        fields[name] = packed[offset : offset + width].view(shapes[name])
        offset += width
    return fields


class OverlappedRunner(minimal.MinimalRunner):
    def allocate_buffers(self, rows: int) -> dict[str, torch.Tensor]:
        buffers = super().allocate_buffers(rows)
        self.shapes = {name: buffers[name].shape for name in PACKED}
        words = sum(shape.numel() for shape in self.shapes.values())
        self.packed = torch.zeros(words, dtype=torch.int64, device=self.backend.device)
        self.source = self.backend.empty_pinned(words, dtype=torch.int64)
        # Host writes go through numpy views of the pinned buffer, as input preparation does.
        fields = unpack(self.source, self.shapes)
        self.staging = {name: field.numpy() for name, field in fields.items()}
        self.copy_stream, self.compute_stream = self.backend.Stream(), self.backend.Stream()
        self.uploaded = self.backend.Event()
        return {**buffers, **unpack(self.packed, self.shapes)}

    def stage(self, batch: Batch, size: int) -> None:
        self.uploaded.synchronize()  # the previous upload has read the staging buffer
        self.write_staging(batch, size)

    def write_staging(self, batch: Batch, size: int) -> None:
        n = batch.num_reqs
        rows = minimal._decode_rows(batch.requests)
        for name, field in self.staging.items():
            if n:
                field[:n] = rows[name]
            field[n:size] = minimal._PADDING[name]

    def upload(self, batch: Batch, size: int) -> None:
        """Flags and temperatures on the current stream, the staged fields on the copy stream;
        the current stream waits for both."""
        n = batch.num_reqs
        rows = minimal._decode_rows(batch.requests)
        for name in ("temperatures", "sampled"):
            buffer = self.buffers[name]
            if n:
                buffer[:n].copy_(torch.tensor(rows[name], dtype=buffer.dtype))
            buffer[n:size].fill_(minimal._PADDING[name])
        current = self.backend.current_stream()
        self.copy_stream.wait_stream(current)  # the previous replay has read `packed`
        with self.backend.stream(self.copy_stream):
            self.packed.copy_(self.source, non_blocking=True)
            self.uploaded.record()
        current.wait_event(self.uploaded)

    def prepare(self, batch: Batch, size: int) -> None:
        self.stage(batch, size)
        self.upload(batch, size)

    def replay(self, batch: Batch) -> StepResult:
        size = next(s for s in minimal.SPEC.capture_sizes if s >= batch.num_reqs)
        n = batch.num_reqs
        # Work issued before this step on the caller's stream (an eager step's KV writes) is
        # ordered before the replay's: without it, an eager step followed at once by a replayed
        # one (a pipelined pair) writes the cache from two unordered streams.
        self.compute_stream.wait_stream(self.backend.current_stream())
        with self.backend.stream(self.compute_stream):
            self.stage(batch, size)
            logits, tokens = (out[:n] for out in self.outputs[size])
            self.upload(batch, size)
            self.graphs[size].replay()
            result = StepResult(logits.clone(), tokens.clone(), "full", ("decode", size))
        self.backend.current_stream().wait_stream(self.compute_stream)
        return result


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> OverlappedRunner:
    return OverlappedRunner(mode, seed=seed, backend=backend)
