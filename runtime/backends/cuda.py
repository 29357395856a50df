"""The cuda backend: a thin pass-through to torch.cuda.

It adds error translation: a CUDA error raised because a stream was capturing becomes
`CaptureError`, and the failed capture is cleaned up so the process can keep capturing. And it
keeps `inflight_copies` (cuda_races.py), which the harness's delays tell of the non-blocking copies
and host operations of a stressed step: `take_races()` hands over the host accesses it found to
pinned memory whose copy was still in flight. While it is active, the threads a runner starts are
followed, so that the delays see their copies too (cuda_threads.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pytest_graphmode.runtime.backends import cuda_threads
from pytest_graphmode.runtime.backends.cuda_races import InflightCopies
from pytest_graphmode.runtime.backends.errors import (
    CaptureError,
    UseAfterFreeError,
    capture_error_of,
)
from pytest_graphmode.runtime.backends.race import Race


class CudaBackend:
    name = "cuda"
    CaptureError = CaptureError
    UseAfterFreeError = UseAfterFreeError

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda backend needs a CUDA GPU; use backend 'sim' without one")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.Graph = torch.cuda.CUDAGraph
        self.Stream = torch.cuda.Stream
        self.Event = torch.cuda.Event
        self.current_stream = torch.cuda.current_stream
        self.default_stream = torch.cuda.default_stream
        self.stream = torch.cuda.stream
        self.synchronize = torch.cuda.synchronize
        self.graph_pool_handle = torch.cuda.graph_pool_handle
        self.is_current_stream_capturing = torch.cuda.is_current_stream_capturing
        self.empty_cache = torch.cuda.empty_cache
        self.mem_get_info = torch.cuda.mem_get_info
        self.inflight_copies = InflightCopies()

    # Nothing of torch is patched on a GPU, and the backend works whether activated or not:
    # activation only has the threads started meanwhile followed by the harness's delays.
    is_active = True

    def activate(self) -> None:
        """Until the matching `deactivate()`, threads started are followed: the harness's delays
        see their operations too (cuda_threads.py). Calls nest."""
        cuda_threads.activate()

    def deactivate(self) -> None:
        """End an `activate()`."""
        cuda_threads.deactivate()

    @contextmanager
    def active(self) -> Iterator[CudaBackend]:
        self.activate()
        try:
            yield self
        finally:
            self.deactivate()

    def set_scheduler_seed(self, seed: int) -> None:
        """Stream order on a GPU is the hardware's: nothing to seed (sim-only knob)."""

    def take_races(self) -> list[Race]:
        """The host accesses to pinned memory whose non-blocking copy was still in flight, found
        since the last call (cuda_races.py; only where the harness's delays told of them). A GPU
        has no checker of every access as sim has."""
        # a followed thread may still be judging an operation it began inside the step's scope
        with cuda_threads.judged_one_at_a_time():
            return self.inflight_copies.take()

    def empty_pinned(
        self, size: int | tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, pin_memory=True)

    @contextmanager
    def graph(
        self,
        cuda_graph: torch.cuda.CUDAGraph,
        pool: Any = None,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: str = "global",
    ) -> Iterator[torch.cuda.CUDAGraph]:
        # An explicit pool even for a private capture: its id is what a failed capture must give
        # back, and torch only reveals a graph's pool after a successful capture.
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        ctx = torch.cuda.graph(
            cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode
        )
        # torch.cuda.graph switches streams on entry and back only after a successful
        # capture_end: a failed capture would leave the process on the capture stream, and later
        # eager work would silently run there. Every failure path restores this stream.
        previous = torch.cuda.current_stream()
        try:
            ctx.__enter__()
        except RuntimeError as exc:
            torch.cuda.set_stream(previous)
            error = capture_error_of(exc)
            if error is None:
                raise
            raise error from exc
        try:
            yield cuda_graph
        except BaseException as exc:
            self._close_failed_capture(ctx, cuda_graph, pool, exc)
            torch.cuda.set_stream(previous)
            error = capture_error_of(exc)
            if error is not None and error is not exc:
                raise error from exc
            raise
        try:
            ctx.__exit__(None, None, None)
        except RuntimeError as exc:
            _release_capture_pool(cuda_graph, pool)
            torch.cuda.set_stream(previous)
            raise CaptureError(f"capture failed at capture_end: {exc}") from exc

    @staticmethod
    def _close_failed_capture(
        ctx: Any, cuda_graph: torch.cuda.CUDAGraph, pool: Any, exc: BaseException
    ) -> None:
        try:
            ctx.__exit__(type(exc), exc, exc.__traceback__)
        except RuntimeError:
            _release_capture_pool(cuda_graph, pool)
        else:
            cuda_graph.reset()


def _release_capture_pool(cuda_graph: torch.cuda.CUDAGraph, pool: Any) -> None:
    """Undo what capture_begin did to the caching allocator when capture_end failed.

    torch's capture_end raises at cudaStreamEndCapture, before it tells the allocator the capture
    is over: allocations would keep going to the graph's pool and the allocator would believe a
    capture is still under way (its next empty_cache or pool release aborts the process). End the
    routing and drop the reference the capture took on the pool, then reset the graph.
    """
    device = torch.cuda.current_device()
    torch._C._cuda_endAllocateToPool(device, pool)
    torch._C._cuda_releasePool(device, pool)
    cuda_graph.reset()
