"""Graph keys: every field that changes what a captured graph recorded.

Two steps may share a graph only if they need the same kernels launched with the same shapes; the
contents of the static inputs (tokens, positions, block tables, sequence lengths, adapter ids) are
read by the kernels at replay and are not part of the key. A key that misses a field replays the
wrong graph silently; one with needless fields only captures more graphs.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

from pytest_graphmode.contract import Batch, Phase

GraphMode = Literal["full", "piecewise"]


@dataclass(frozen=True, slots=True)
class GraphKey:
    """Identifies one captured graph.

    `num_tokens` and `num_reqs` are the PADDED counts the graph runs. A piecewise graph runs the
    per-request work (attention, logits, sampling) eagerly and pads its request rows to a function
    of its token count, so its `num_reqs`, `query_len` and `phase` are None. `adapters` is the
    decoder's `use_adapters` flag: which adapter a row uses is an index the kernels read from a
    static buffer, so the adapter *set* does not change the graph, but whether any adapter is in
    use does (the low-rank delta ops are recorded only then). `extra` holds a target's own fields.
    """

    mode: GraphMode
    num_tokens: int
    num_reqs: int | None
    query_len: int | None
    phase: Phase | None
    adapters: bool
    extra: tuple[Hashable, ...] = ()

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"GraphKey.num_tokens={self.num_tokens} must be >= 1")
        per_request = (self.num_reqs, self.query_len, self.phase)
        if self.mode == "full":
            if self.num_reqs is None or self.query_len is None or self.phase is None:
                raise ValueError("a full-graph key needs num_reqs, query_len and phase")
            if self.num_reqs * self.query_len != self.num_tokens:
                raise ValueError(
                    f"full-graph key: {self.num_reqs} requests x query length {self.query_len} "
                    f"!= {self.num_tokens} tokens"
                )
        elif self.mode == "piecewise":
            if per_request != (None, None, None):
                raise ValueError(
                    "a piecewise key is keyed by token count only: pass None for "
                    "num_reqs, query_len and phase"
                )
        else:
            raise ValueError(f"GraphKey.mode={self.mode!r} must be 'full' or 'piecewise'")

    def __str__(self) -> str:
        adapters = "+adapters" if self.adapters else ""
        extra = f" {self.extra}" if self.extra else ""
        if self.mode == "piecewise":
            return f"piecewise[T={self.num_tokens}{adapters}]{extra}"
        return (
            f"full[{self.phase} R={self.num_reqs} q={self.query_len} T={self.num_tokens}"
            f"{adapters}]{extra}"
        )


def uses_adapters(batch: Batch) -> bool:
    """The topology-relevant part of the adapter set: is any request on a non-base adapter."""
    return any(request.adapter != 0 for request in batch.requests)
