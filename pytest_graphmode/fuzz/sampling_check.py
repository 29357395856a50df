"""`sampling_independent` and `company_independent`: a request's samples depend only on its seed,
position and logits, and its logits not on its company.

The harness cannot recompute a sample: it does not know the runner's sampler. So the checks are
metamorphic, comparing runs in which only the company of a request differs:
- bucket and padding: the graph twin runs a request padded into a capture bucket, the eager twin
  runs the same batch unpadded; `replay_matches_eager` demands equal sampled tokens wherever the
  two rows' logits agree to within `SAMPLED_AGREEMENT` x temperature.
- batch company, row and KV placement: a fourth, never-poisoned *company twin* (eager mode, same
  seed) runs, each step, only the batch's sampled requests, in reverse row order, and with their
  KV blocks renamed by a permutation of the blocks fixed for the example (`BlockRenaming`). A
  request's KV depends only on its own tokens, not on where it is stored, so the company twin
  computes the same logits for it; `sampling_independent` demands the same logits, within the
  tolerance of `replay_matches_eager`, and the same sampled token wherever those logits agree
  with the eager twin's as closely.
- the same for greedy requests: a fifth, the *greedy company twin*, runs about half of the
  greedy requests (which half is drawn per request and example, `greedy_joins`) the same way;
  `company_independent` demands their logits and argmax. Per-row state of a persistent batch (a
  mask, a counter, a row swapped with another) follows a request into another row only in
  other company, which the graph, clean and eager twins never give it: all three keep the rows
  alike, so a row that reads another's state reads it on all three. It runs for every runner
  whose logits do not depend on their batch, greedy-only ones too.
A runner whose logits depend on the rest of the batch by design (`TargetSpec.batch_invariant`
False: capacity-limited expert routing, a norm over the batch) cannot be run in other company:
its company twin runs the whole batch in its order, only KV placement is varied, and it has no
greedy company twin.
A seed or counter baked in at capture, noise indexed by row, by KV slot or drawn per batch, or
padding rows that consume a request's random stream all make tokens differ while the logits agree;
a read of KV slots a request never wrote makes its logits differ. Gumbel-max
with shared noise flips only when two perturbed scores tie to within the logit gap, so the rule
has a false-alarm rate of order 1e-6 per row.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass

import torch

from pytest_graphmode.contract import Batch, Request, TargetSpec
from pytest_graphmode.fuzz.checks import Outcome
from pytest_graphmode.fuzz.tolerance import (
    argmax_decided,
    logit_distance,
    row_tolerance,
    sample_decided,
)
from pytest_graphmode.fuzz.violation import Violation, differences

SAMPLING_INDEPENDENT = "sampling_independent"
COMPANY_INDEPENDENT = "company_independent"

COMPANY = "company"
GREEDY_COMPANY = "greedy company"
"""The company twins' names, as messages give them (`registry` judges `COMPANY` by
`SAMPLING_INDEPENDENT`, `GREEDY_COMPANY` by `COMPANY_INDEPENDENT`)."""


@dataclass(frozen=True)
class BlockRenaming:
    """A permutation of a spec's KV blocks that keeps the null block in place, for one example of
    the company twin. Applied to every step of the example, it stores each request's KV in other
    blocks than the batch lists, consistently from step to step: the same contents, elsewhere.
    Requests that share a block still share its new name."""

    new_name: tuple[int, ...]

    @classmethod
    def drawn(cls, spec: TargetSpec, seed: int) -> BlockRenaming:
        blocks = [b for b in range(spec.num_blocks) if b != spec.null_block]
        shuffled = blocks.copy()
        random.Random(f"blocks {seed}").shuffle(shuffled)
        new_name = list(range(spec.num_blocks))
        for old, new in zip(blocks, shuffled, strict=True):
            new_name[old] = new
        return cls(tuple(new_name))

    def __call__(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.new_name[b] for b in block_ids)


GREEDY_SHARE = 0.5
"""The share of greedy requests the greedy company twin runs: every one would give it the batch's
greedy rows in their own company, which the eager twin already has."""


@functools.lru_cache(maxsize=4096)
def greedy_joins(example_seed: int, req_id: int) -> bool:
    """Whether the greedy company twin runs greedy request `req_id` in the example of
    `example_seed`: the same answer at every step of the example, so a request that joins has
    its whole cache there."""
    return random.Random(f"company {example_seed} {req_id}").random() < GREEDY_SHARE


@dataclass(frozen=True)
class CompanyRun:
    """One step of a company twin: its sub-batch, its outcome and the slots its sub-batch had to
    write that still held the harness's mark after the step (`kv_writes_land`)."""

    twin: str  # COMPANY or GREEDY_COMPANY
    batch: Batch
    outcome: Outcome
    unwritten: tuple[int, ...]


