"""Errors raised by the graph memory pools."""

from __future__ import annotations


class PoolError(RuntimeError):
    """A graph memory pool was used in a way it does not allow."""


class PoolExhaustedError(PoolError, MemoryError):
    """A view ran out of its reserved virtual range, or the physical pool could not grow."""


class VmmUnsupportedError(PoolError):
    """The `vmm` strategy cannot run here; `reason` says why.

    The executor catches this, reports `reason`, and falls back to the `shared` strategy.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"the vmm graph memory strategy is unavailable: {reason}")
        self.reason = reason
