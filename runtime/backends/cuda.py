"""The cuda backend: a thin pass-through to torch.cuda.

The only behaviour it adds is error translation: a CUDA error raised because a stream was capturing
becomes `CaptureError`, and the failed capture is cleaned up so the process can keep capturing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch

from pytest_graphmode.runtime.backends.errors import (
    CaptureError,
    UseAfterFreeError,
    capture_error_of,
)


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

    def set_scheduler_seed(self, seed: int) -> None:
        """Stream order on a GPU is the hardware's: nothing to seed (sim-only knob)."""

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
        ctx = torch.cuda.graph(
            cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode
        )
        ctx.__enter__()
        try:
            yield cuda_graph
        except BaseException as exc:
            self._close_failed_capture(ctx, cuda_graph, exc)
            error = capture_error_of(exc)
            if error is not None and error is not exc:
                raise error from exc
            raise
        try:
            ctx.__exit__(None, None, None)
        except RuntimeError as exc:
            cuda_graph.reset()
            raise CaptureError(f"capture failed at capture_end: {exc}") from exc

    @staticmethod
    def _close_failed_capture(
        ctx: Any, cuda_graph: torch.cuda.CUDAGraph, exc: BaseException
    ) -> None:
        # Ending an invalidated capture raises; what matters is that capture mode is left and the
        # pool stops receiving allocations, which capture_end does before it reports the error.
        with suppress(RuntimeError):
            ctx.__exit__(type(exc), exc, exc.__traceback__)
        cuda_graph.reset()
