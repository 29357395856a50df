"""What a backend's race checker reports: two accesses to shared bytes that nothing orders.

`Backend.take_races()` returns these: on sim from its happens-before checker (docs/backends.md, "The
race checker"), on cuda the host accesses to pinned memory whose copy was still in flight
(cuda_races.py, "Copies in flight on cuda").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RaceSide:
    """One of the two accesses of a race."""

    op: str  # "aten.copy_", "graph replay", "host write through a numpy view ..."
    stream: str  # "the default stream", "stream #7", "the host"
    line: str  # "path/to/runner.py:123": the line of the program that issued it
    access: str  # "read" or "write"

    def describe(self) -> str:
        return f"{self.access} by {self.op} on {self.stream} at {self.line}"


@dataclass(frozen=True)
class Race:
    """Two accesses to shared bytes, at least one a write, that happens-before does not order."""

    tensor: str  # "tensor [8] int64": the tensor of the later access (or of the earlier one)
    address: int  # base address of the storage
    byte_range: tuple[int, int]  # the shared bytes, relative to the storage
    earlier: RaceSide
    later: RaceSide
    # Why nothing orders them, where it is more than a missing synchronization: the memory was
    # freed and may be handed out again (a stream-ordered free without record_stream).
    cause: str = ""

    def describe(self) -> str:
        lo, hi = self.byte_range
        why = self.cause or "no event wait, wait_stream or synchronize orders them"
        return (
            f"stream race on {self.tensor}, bytes [{lo}, {hi}) of the storage at "
            f"0x{self.address:x}:\n  {self.earlier.describe()}\n  is not ordered before\n  "
            f"{self.later.describe()}\n({why})"
        )
