"""`run_with_helpers`: a campaign under a time budget fuzzed by several processes at once.

A campaign's examples run one after another on one core, and a time budget ends it however many
cores sat idle meanwhile. Here the campaign runs as it would (in this process, or in its own
child process on cuda) while helper campaigns, each in a child process with a seed of its own,
draw other examples until the same wall-clock deadline. Whichever finds a failure first reports
it: a failure of the campaign itself ends the helpers at once; a helper's failure ends the
campaign and the other helpers at their next example, and the helper shrinks its failure (within
the shrink budget, on a core the others have given back) and reports it with its own seed, so its
replay snippet replays it alone. The statistics are those of every process together, with the
time-to-detection taken on this process's clock.

A helper that runs out of device memory outside a step (making its targets beside the others on
one GPU) stops without failing the campaign: the others go on, and a `RuntimeWarning` says which
helper stopped and why. An out-of-memory error of the campaign itself stays its error, with a note
that helpers shared the device.

Only time-budgeted campaigns take helpers: one asked for a count of examples runs that count,
reproducibly, in one process. A helper starts as an isolated campaign does (`spawn`, torch imported
afresh: about 3 s on a 2-core machine), so it pays off for campaigns of many seconds, and a bug
found in the campaign's first examples is reported as soon as without helpers.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import random
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import TargetFactory
from pytest_graphmode.failure import GraphmodeFailure
from pytest_graphmode.fuzz.campaign_process import check_cpu_threads
from pytest_graphmode.fuzz.isolation import (
    SILENCE_LIMIT_SECONDS,
    CampaignChild,
    CampaignOutOfMemory,
    can_isolate,
    start_child,
)
from pytest_graphmode.fuzz.registry import is_out_of_device_memory


def helper_seed(seed: int | None, helper: int) -> int | None:
    """The seed of helper `helper` (1-based) of a campaign with `seed` (None: random ones)."""
    if seed is None:
        return None
    return random.Random(f"{seed}:helper {helper}").getrandbits(32)


def run_with_helpers(
    campaign: Callable[..., CampaignStats],
    factory: TargetFactory,
    *,
    helpers: int,
    seconds: float | None,
    seed: int | None,
    backend: str = "sim",
    stats: CampaignStats | None = None,
    progress: Callable[[CampaignStats], None] | None = None,
    silence_limit: float = SILENCE_LIMIT_SECONDS,
    **arguments: Any,
) -> CampaignStats:
    """`campaign(factory, seconds=seconds, seed=seed, **arguments)` (`run_campaign` or
    `isolation.run_isolated`, or a partial of either) with `helpers` helper campaigns beside it;
    see the module docstring. `arguments` are `run_campaign`'s (`backend`, `max_examples`, ...),
    passed to the helpers too; `stats` ends holding every process's counts. Raises what the
    first failing process raised (`GraphmodeFailure`, or `TargetError` / `IsolatedCampaignError`
    for a broken runner or harness), with the merged statistics."""
    if isinstance(helpers, bool) or not isinstance(helpers, int) or helpers < 0:
        raise ValueError(f"helpers={helpers!r} must be a number of helper processes >= 0")
    stats = CampaignStats() if stats is None else stats
    arguments["backend"] = backend
    if not helpers:
        return campaign(
            factory, seconds=seconds, seed=seed, stats=stats, progress=progress, **arguments
        )
    if seconds is None or not seconds > 0:
        raise ValueError(
            f"helpers need a time budget (seconds={seconds!r}; a number > 0): a campaign of a "
            "count of examples runs that count in one process"
        )
    # What the campaign would refuse, refused before any helper starts.
    check_cpu_threads(arguments.get("cpu_threads"))
    if not can_isolate(factory):
        raise TypeError(
            f"{factory!r} cannot be sent to a helper process: helpers need a target factory "
            "importable by name (a module-level function, or functools.partial of one)"
        )
    crew = _Helpers(factory, helpers, seconds, seed, arguments, silence_limit)
    own = CampaignStats()

    def report(_: CampaignStats | None = None) -> None:
        if progress is not None:
            with crew.lock:
                progress(crew.merged(own))

    crew.on_news = report
    try:
        campaign(
            factory,
            seconds=seconds,
            seed=seed,
            stats=own,
            progress=report,
            stop=crew.found.is_set,
            **arguments,
        )
    except BaseException as error:
        crew.end(wait=False)
        crew.warn_retired()
        stats.update_from(crew.merged(own))
        if isinstance(error, GraphmodeFailure):
            error.stats = stats
        elif isinstance(error, CampaignOutOfMemory) or is_out_of_device_memory(error):
            shared = f"{helpers} helper campaign{'s' if helpers > 1 else ''}"
            error.add_note(
                f"{shared} shared the device with this campaign; with fewer (--graphmode-workers, "
                "or run_with_helpers(helpers=...)) it may fit"
            )
        raise
    crew.end(wait=True)
    crew.warn_retired()
    ended = crew.first_ended()
    stats.update_from(crew.merged(own))
    if ended is not None:
        if isinstance(ended, GraphmodeFailure):
            ended.stats = stats
        raise ended
    return stats


class _Helpers:
    """The helper processes of one campaign, and a thread that relays what they report."""

    def __init__(
        self,
        factory: TargetFactory,
        count: int,
        seconds: float,
        seed: int | None,
        arguments: dict[str, Any],
        silence_limit: float,
    ) -> None:
        self._factory, self._backend = factory, str(arguments["backend"])
        self._silence_limit = silence_limit
        self.started = time.perf_counter()
        deadline = time.time() + seconds
        self.lock = threading.RLock()
        self.found = threading.Event()  # a helper has found a failure
        self.on_news: Callable[[], None] = lambda: None
        self._found_at: float | None = None
        self._first_failing: int | None = None
        self._seed = seed
        self._children: list[CampaignChild] = []
        self._outcomes: dict[int, tuple[str, Any]] = {}
        for helper in range(1, count + 1):
            self._children.append(
                start_child(
                    factory,
                    dict(arguments, seed=helper_seed(seed, helper), deadline=deadline),
                    False,
                    CampaignStats(),
                    f"graphmode-helper-{helper}",
                )
            )
        self._ending = threading.Event()
        self._relay = threading.Thread(target=self._listen, name="graphmode-helpers", daemon=True)
        self._relay.start()

    def merged(self, own: CampaignStats) -> CampaignStats:
        """`own` (the campaign's counts) and every helper's, as one campaign's: the seconds are
        the wall-clock time since the helpers started, and a helper's first failure is timed on
        that clock too."""
        with self.lock:
            merged = own
            first = self._first_failing
            # The failure reported is the first found: the helper that found it merges first, and
            # another helper's later failure (killed before it could be reported) counts its
            # examples only.
            order = sorted(range(len(self._children)), key=lambda index: index != first)
            for index in order:
                counted = self._children[index].stats
                if index != first:
                    counted = dataclasses.replace(
                        counted,
                        failures=[],
                        first_failure_seconds=None,
                        first_failure_example=None,
                        first_failure_check=None,
                        shrinking=False,
                    )
                merged = merged.merge(counted)
            if own.first_failure_check is None and self._found_at is not None:
                merged.first_failure_seconds = self._found_at - self.started
            merged.seconds = time.perf_counter() - self.started
            return merged

    def first_ended(self) -> BaseException | None:
        """What the first helper that did not pass raised (None: every helper passed)."""
        index = self._first_failing
        if index is None or index not in self._outcomes:
            return None
        child = self._children[index]
        ended = child.ended(
            self._outcomes[index], self._factory, self._backend, self.started, None,
            self._silence_limit,
        )  # fmt: skip
        if isinstance(ended, GraphmodeFailure):
            note = (
                f"\nfound by helper campaign {index + 1} of {len(self._children)} (seed "
                f"{helper_seed(self._seed, index + 1)}), a process fuzzing beside this one (the example count "
                "and seconds above are its own); its replay snippet replays it alone"
            )
            failure = dataclasses.replace(ended.failure, message=ended.failure.message + note)
            with self.lock:
                child.stats.failures[-1:] = [failure]
            # A new exception: its argument, the message pytest shows, must hold the note too.
            ended = GraphmodeFailure(failure, ended.stats)
        return ended

    def end(self, *, wait: bool) -> None:
        """`wait`: let the helpers finish (each ends at the deadline, a failing one once it has
        shrunk its failure), except that once one has found a failure the others are killed.
        Else kill them all now."""
        if wait:
            while self._relay.is_alive():
                if self.found.is_set():
                    self._kill_passing()
                self._relay.join(0.2)
        self._ending.set()
        self._relay.join()
        for child in self._children:
            child.end()

    def warn_retired(self) -> None:
        """A `RuntimeWarning` for each helper that ran out of device memory and stopped; called
        once, after `end`."""
        with self.lock:
            retired = [
                (index, outcome[1])
                for index, outcome in sorted(self._outcomes.items())
                if outcome[0] == "memory"
            ]
        for index, trace in retired:
            last = trace.strip().splitlines()[-1] if trace.strip() else "out of memory"
            warnings.warn(
                f"helper campaign {index + 1} of {len(self._children)} (seed "
                f"{helper_seed(self._seed, index + 1)}) stopped after "
                f"{self._children[index].stats.examples} examples: it ran out of device memory "
                f"outside any step ({last}); the campaign went on without it. Fewer processes "
                "share the device with --graphmode-workers (run_with_helpers(helpers=...))",
                RuntimeWarning,
                stacklevel=3,
            )

    def _kill_passing(self) -> None:
        """Kill every helper still running but the one that found a failure."""
        with self.lock:
            for index, child in enumerate(self._children):
                if index != self._first_failing and index not in self._outcomes:
                    self._outcomes[index] = ("done", None)
                    child.process.kill()

    def _listen(self) -> None:
        """Relay the helpers' messages until each has ended (or `end` is called)."""
        while not self._ending.is_set():
            with self.lock:
                running = [i for i in range(len(self._children)) if i not in self._outcomes]
            if not running:
                return
            receivers = [self._children[i].receiver for i in running]
            multiprocessing.connection.wait(receivers, timeout=0.2)
            for index in running:
                self._drain(index)

    def _drain(self, index: int) -> None:
        """Take every message helper `index` has sent (and see whether it died)."""
        child = self._children[index]
        news = False
        while True:
            with self.lock:
                if index in self._outcomes:  # killed meanwhile
                    break
                pending = child.receiver.poll(0)
                outcome = child.receive(0, None, self._silence_limit)
                if outcome is not None:
                    self._outcomes[index] = outcome
                # A helper out of device memory stops; the campaign and the others go on.
                if (outcome is not None and outcome[0] not in ("done", "memory")) or (
                    child.stats.first_failure_check is not None
                ):
                    self._note_failure(index)
            news = news or pending
            if not pending:
                break
        if news:
            self.on_news()

    def _note_failure(self, index: int) -> None:
        if self._first_failing is None:
            self._first_failing = index
            self._found_at = time.perf_counter()
        self.found.set()
