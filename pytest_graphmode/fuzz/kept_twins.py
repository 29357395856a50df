"""How a campaign runs its examples: on twins kept across examples.

Making the twins and capturing their graphs is most of an example's cost, so a campaign keeps its
twins: each example after the first on them starts with a `Reset` (every twin's `state()` restored
from the copy taken when the twins were made, the generators reseeded), and the graphs captured
so far stay captured. Fresh twins still come, so that bugs of capture itself stay reachable: every
`FRESH_EVERY`-th example, and any example the campaign asks them for (`run(..., fresh=True)`: the
leading example of a capture on long contexts). A weight update needs none: every twin gets the
same new weights, and the next examples start from them (restoring `state()` does not undo them).
What a runner must do to be kept is in docs/contract.md ("Kept twins").

A failure found on kept twins is run again alone, on fresh twins. When it fails there too, that
is the failure reported and shrunk: its snippet replays the example alone. When it passes alone
but the example started from weights an earlier example's update loaded, it is run again after
that update: when it fails so, it is reported at once, unshrunk (Hypothesis knows nothing of the
update), with a snippet that replays the update and the example. When it passes that way too,
it is run again on fresh twins made with the seed the kept twins were made with (the first
example's; a factory may draw its weights from it), after a `Reset` to the example's seed: when
that fails, the failure needed those twins, and its snippet makes them and runs the example.
When it passes, every example since the twins were made is run again on fresh twins (each after
a `Reset`): when that fails, the failure needed the twins' history; when it passes too, the
failure did not repeat (timing: the order in which streams and the host ran, or what freed
memory held), which the report says. Either is reported at once with a snippet that replays
those examples, not shrunk, since Hypothesis shrinks one example and this one passes alone.
Either way the rest of the campaign (shrinking) runs on fresh twins, where an example's outcome
depends on that example alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import Batch, TargetFactory
from pytest_graphmode.failure import GraphmodeFailure
from pytest_graphmode.fuzz.lockstep import Lockstep
from pytest_graphmode.strategies.plans import Reset, Stress

FRESH_EVERY = 8
"""Examples run on one set of twins before fresh ones are made (and their graphs captured)."""


NEEDS_HISTORY = "shrinking skipped: the failure needs the examples before it on the same twins"
NEEDS_WEIGHTS = (
    "shrinking skipped: the example started from weights an earlier example loaded, which the "
    "example alone does not hold; its snippet replays that weight update first"
)
NEEDS_TWIN_SEED = (
    "shrinking skipped: the failure needs twins made with the seed the kept twins were made with, "
    "which the example alone does not use"
)
NOT_REPEATED_ON_FRESH_TWINS = (
    "shrinking skipped: the failure repeated neither alone nor after the examples before it, on "
    "fresh twins"
)
IN_CONSTRUCTION = (
    "shrinking skipped: the twins' construction failed, before any step of the example; its "
    "snippet makes the twins and runs no step"
)


class HistoryFailure(BaseException):
    """A failure that needed the twins' history (their weights, or every example run on them),
    or none of the example (the twins' construction failed). A `BaseException`, so that it passes
    Hypothesis unshrunk: shrinking it example by example would find that it passes alone (flaky,
    to Hypothesis), or would draw examples that make no difference. `unshrunk` says which, for
    the report."""

    def __init__(self, failed: GraphmodeFailure, unshrunk: str = NEEDS_HISTORY) -> None:
        super().__init__(failed.failure.message)
        self.failed = failed
        self.unshrunk = unshrunk


class KeptTwins:
    """Runs a campaign's examples, on twins kept across examples until the first failure."""

    def __init__(self, factory: TargetFactory, *, backend: str, stats: CampaignStats) -> None:
        self._factory, self._backend, self._stats = factory, backend, stats
        self._keep = True
        self._kept: Lockstep | None = None

    def run(self, events: Sequence[Batch | Stress], seed: int, fresh: bool = False) -> None:
        """Run one example, on fresh twins every `FRESH_EVERY` examples, and with `fresh` whatever
        the count; raise `GraphmodeFailure` (or `HistoryFailure`) for a failure."""
        if not self._keep:
            self._alone(events, seed, self._stats)
            return
        kept = self._kept
        if kept is None or fresh or kept.examples >= FRESH_EVERY:
            self.close()
            try:
                kept = self._kept = Lockstep(
                    self._factory, backend=self._backend, seed=seed, stats=self._stats, kept=True
                )
            except GraphmodeFailure as made:  # the twins do not start identical
                self._stop_keeping()
                raise HistoryFailure(made, IN_CONSTRUCTION) from None
            run: list[Batch | Stress | Reset] = list(events)
        else:
            run = [Reset(seed), *events]
        weights = kept.weight_seed  # the weights this example starts from
        try:
            kept.run(run)
        except GraphmodeFailure as error:
            found = error
        except BaseException:
            # A device fault poisons the twins' context, Ctrl-C ends the campaign: neither
            # leaves twins worth keeping.
            self._stop_keeping()
            raise
        else:
            return
        # Outside the handler: Hypothesis tells failures apart by where they were raised and by
        # the exceptions they were raised while handling, and the shrinker's replays of this
        # example, on fresh twins, raise it plainly.
        self._stop_keeping()
        if kept.examples > 1:
            self._confirm(found, events, seed, kept, weights)
        raise found

    def close(self) -> None:
        """Close the kept twins (a campaign calls this at its end, also on failure or Ctrl-C)."""
        if self._kept is not None:
            kept, self._kept = self._kept, None
            kept.close()

    def _stop_keeping(self) -> None:
        self._keep = False
        self.close()

    def _alone(
        self,
        events: Sequence[Batch | Stress | Reset],
        seed: int,
        stats: CampaignStats,
        kept: bool = False,
    ) -> None:
        lockstep = Lockstep(self._factory, backend=self._backend, seed=seed, stats=stats, kept=kept)
        try:
            lockstep.run(events)
        finally:
            lockstep.close()

    def _confirm(
        self,
        found: GraphmodeFailure,
        events: Sequence[Batch | Stress],
        seed: int,
        kept: Lockstep,
        weights: int | None,
    ) -> None:
        """Run the failing example again alone on fresh twins, then (if it passes) after the
        weight update it started from (if any); raise what that tells. When it passes so, run it
        again on fresh twins made with the seed the kept ones were made with (a factory may draw
        weights from it);
        when that passes too, run every example since the kept twins were made again, on fresh
        twins: a failure that repeats there needed the twins' history, one that does not came
        from timing."""
        examples = kept.examples
        updated = [] if weights is None else [Stress(weight_seed=weights)]
        # Alone without the update first: a failure that needs no earlier weights is shrunk.
        alone = self._failure_alone(events, seed)
        if alone is not None:
            alone.stats = self._stats
            raise alone  # outside any handler: raised as a fresh run of the example raises it
        if updated:
            alone = self._failure_alone([*updated, *events], seed)
        if alone is not None:
            note = (
                f"\nthis example started from the weights of update_weights({weights}), called by "
                "an earlier example on the same twins: the snippet above replays that update, "
                "then the example"
            )
            raise self._noted(alone, note, NEEDS_WEIGHTS) from found
        if kept.twin_seed != seed:
            # The kept twins were made with the seed of the first example run on them: a
            # factory's weights may come from that seed, which the example alone does not use.
            made_so = self._failure_alone(
                [Reset(seed), *updated, *events], kept.twin_seed, kept=True
            )
            if made_so is not None:
                note = (
                    f"\nthis failure needed twins made with seed {kept.twin_seed} (what a factory "
                    f"draws from its seed, such as weights): the failing example passes alone on "
                    f"fresh twins made with its own seed {seed}, and fails on fresh twins made as "
                    f"the kept ones were; the snippet above makes those twins and runs the example "
                    "after a Reset"
                )
                raise self._noted(made_so, note, NEEDS_TWIN_SEED) from found
        # Every example run on these twins, made and run again as they were (a failure while
        # they are made counts: something failed all the same).
        if self._failure_alone(kept.replayed(events), kept.twin_seed, kept=True) is not None:
            note = (
                f"\nthis failure needed the twins' history: the failing example passes alone on "
                f"fresh twins, and fails again after the examples before it. It was example "
                f"{examples} run on the same twins; the snippet above replays all {examples} (a "
                "Reset starts each, restoring the twins' state())"
            )
            raise self._noted(found, note, NEEDS_HISTORY) from found
        note = (
            f"\nthis failure did not repeat: the failing example passes alone on fresh twins, and "
            f"so do all {examples} examples run on these twins, replayed on fresh twins. It "
            "depends on timing (the order in which streams and the host ran) or on what freed "
            "memory held, which a replay need not reproduce; the snippet above replays all "
            f"{examples} (a Reset starts each)"
        )
        raise self._noted(found, note, NOT_REPEATED_ON_FRESH_TWINS) from found

    def _noted(self, failed: GraphmodeFailure, note: str, unshrunk: str) -> HistoryFailure:
        """`failed` with `note` added to its message, to be reported unshrunk (`unshrunk` says
        why), with the campaign's statistics."""
        failure = dataclasses.replace(failed.failure, message=failed.failure.message + note)
        return HistoryFailure(GraphmodeFailure(failure, self._stats), unshrunk)

    def _failure_alone(
        self, events: Sequence[Batch | Stress | Reset], seed: int, kept: bool = False
    ) -> GraphmodeFailure | None:
        """What `events` raise on fresh twins (None: they pass); `kept`: twins that take `Reset`
        events between examples."""
        try:
            self._alone(events, seed, CampaignStats(examples=1), kept)
        except GraphmodeFailure as alone:
            return alone
        return None
