"""Errors shared by every backend, so runners catch one type whatever they run on."""

from __future__ import annotations


class CaptureError(RuntimeError):
    """An operation that cannot be captured into a graph ran during a capture.

    The capture is invalidated (as CUDA does with cudaErrorStreamCaptureInvalidated): no half-captured
    graph is left behind, and the backend keeps working.
    """


class UseAfterFreeError(RuntimeError):
    """A replay read memory that was freed after the capture (sim only; CUDA reads it silently)."""


# How CUDA reports an operation that a capturing stream cannot record, through torch.
_CUDA_CAPTURE_MARKERS = (
    "capturing",
    "capture",
    "cudaErrorStreamCapture",
    "operation not permitted when stream is capturing",
)


def capture_error_of(exc: BaseException) -> CaptureError | None:
    """`exc` as a CaptureError when it reports a failed capture (a sim CaptureError, or the CUDA
    error torch raises), else None. Code that delimits captures itself uses this to raise one
    error type on every backend."""
    if isinstance(exc, CaptureError):
        return exc
    if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _CUDA_CAPTURE_MARKERS):
        error = CaptureError(f"capture failed: {exc}")
        error.__cause__ = exc
        return error
    return None
