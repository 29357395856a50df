"""Data-parallel coordination: every rank runs the same graph at the same step.

With data (or expert) parallelism each rank schedules its own batch, but collectives inside or
around the model only meet if every rank launches the same work: a rank replaying a graph of 8
requests while another runs eagerly, or replays a graph of 16, deadlocks or mixes graph and eager
work in one collective. Serving engines therefore add one collective per step before dispatch,
and so does this module:

1. Each rank contributes what it would do alone (`Contribution`: its request and token counts,
   the best path it can take and the padded sizes of that path, the query length, phase and
   adapter flag that go into a graph key, a flag for a rank forced eager, and how many graph
   keys it knows) to ONE all-gather.
2. Every rank computes the same `Agreement` from the gathered rows (`agree`, a pure function): the
   weakest path any working rank can take (full > piecewise > eager), padded to the largest size
   any rank needs, with the adapter ops in the graph if any rank uses an adapter. FULL also needs
   one query length and one phase on every working rank, else the step runs PIECEWISE, whose key
   is the token count alone.
3. A rank with no work stages an empty batch and runs the agreed shape as a dummy batch: all its
   rows are padding, so it writes the null block and nothing else.

Capturing is collective too. The first step that uses a key captures it on every rank (keys are
agreed, so every rank misses it at the same step) and one more all-gather tells every rank whose
capture failed; a key that failed anywhere is marked failed everywhere and the step falls back to
the next weaker path on every rank, with no further collective. The failed keys therefore stay the
same on every rank, which is why the gathered key counts must agree (checked every step).

One rank (no group, or a world of one) takes none of this: the executor does not build a
coordinator, and a step costs exactly what it costs without data parallelism. The collectives run
on whatever process group the caller set up: gloo with CPU tensors on the sim backend, NCCL with
CUDA tensors on cuda. Their timeout is the process group's (`init_process_group(timeout=...)`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from pytest_graphmode.contract import Batch, Path, Phase
from pytest_graphmode.runtime.buckets import BucketTable
from pytest_graphmode.runtime.dispatch import Decision, Dispatcher
from pytest_graphmode.runtime.keys import GraphKey, uses_adapters

PATH_RANK: dict[Path, int] = {"eager": 0, "piecewise": 1, "full": 2}
_PATHS: dict[int, Path] = {rank: path for path, rank in PATH_RANK.items()}
_PHASES: tuple[Phase, ...] = ("decode", "prefill", "mixed")
DATA_PARALLEL = "data_parallel"  # the dispatcher's cause for a path other ranks imposed


@dataclass
class DataParallel:
    """One rank's membership in a data-parallel group.

    `group` is the process group the coordination collectives run on (None: the default group);
    `device` is where their tensors live (cpu for gloo, the rank's GPU for NCCL). `force_eager`
    is a rank-local switch read at every step (a rank that must not replay, e.g. while debugging
    it): that rank contributes the eager path, so every rank runs eagerly. `watch`, when set, is
    called with "enter" before and "leave" after every collective, for watchdogs that must say
    which ranks never arrived at one.
    """

    rank: int
    world_size: int
    group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    force_eager: bool = False
    watch: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size} ranks")

    def all_gather(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` (all of the same length), in rank order: one collective."""
        local = torch.tensor(row, dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(local) for _ in range(self.world_size)]
        if self.watch is not None:
            self.watch("enter")
        dist.all_gather(rows, local, group=self.group)
        if self.watch is not None:
            self.watch("leave")
        return [[int(v) for v in r.cpu().tolist()] for r in rows]


_current: DataParallel | None = None


@contextmanager
def joined(member: DataParallel) -> Iterator[DataParallel]:
    """Targets made inside this block (`make_target`) coordinate through `member`; the group is
    process-wide state, as a serving engine's parallel state is."""
    global _current
    previous, _current = _current, member
    try:
        yield member
    finally:
        _current = previous


def current() -> DataParallel | None:
    """The membership of the innermost `joined` block, or None (a single rank)."""
    return _current


@dataclass(frozen=True, slots=True)
class Contribution:
    """What one rank would do alone; `query_len` is 0 for a non-uniform batch, `best` a
    `PATH_RANK` value, `known_keys` the graph keys it holds or knows to have failed."""

    rank: int
    num_reqs: int
    num_tokens: int
    best: int
    padded_reqs: int
    padded_tokens: int
    query_len: int
    phase: int
    adapters: int
    forced_eager: int
    known_keys: int

    @property
    def working(self) -> bool:
        return self.num_reqs > 0

    def row(self) -> list[int]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> Contribution:
        return cls(*row)


@dataclass(frozen=True, slots=True)
class Agreement:
    """The path, key and padded shape every rank runs; `reason` says which rank decided it."""

    path: Path
    key: GraphKey | None
    padded_reqs: int
    padded_tokens: int
    reason: str


def contribution(
    rank: int, batch: Batch, dispatcher: Dispatcher, *, forced_eager: bool, known_keys: int
) -> Contribution:
    """This rank's row for `batch` (empty: an idle rank, which constrains nothing)."""
    if not batch.requests:
        return Contribution(rank, 0, 0, PATH_RANK["full"], 0, 0, 0, 0, 0, 0, known_keys)
    alone = dispatcher.decide(batch)
    best = PATH_RANK["eager"] if forced_eager else PATH_RANK[alone.path]
    return Contribution(
        rank=rank,
        num_reqs=batch.num_reqs,
        num_tokens=batch.num_tokens,
        best=best,
        padded_reqs=alone.padded_reqs,
        padded_tokens=alone.padded_tokens,
        query_len=batch.query_lens[0] if batch.uniform else 0,
        phase=_PHASES.index(batch.phase),
        adapters=int(uses_adapters(batch)),
        forced_eager=int(forced_eager),
        known_keys=known_keys,
    )


def agree(
    rows: Sequence[Contribution], dispatcher: Dispatcher, failed: Sequence[GraphKey] = ()
) -> Agreement | None:
    """The step every rank runs, from every rank's row; None when no rank has work.

    Deterministic in its arguments, so every rank computes the same agreement from the same rows
    and the same failed keys."""
    working = [r for r in rows if r.working]
    if not working:
        return None
    counts = {r.known_keys for r in rows}
    if len(counts) > 1:
        raise RuntimeError(
            "data-parallel ranks hold different graph caches (graph and failed key counts "
            f"{[r.known_keys for r in rows]} by rank): capture, invalidate and update weights on "
            "every rank at the same step"
        )
    adapters = any(r.adapters for r in working)
    weakest = min(working, key=lambda r: r.best)
    path = _PATHS[weakest.best]
    why = _why(weakest, path)
    if path == "full":
        shapes = {(r.query_len, r.phase) for r in working}
        if len(shapes) == 1:
            padded_reqs = max(r.padded_reqs for r in working)
            q, phase = shapes.pop()
            key = GraphKey("full", padded_reqs * q, padded_reqs, q, _PHASES[phase], adapters)
            if key not in failed:
                reason = f"{why}; full graph of {padded_reqs} requests x {q} tokens"
                return Agreement("full", key, padded_reqs, padded_reqs * q, reason)
            why = f"the agreed full graph {key} failed to capture"
        else:
            why = f"ranks differ in query length or phase {sorted(shapes)}"
        path = "piecewise"
    if path == "piecewise" and dispatcher.piecewise_sizes:
        largest = max(r.num_tokens for r in working)
        padded_tokens = BucketTable(dispatcher.piecewise_sizes).padded(largest)
        if padded_tokens is not None:
            key = GraphKey("piecewise", padded_tokens, None, None, None, adapters)
            if key not in failed:
                padded_reqs = padded_tokens
                if dispatcher.max_num_reqs is not None:
                    padded_reqs = min(padded_tokens, dispatcher.max_num_reqs)
                reason = f"{why}; piecewise graph of {padded_tokens} tokens"
                return Agreement("piecewise", key, padded_reqs, padded_tokens, reason)
            why = f"the agreed piecewise graph {key} failed to capture"
        else:
            why = f"rank batches of up to {largest} tokens exceed every piecewise size"
    padded_reqs = max(r.num_reqs for r in working)
    padded_tokens = max(r.num_tokens for r in working)
    reason = f"{why}; eager, padded to {padded_reqs} requests and {padded_tokens} tokens"
    return Agreement("eager", None, padded_reqs, padded_tokens, reason)


def _why(weakest: Contribution, path: Path) -> str:
    if weakest.forced_eager:
        return f"data-parallel: rank {weakest.rank} is forced eager"
    return f"data-parallel: rank {weakest.rank} can take {path} at best"


class Coordinator:
    """Runs the coordination collectives of one executor's steps."""

    _rows: list[Contribution]  # the rows of the last all-gather

    def __init__(self, member: DataParallel, dispatcher: Dispatcher) -> None:
        self.member = member
        self.dispatcher = dispatcher
        self._rows = []

    def decide(self, batch: Batch, failed: Sequence[GraphKey], known_keys: int) -> Decision:
        """The agreed decision for this rank's `batch` (one all-gather)."""
        local = contribution(
            self.member.rank,
            batch,
            self.dispatcher,
            forced_eager=self.member.force_eager,
            known_keys=known_keys,
        )
        self._rows = [Contribution.from_row(r) for r in self.member.all_gather(local.row())]
        return self.again(batch, failed)

    def again(self, batch: Batch, failed: Sequence[GraphKey]) -> Decision:
        """The decision from the rows already gathered, after keys failed (no collective)."""
        agreement = agree(self._rows, self.dispatcher, failed)
        if agreement is None:  # nobody has work: an idle rank runs nothing
            return Decision("eager", None, "data-parallel: no rank has work", 0, 0, DATA_PARALLEL)
        alone = self.dispatcher.decide(batch) if batch.requests else None
        cause = None
        if agreement.path != "full":
            same = alone is not None and alone.path == agreement.path
            cause = alone.cause if same and alone is not None else DATA_PARALLEL
        return Decision(
            agreement.path,
            agreement.key,
            agreement.reason,
            agreement.padded_reqs,
            agreement.padded_tokens,
            cause,
        )

    def failed_ranks(self, captured: bool) -> list[int]:
        """The ranks whose capture of the agreed key failed (one all-gather)."""
        rows = self.member.all_gather([int(captured)])
        return [rank for rank, (ok,) in enumerate(rows) if not ok]
