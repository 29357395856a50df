"""What an executor did: paths taken, graph hits and captures, fallbacks by cause, padding."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pytest_graphmode.runtime.keys import GraphKey


@dataclass(frozen=True, slots=True)
class ExecutorStats:
    """A snapshot; `padding_ratio` is padded rows / rows executed, over graph steps only."""

    steps: dict[str, int]  # per path: "full" | "piecewise" | "eager"
    hits: int  # replays of a graph captured by an earlier step or by capture_all()
    captures: int
    failed_captures: int
    capture_seconds: float
    fallbacks: dict[str, int]  # eager steps per cause (see runtime.dispatch)
    replays: dict[GraphKey, int]
    graph_tokens: int  # real tokens run in graphs
    padded_tokens: int  # tokens executed by those graphs, padding included
    invalidations: tuple[str, ...]
    pool_bytes: int

    @property
    def padding_ratio(self) -> float:
        if self.padded_tokens == 0:
            return 0.0
        return (self.padded_tokens - self.graph_tokens) / self.padded_tokens


@dataclass
class StatsRecorder:
    """The executor's running counters; `snapshot` freezes them."""

    steps: Counter[str] = field(default_factory=Counter)
    hits: int = 0
    captures: int = 0
    failed_captures: int = 0
    capture_seconds: float = 0.0
    fallbacks: Counter[str] = field(default_factory=Counter)
    replays: Counter[GraphKey] = field(default_factory=Counter)
    graph_tokens: int = 0
    padded_tokens: int = 0
    invalidations: list[str] = field(default_factory=list)

    def snapshot(self, pool_bytes: int) -> ExecutorStats:
        return ExecutorStats(
            steps=dict(self.steps),
            hits=self.hits,
            captures=self.captures,
            failed_captures=self.failed_captures,
            capture_seconds=self.capture_seconds,
            fallbacks=dict(self.fallbacks),
            replays=dict(self.replays),
            graph_tokens=self.graph_tokens,
            padded_tokens=self.padded_tokens,
            invalidations=tuple(self.invalidations),
            pool_bytes=pool_bytes,
        )
