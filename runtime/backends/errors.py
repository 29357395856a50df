"""Errors shared by every backend, so runners catch one type whatever they run on."""

from __future__ import annotations


class CaptureError(RuntimeError):
    """An operation that cannot be captured into a graph ran during a capture.

    The capture is invalidated (as CUDA does with cudaErrorStreamCaptureInvalidated): no half-captured
    graph is left behind, and the backend keeps working.
    """


class UseAfterFreeError(RuntimeError):
    """A replay read memory that was freed after the capture (sim only; CUDA reads it silently)."""