def company_batch(
    batch: Batch, renaming: BlockRenaming | None = None, *, batch_invariant: bool = True
) -> Batch | None:
    """The sub-batch the company twin runs: sampled requests, reversed, their blocks renamed by
    `renaming`; None if there are none. For a runner whose logits depend on the batch
    (`TargetSpec.batch_invariant` False), the whole batch in its order, renamed, at every step
    (its greedy requests' caches must be there for the steps that sample): only the KV placement
    differs then."""
    if batch_invariant:
        chosen = tuple(r for r in reversed(batch.requests) if r.seed is not None)
    else:
        chosen = batch.requests
    return _renamed(chosen, renaming)


def greedy_company_batch(
    batch: Batch, example_seed: int, renaming: BlockRenaming | None = None
) -> Batch | None:
    """The sub-batch the greedy company twin runs: the greedy requests that `greedy_joins` picks
    for the example, reversed, their blocks renamed by `renaming`; None if there are none. A
    twin of their own, not the company twin's: greedy requests beside the sampled ones would
    make the sampled ones' company (a persistent batch's rows, what it condenses) more like the
    batch's, which hides the bugs that company is there for (`condense_leaves_sampling_rows`
    went from the fourth example to the tenth, `request_state_not_evicted` from the fourth to
    none in 60 on one seed of three)."""
    chosen = tuple(
        r
        for r in reversed(batch.requests)
        if r.seed is None and greedy_joins(example_seed, r.req_id)
    )
    return _renamed(chosen, renaming)


def _renamed(chosen: tuple[Request, ...], renaming: BlockRenaming | None) -> Batch | None:
    if renaming is not None:
        chosen = tuple(dataclasses.replace(r, block_ids=renaming(r.block_ids)) for r in chosen)
    return Batch(chosen) if chosen else None


def sampling_independent(
    company_batch: Batch,
    company: Outcome,
    batch: Batch,
    eager: Outcome,
    spec: TargetSpec,
    precision: torch.dtype | None = None,
    twin: str = COMPANY,
    check: str = SAMPLING_INDEPENDENT,
) -> list[Violation]:
    """A sampled request draws the same token whatever company, row and KV blocks it runs in,
    where its logits agree (`precision`: as for `checks.replay_matches_eager`); a greedy one on
    `twin` has the same logits and the same argmax. Violations are `check`'s (the registry
    judges `GREEDY_COMPANY` as `COMPANY_INDEPENDENT`)."""
    if eager.result is None:
        return []  # replay_matches_eager reports a failing eager twin
    if company.result is None:
        return [
            Violation(
                check,
                f"the {twin} twin raised on a sub-batch of a legal batch:\n{company.error}",
            )
        ]
    rows = {r.req_id: i for i, r in enumerate(batch.requests)}
    mine = company.result.logits.detach().cpu().float()
    theirs = eager.result.logits.detach().cpu()
    tol = row_tolerance(theirs, precision)  # of the logits as the runner made them, not upcast
    theirs = theirs.float()
    tokens = company.result.next_tokens.cpu().tolist()
    reference = eager.result.next_tokens.cpu().tolist()
    for row, request in enumerate(company_batch.requests):
        other = rows[request.req_id]
        distance = logit_distance(mine[row], theirs[other])
        gap = float(distance.amax())
        where = (
            f"(row {row} of {company_batch.num_reqs} here, row {other} of {batch.num_reqs} "
            f"in the full batch)"
        )
        if not gap <= float(tol[other]):
            return [
                Violation(
                    check,
                    f"logits depend on batch company or KV placement {where}",
                    req_id=request.req_id,
                    row=row,
                    **differences(theirs[other], mine[row], distance <= tol[other]),
                )
            ]
        if request.seed is None:
            decidable = bool(argmax_decided(theirs[other : other + 1], tol[other : other + 1]))
            what = "greedy token"
        else:
            decidable = sample_decided(gap, request.temperature)
            what = f"sampled token (seed {request.seed})"
        if decidable and tokens[row] != reference[other]:
            return [
                Violation(
                    check,
                    f"{what} depends on batch company, bucket, padding or KV placement {where}",
                    req_id=request.req_id,
                    row=row,
                    expected=str(reference[other]),
                    actual=str(tokens[row]),
                )
            ]
    return []
