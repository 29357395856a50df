"""Dispatch: FULL graph -> PIECEWISE graph -> EAGER, always with a reason a person can read.

FULL graphs serve uniform batches (every request has the same query length q: decode q = 1,
speculative decode q = 1 + k): the request count is padded to a capture size and the graph runs
padded_reqs * q tokens, which must stay within the largest capture size. Everything else (mixed
query lengths, long queries, oversized batches) runs as a PIECEWISE graph keyed by the padded token
count when piecewise sizes are configured, and eagerly otherwise. A piecewise step pads its request
count to min(padded tokens, max_num_reqs): padding requests have no query tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from pytest_graphmode.contract import Batch, Path
from pytest_graphmode.runtime.buckets import BucketTable
from pytest_graphmode.runtime.keys import GraphKey, uses_adapters

# Stable names for why a batch did not run as a FULL graph (counters are keyed by these; the
# human reason carries the numbers).
NON_UNIFORM = "non_uniform"
QUERY_TOO_LONG = "query_too_long"
OVERSIZED = "oversized"
GRAPHS_DISABLED = "graphs_disabled"
CAPTURE_FAILED = "capture_failed"


@dataclass(frozen=True, slots=True)
class Decision:
    """How one step runs. `padded_reqs` / `padded_tokens` are the shapes staged and executed;
    `cause` is None on the FULL path, else one of the stable names above."""

    path: Path
    key: GraphKey | None
    reason: str
    padded_reqs: int
    padded_tokens: int
    cause: str | None = None


class Dispatcher:
    """Chooses the path and graph key of each batch, and counts the choices."""

    def __init__(
        self,
        capture_sizes: Iterable[int],
        *,
        max_query_len: int,
        piecewise_sizes: Iterable[int] | None = None,
        max_num_reqs: int | None = None,
    ) -> None:
        if max_query_len < 1:
            raise ValueError(f"max_query_len={max_query_len} must be >= 1 (1 = plain decode)")
        sizes = list(capture_sizes)
        self._full = BucketTable(sizes) if sizes else None
        pieces = list(piecewise_sizes) if piecewise_sizes is not None else []
        if piecewise_sizes is not None and not pieces:
            raise ValueError("piecewise_sizes is empty: pass None to disable piecewise graphs")
        self._piecewise = BucketTable(pieces) if pieces else None
        self.max_query_len = max_query_len
        self.max_num_reqs = max_num_reqs
        self.by_key: Counter[GraphKey] = Counter()
        self.by_cause: Counter[str] = Counter()

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        return self._full.sizes if self._full else ()

    @property
    def piecewise_sizes(self) -> tuple[int, ...]:
        return self._piecewise.sizes if self._piecewise else ()

    def full_keys(
        self, *, query_lens: Iterable[int] = (1,), adapters: Iterable[bool] = (False,)
    ) -> list[GraphKey]:
        """The decode keys of every capture size, query length and adapter flag, largest first
        (the order to capture them in, so smaller graphs reuse the pool blocks of larger ones)."""
        if self._full is None:
            return []
        keys = [
            GraphKey("full", size * q, size, q, "decode", flag)
            for q in query_lens
            for size in self._full.sizes
            if size * q <= self._full.max_size
            for flag in adapters
        ]
        return sorted(keys, key=lambda k: (k.num_tokens, k.adapters), reverse=True)

    def dispatch(self, batch: Batch) -> Decision:
        """`decide` and count the decision."""
        decision = self.decide(batch)
        self.record(decision)
        return decision

    def record(self, decision: Decision) -> None:
        if decision.key is not None:
            self.by_key[decision.key] += 1
        if decision.cause is not None:
            self.by_cause[decision.cause] += 1

    def decide(self, batch: Batch) -> Decision:
        """The path for `batch`; counts nothing."""
        if not batch.requests:
            raise ValueError("cannot dispatch an empty batch: a step needs at least one request")
        adapters = uses_adapters(batch)
        q = batch.query_lens[0]
        cause, reason, padded_reqs = self._full_miss(batch, q)
        if cause is None:
            key = GraphKey("full", padded_reqs * q, padded_reqs, q, batch.phase, adapters)
            return Decision("full", key, reason, padded_reqs, padded_reqs * q)
        tokens = batch.num_tokens
        if self._piecewise is None:
            reason = f"{reason}, piecewise not enabled"
            return Decision("eager", None, reason, batch.num_reqs, tokens, cause)
        padded_tokens = self._piecewise.padded(tokens)
        if padded_tokens is None:
            reason = (
                f"{reason}; batch of {tokens} tokens also exceeds the largest piecewise size "
                f"{self._piecewise.max_size}"
            )
            return Decision("eager", None, reason, batch.num_reqs, tokens, OVERSIZED)
        # The request count is padded too, as a function of the token count alone, so a
        # piecewise graph (whose last piece gathers and samples one row per request) is fully
        # determined by its padded token count.
        padded_reqs = padded_tokens
        if self.max_num_reqs is not None:
            padded_reqs = min(padded_tokens, self.max_num_reqs)
        key = GraphKey("piecewise", padded_tokens, None, None, None, adapters)
        reason = f"{reason}; piecewise graph of {padded_tokens} tokens"
        return Decision("piecewise", key, reason, padded_reqs, padded_tokens, cause)

    def _full_miss(self, batch: Batch, q: int) -> tuple[str | None, str, int]:
        """(cause, reason, padded_reqs); cause None means the batch fits a FULL graph."""
        if not batch.uniform:
            return NON_UNIFORM, f"non-uniform query lengths ({batch.phase} batch)", 0
        if q > self.max_query_len:
            return (
                QUERY_TOO_LONG,
                f"query length {q} exceeds max_query_len={self.max_query_len} of the full graphs",
                0,
            )
        if self._full is None:
            return GRAPHS_DISABLED, "no capture sizes configured (full graphs disabled)", 0
        largest = self._full.max_size
        if batch.num_tokens > largest or batch.num_reqs > largest:
            return (
                OVERSIZED,
                f"batch of {batch.num_tokens} tokens exceeds the largest capture size {largest}",
                0,
            )
        padded_reqs = self._full.padded(batch.num_reqs)
        assert padded_reqs is not None  # num_reqs <= largest
        if padded_reqs * q > largest:
            return (
                OVERSIZED,
                f"batch of {batch.num_reqs} requests x {q} tokens pads to {padded_reqs} requests "
                f"= {padded_reqs * q} tokens, above the largest capture size {largest}",
                0,
            )
        reason = (
            f"uniform {batch.phase} batch of {batch.num_reqs} requests x {q} tokens padded to "
            f"{padded_reqs} requests"
        )
        return None, reason, padded_reqs
