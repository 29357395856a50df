"""The checks of a step, in the order they run: the one list the lockstep driver loops over.

A check's name is written once, in the module of its oracle; `CHECKS`, the statistics and the
failure reports all take it from here. `REGISTRY` holds the checks every campaign runs on every
step (a data-parallel campaign on every rank); `RANK_CHECKS` the ones only a data-parallel
campaign runs, judged across ranks rather than from one rank's `Evidence` (see
`fuzz.rank_checks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec
from pytest_graphmode.fuzz import (
    addresses,
    checks,
    kv_checks,
    race_check,
    rank_checks,
    sampling_check,
)
from pytest_graphmode.fuzz.checks import Outcome
from pytest_graphmode.fuzz.kv_checks import State
from pytest_graphmode.fuzz.tolerance import coarser_precision, computed_in, state_precision
from pytest_graphmode.fuzz.violation import Violation
from pytest_graphmode.runtime.backends.race import Race

ORACLE_MODULES = (race_check, checks, kv_checks, addresses, sampling_check, rank_checks)
"""The modules whose functions, named as their checks, are the oracles (their docstrings describe
the checks in the summary's glossary)."""

Kept = tuple[StepResult, tuple[torch.Tensor, torch.Tensor], int]
"""A result returned at an earlier step, clones of its logits and tokens then, and that step."""


@dataclass(frozen=True)
class Evidence:
    """Everything one step left behind for the checks to judge.

    When a twin raised, the states after the step and the address views are not read (a runner
    that raised owes no consistent state): they are empty, and only the checks that judge raising
    twins run.

    A pipelined pair (docs/contract.md) leaves one `Evidence` per step (`pipelined` says which),
    the first step's judged first. Both hold the pair's states, taken before the first step and
    after the second, and name the other step's batch in `paired`, whose writes the states also
    hold. The first step's judges the writes (`kv_writes_confined`: a stray write is the root
    cause of most wrong values, so it is named before either step's results) and leaves out the
    clean twin's state; the second step's judges the states after the pair (`states_match`,
    `padding_inert`). `held` lists the graph twin's results the caller held unread beside the
    first step's own (the step before's and the second step's).
    """

    batch: Batch
    spec: TargetSpec
    graph: Outcome
    eager: Outcome
    clean: Outcome
    graph_before: State
    eager_before: State
    graph_after: State
    eager_after: State
    clean_after: State
    views: Sequence[AddressView]
    kept: Sequence[Kept]
    companies: Sequence[sampling_check.CompanyRun]  # this step on the company twins
    states_read: bool = True
    pipelined: Literal["first", "second"] | None = None
    paired: Sequence[Batch] = ()
    held: Sequence[tuple[StepResult, int]] = ()
    step: int = 0  # the step's index in its schedule, for the messages that name another step
    # Stream races the backend found since the previous step's checks: during the twins' steps
    # (all of them run the same runner code) and the harness work around them (on cuda only the
    # copies in flight the delayed steps found); None where the backend has no race checker.
    races: Sequence[Race] | None = None
    # The precision float32 matrix products rounded to during the step where coarser than
    # float32 (`tolerance.matmul_precision`: TF32 on cuda), None where they did not.
    matmul: torch.dtype | None = None

    @property
    def twin_raised(self) -> bool:
        return bool(self.graph.error or self.eager.error)

    @property
    def precision(self) -> torch.dtype | None:
        """The finest precision the step's logits can have: the coarser of the twin's floating
        slot-major state's (`tolerance.state_precision`) and the step's matrix products'."""
        return coarser_precision(state_precision(self.eager_before, self.spec), self.matmul)

    @property
    def computed_in(self) -> torch.dtype | None:
        """The precision the eager twin's logits show (`tolerance.computed_in`), or the step's
        matrix products' where coarser; None where the eager twin raised."""
        result = self.eager.result
        if result is None:
            return None
        return coarser_precision(computed_in(result.logits.detach().cpu()), self.matmul)


@dataclass(frozen=True)
class Check:
    """A named oracle over a step's `Evidence`; `applies` says whether it has anything to judge."""

    name: str
    judge: Callable[[Evidence], list[Violation]]
    judges_raising_twins: bool = False
    applies: Callable[[Evidence], bool] = lambda evidence: True


def _kv_writes_confined(e: Evidence) -> list[Violation]:
    return [
        *kv_checks.kv_writes_confined(
            e.batch, e.graph_before, e.graph_after, e.spec, "graph", e.paired
        ),
        *kv_checks.kv_writes_confined(
            e.batch, e.eager_before, e.eager_after, e.spec, "eager", e.paired
        ),
    ]


def _kv_writes_land(e: Evidence) -> list[Violation]:
    afters = {"graph": e.graph_after, "eager": e.eager_after}
    found = kv_checks.kv_writes_land(e.batch, afters, e.spec, e.paired)
    for run in e.companies:
        found += kv_checks.unlanded((run.batch,), run.unwritten, e.spec, run.twin)
    return found


def _results_stay_valid(e: Evidence) -> list[Violation]:
    found = [v for r, snap, at in e.kept for v in checks.results_stay_valid(r, snap, at)]
    if e.graph.result is not None:
        found += [
            v
            for other, at in e.held
            for v in checks.results_disjoint(e.graph.result, e.step, other, at)
        ]
    return found


def _on_company_twin(check: str, twin: str) -> Check:
    """`check`, judging `twin`'s sub-batch (`sampling_check.COMPANY` or `GREEDY_COMPANY`) on the
    steps it ran."""

    def judge(e: Evidence) -> list[Violation]:
        for run in e.companies:
            if run.twin == twin:
                return sampling_check.sampling_independent(
                    run.batch, run.outcome, e.batch, e.eager, e.spec, e.precision, twin, check
                )
        return []

    return Check(check, judge, applies=lambda e: any(run.twin == twin for run in e.companies))


# A device fault (illegal memory access, device-side assert) kills the process that runs the step:
# the parent of an isolated campaign (isolation.py) judges this check, never a step.
NO_DEVICE_FAULT = "no_device_fault"


def is_device_fault(error: BaseException) -> bool:
    """An error that leaves the device unusable: torch's `AcceleratorError`, or a CUDA error
    that older torch raises as `RuntimeError`."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "CUDA error" in text or "device-side assert" in text or "illegal memory access" in text
    )


def is_out_of_device_memory(error: BaseException) -> bool:
    """torch's `OutOfMemoryError` (the caching allocator found no device memory), raised or
    among the causes of what was raised."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, torch.OutOfMemoryError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


REGISTRY: tuple[Check, ...] = (
    # A race is a root cause, reported before it corrupts a value: judge it before any value.
    Check(
        race_check.NO_STREAM_RACES,
        lambda e: race_check.no_stream_races(e.races or ()),
        judges_raising_twins=True,
        applies=lambda e: e.races is not None,
    ),
    # A stray KV write is the root cause of most wrong logits: judge it first.
    Check(
        kv_checks.KV_WRITES_CONFINED,
        _kv_writes_confined,
        applies=lambda e: e.states_read and e.pipelined != "second",
    ),
    # A token whose K/V went elsewhere (the null block, through a block-table entry never filled)
    # is a root cause too; named after a stray write, which says whose slot it took.
    Check(
        kv_checks.KV_WRITES_LAND,
        _kv_writes_land,
        applies=lambda e: e.states_read and e.pipelined != "second",
    ),
    # A sampler that reads the wrong row or a stale seed also makes the graph twin's tokens (and
    # with padding noise its logits) differ from eager: naming the sampler before the generic
    # logits comparison points at the cause instead of the symptom.
    _on_company_twin(sampling_check.SAMPLING_INDEPENDENT, sampling_check.COMPANY),
    # Greedy requests in other company; after the sampler's check, so that a persistent batch's
    # row gone wrong for both kinds of request is named where the token is judged too.
    _on_company_twin(sampling_check.COMPANY_INDEPENDENT, sampling_check.GREEDY_COMPANY),
    # A result that a later step overwrote reads wrong: in a pipelined pair, the first step's is
    # read only after the second step ran. Name the overwrite before the wrong values.
    Check(checks.RESULTS_STAY_VALID, _results_stay_valid),
    Check(
        checks.REPLAY_MATCHES_EAGER,
        lambda e: checks.replay_matches_eager(e.batch, e.graph, e.eager, e.spec, e.precision),
        judges_raising_twins=True,
    ),
    Check(
        checks.PADDING_INERT,
        lambda e: checks.padding_inert(
            e.batch,
            e.graph,
            e.clean,
            e.graph_after,
            e.clean_after,
            e.spec,
            e.paired,
            eager_after=e.eager_after,
        ),
    ),
    Check(
        kv_checks.STATES_MATCH,
        lambda e: kv_checks.states_match(
            e.batch, e.graph_after, e.eager_after, e.spec, e.computed_in
        ),
        applies=lambda e: e.states_read and e.pipelined != "first",
    ),
    # A runner that tracks no address views (`address_views()` is []) gives these nothing to
    # judge: not counted as run, so the summary can say "not applicable".
    Check(
        addresses.ADDRESS_VIEWS_DISJOINT,
        lambda e: addresses.address_views_disjoint(e.views),
        applies=lambda e: bool(e.views),
    ),
    Check(
        addresses.POOL_WITHIN_BOUND,
        lambda e: addresses.pool_within_bound(e.views),
        applies=lambda e: bool(e.views),
    ),
    # Judged outside the step, by the parent of an isolated campaign (isolation.py): a device
    # fault ends the process that would judge it here.
    Check(NO_DEVICE_FAULT, lambda e: [], applies=lambda e: False),
)

RANK_CHECKS: tuple[str, ...] = (rank_checks.RANKS_AGREE, rank_checks.RANKS_ARRIVE)
"""Checks only a data-parallel campaign runs, after the checks of `REGISTRY` on every rank."""

CHECKS: tuple[str, ...] = (*(check.name for check in REGISTRY), *RANK_CHECKS)
"""Every check a campaign can fail with, in the order they run within a step."""
