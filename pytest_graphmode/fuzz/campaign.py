"""`run_campaign`: Hypothesis draws schedules, the lockstep driver checks them, shrinking finds
the smallest failing one.

Why `@given` over drawn schedules rather than a `RuleBasedStateMachine`: a schedule here is a pure
value (a list of step plans) that a deterministic scheduler compiles into legal batches, and any
sub-list compiles to legal batches too. Hypothesis therefore shrinks it by deleting and
simplifying steps with no preconditions to re-check, the shrunk schedule *is* the replay snippet,
and a failing example re-runs through exactly the code path `replay` uses.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import hypothesis
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import Batch, TargetFactory, TargetSpec
from pytest_graphmode.failure import MADE_TWINS, Failure, GraphmodeFailure
from pytest_graphmode.fuzz.campaign_process import (
    DEFAULT_CPU_THREADS,
    check_cpu_threads,
    long_lived_objects_frozen,
    torch_cpu_threads,
)
from pytest_graphmode.fuzz.checks import sim_refusal
from pytest_graphmode.fuzz.escaped import HarnessError
from pytest_graphmode.fuzz.hypothesis_scope import hypothesis_scope
from pytest_graphmode.fuzz.kept_twins import IN_CONSTRUCTION, HistoryFailure, KeptTwins
from pytest_graphmode.fuzz.registry import (
    NO_DEVICE_FAULT,
    is_device_fault,
    is_out_of_device_memory,
)
from pytest_graphmode.settings import hypothesis_settings, resolve_backend
from pytest_graphmode.strategies.leading import LEADING_EXAMPLES, ON_FRESH_TWINS
from pytest_graphmode.strategies.plans import StepPlan, Stress
from pytest_graphmode.strategies.scheduler import compile_schedule
from pytest_graphmode.strategies.schedules import schedules


def target_spec(factory: TargetFactory, backend: str) -> TargetSpec:
    """The spec of the factory's targets (one eager target is made and closed to read it)."""
    from pytest_graphmode.runtime import backends

    # Made as a campaign makes its twins: with the backend active (on sim, device tensors exist
    # only while it is).
    with backends.target_scope(backend):
        try:
            probe = factory("eager", seed=0, backend=backend)
        except Exception as error:
            if is_device_fault(error) or is_out_of_device_memory(error):
                raise  # the device's doing, not the runner's: reported as such
            raise RuntimeError(
                f"{sim_refusal(_exception_text(error))}"
                f"the factory raised making an eager target (mode='eager', seed=0, "
                f"backend={backend!r}), whose spec a campaign draws its schedules from: a runner "
                f"that cannot run eagerly cannot be compared with its eager twin"
            ) from error
        try:
            return probe.spec
        finally:
            probe.close()


def _exception_text(error: BaseException) -> str:
    """The exception as a traceback ends with it ("AttributeError: ..."), for `sim_refusal`."""
    return "".join(traceback.format_exception_only(error)).strip()


def campaign_spec(
    factory: TargetFactory, backend: str, features: frozenset[str] | None
) -> TargetSpec:
    """The spec a campaign's schedules draw from: the target's, its features restricted to
    `features` (None: all of them); asking for a feature the target lacks is a ValueError."""
    spec = target_spec(factory, backend)
    if features is None:
        return spec
    missing = set(features) - spec.features
    if missing:
        raise ValueError(
            f"the target does not support features {sorted(missing)}; it offers "
            f"{sorted(spec.features)}"
        )
    return dataclasses.replace(spec, features=frozenset(features))


def run_campaign(
    factory: TargetFactory,
    *,
    backend: str = "sim",
    max_examples: int = 50,
    max_steps: int = 12,
    seed: int | None = None,
    features: frozenset[str] | None = None,
    progress: Callable[[CampaignStats], None] | None = None,
    settings: hypothesis.settings | None = None,
    stats: CampaignStats | None = None,
    shrink_seconds: float | None = None,
    on_example: Callable[[int, Sequence[Batch | Stress]], None] | None = None,
    pipelined: bool = True,
    seconds: float | None = None,
    cpu_threads: int | None = DEFAULT_CPU_THREADS,
    stop: Callable[[], bool] | None = None,
    leading: bool = True,
) -> CampaignStats:
    """Fuzz `factory`'s targets; return the statistics, or raise `GraphmodeFailure` (carrying
    them as `.stats`) for the first failure, shrunk to its smallest schedule.

    `features` restricts what the schedules use to a subset of the target's features. `settings`,
    when given, replaces the default Hypothesis settings entirely (`max_examples` is then
    ignored). `seed` makes the campaign reproducible. `stats`, when given, is counted into as the
    campaign runs, so a caller still holds every count when something else ends the campaign
    (Ctrl-C: `KeyboardInterrupt` passes through unchanged). `progress` is called after every
    example, once as soon as the first failure is found, and at least once a second while it is
    shrunk. `shrink_seconds` bounds the shrinking (None: Hypothesis shrinks until done; 0: the
    failure is reported as found). `on_example(seed, events)` is called before each example runs.
    `pipelined=False` leaves pipelined pairs out of the schedules (docs/contract.md): every step
    then runs in lockstep, each read before the next is sent; else the campaign's first twelve
    examples are fixed schedules, counted among its examples: the simplest pipelined pairs, an eager
    prefill then a replay and two replays (`first_pair`), then a graph replay paired with an eager
    prefill, a weight update before replays, the longest context and a speculative step
    (`first_phase_change`), then a graph captured with a padding row replaying a full batch and a
    padded one twice, the second continuing the first (`first_partial_bucket`), then a request
    leaving the first row while a later one goes on to start a new block and sample
    (`first_front_departure`), then a batch shrinking within its graph as its queries grow, its
    padding rows following a larger batch's (`first_stale_tail`),
    then three requests alone on one graph in turn, each with other sampling values and adapter, a
    new request listed before a continuing one, and short then long queries on one padded size
    (`first_handover`), then a decode beside a prefill three times, each delayed on cuda with one
    other stream held back alone (`first_stream_sweep`), then a speculative step with the request
    count of a graph and more tokens than the largest, and one whose rows propose different draft
    counts, listed in another order (`first_tokens_past_the_largest_graph`), then,
    on fresh twins, a graph first captured for two long contexts replaying a batch with a short row
    (`first_capture_on_long_contexts`), then decode steps on a graph delayed as the stream sweep's,
    with a request back from sitting out a step and then with more requests than the largest graph
    (`first_graph_stream_sweep`), then a preempted request coming back beside one that took its
    blocks, and decoding on a graph (`first_return_after_preemption`), then a sampled request
    back from sitting out padded replays (`first_return_after_padded_steps`).
    `leading=False` leaves those fixed schedules out: every example is drawn, which shows what the
    drawn schedules reach on their own (they are left out too where `settings` has no explicit
    phase).
    `seconds` is a time budget: once that many seconds have passed since the
    campaign started, no new example starts and the campaign ends as passed (a failure found before
    is shrunk as always, within `shrink_seconds`); `max_examples` still caps the count.
    `cpu_threads`: torch's intra-op CPU threads while the campaign runs (None: as they are;
    `campaign_process.torch_cpu_threads` says why 1). `stop`, asked before each example while
    nothing has failed, ends the campaign as passed when true (another process found a failure:
    `helpers.run_with_helpers`). The device running out of memory outside a step (the twins made,
    a state restored) before anything failed ends the campaign with torch's `OutOfMemoryError` as
    raised: no check failed, nothing is shrunk.
    """
    if seconds is not None and not seconds > 0:
        raise ValueError(f"seconds={seconds!r} must be a number of seconds > 0, or None")
    check_cpu_threads(cpu_threads)
    spec = campaign_spec(factory, backend, features)
    stats = CampaignStats() if stats is None else stats
    started = time.perf_counter()
    chosen = settings or hypothesis_settings(max_examples)
    # Under a time budget the example count is only a cap: "N of M" would say nothing.
    stats.planned_examples = 0 if seconds is not None else chosen.max_examples
    stats.time_budget_seconds = seconds
    fixed, leading_names, fresh_at = (
        _leading_schedules(spec)
        if pipelined and leading and hypothesis.Phase.explicit in chosen.phases
        else ([], [], None)
    )
    fixed = fixed[: chosen.max_examples]
    stats.shrink_budget_seconds = shrink_seconds
    budget = ShrinkBudget(stats, started, shrink_seconds, progress)
    twins = KeptTwins(factory, backend=backend, stats=stats)

    def example(plans: list[StepPlan], example_seed: int) -> None:
        budget.stop_if_spent(seconds)
        if stop is not None and not budget.found and stop():
            raise CampaignStopped
        heap.catch_up()
        events = compile_schedule(spec, plans, seed=example_seed)
        # explicit examples run first
        budget.leading = leading_names[stats.examples] if stats.examples < len(fixed) else None
        fresh = budget.leading is not None and stats.examples == fresh_at
        stats.examples += 1
        if budget.found:
            stats.shrink_examples += 1
        if on_example is not None:
            on_example(example_seed, events)
        try:
            twins.run(events, example_seed, fresh=fresh)
        except HistoryFailure as escaped:
            unshrunk = escaped.unshrunk
            if budget.leading is not None and unshrunk != IN_CONSTRUCTION:
                unshrunk += f"; and it is one of the campaign's {LEADING_NEVER_SHRUNK}"
            budget.failed(escaped.failed, unshrunk=unshrunk)
            raise
        except HarnessError as error:
            raise NotAFinding(error) from None
        except Exception as failed:
            if is_out_of_device_memory(failed) and not budget.found:
                # Outside a step (a step's errors are its outcome): the device had no room for
                # the twins or the harness's copies. No finding to shrink: the campaign ends.
                raise NotAFinding(failed) from failed
            budget.failed(failed, unshrunk=LEADING if budget.leading is not None else None)
            raise
        finally:
            budget.report()

    def hypothesis_run(run: int, examples: int) -> Callable[[], None]:
        """The `run`-th Hypothesis run of the campaign, drawing `examples` examples."""
        drawn = hypothesis.given(
            plans=schedules(spec, max_steps, pipelined=pipelined),
            example_seed=st.integers(0, 2**31 - 1),
        )(example)
        run_settings = hypothesis.settings(chosen, max_examples=examples)
        if fixed and run == 0:
            run_settings = _after_leading_examples(run_settings, len(fixed))
            seeds = random.Random(seed)  # seed None: random ones
            # Hypothesis runs the explicit example applied last first.
            for plans, example_seed in reversed([(p, seeds.randrange(2**31)) for p in fixed]):
                drawn = hypothesis.example(plans=plans, example_seed=example_seed)(drawn)
        test = run_settings(drawn)
        return seeded(test, seed, run)

    try:
        with (
            hypothesis_scope(),
            budget.ticking(),
            long_lived_objects_frozen(resolve_backend(backend)) as heap,
            torch_cpu_threads(cpu_threads),
        ):
            run_in_rounds(hypothesis_run, budget, seconds, chosen.max_examples)
    except (GraphmodeFailure, HistoryFailure) as caught:
        failed = caught.failed if isinstance(caught, HistoryFailure) else caught
        failure = budget.annotated(failed.failure)
        stats.failures.append(failure)
        raise GraphmodeFailure(failure, stats) from None
    except NotAFinding as ended:
        error = ended.error
        if isinstance(error, HarnessError):
            stats.harness_error = str(error).splitlines()[0]
        error.__suppress_context__ = True  # the carrier is no part of its story; its cause is
        raise error  # noqa: B904
    finally:
        twins.close()
        budget.finish()
        stats.seconds += time.perf_counter() - started
    return stats


ROUND_EXAMPLES = 50
"""Examples per Hypothesis run of a campaign with a time budget. Hypothesis draws the first tenth
of a run's examples (at most 50) as small as it can, so one run sized for the cap would spend its
first 50 examples on one-step schedules; runs of the ci profile's size draw as a ci campaign does."""


def run_in_rounds(
    hypothesis_run: Callable[[int, int], Callable[[], None]],
    budget: ShrinkBudget,
    seconds: float | None,
    max_examples: int,
) -> None:
    """Run a campaign's Hypothesis runs; `hypothesis_run(run, examples)` makes the `run`-th, of
    `examples` examples, whose test calls `budget.stop_if_spent(seconds)` first. Without a time
    budget, one run of `max_examples`; with one, runs of `ROUND_EXAMPLES` until the budget is
    spent, `max_examples` have run, or a run drew nothing. Raises the smallest failure found once
    shrinking has had its time."""
    stats = budget.stats
    run = 0
    try:
        while not out_of_time(stats, budget.started, seconds):
            left = max_examples - stats.examples
            before = stats.examples
            hypothesis_run(run, left if seconds is None else min(left, ROUND_EXAMPLES))()
            run += 1
            if seconds is None or stats.examples in (before, max_examples):
                return
        stats.stopped_by_time_budget = True
    except ShrinkBudgetSpent:
        raise budget.smallest_failure() from None
    except Flaky:
        if not budget.found:
            raise
        # The failing example passed when Hypothesis ran it again (to shrink it, or to replay
        # it at the end): the failure found stands, unshrunk, rather than Hypothesis's complaint.
        budget.not_repeated()
        raise budget.smallest_failure() from None
    except (TimeBudgetSpent, CampaignStopped):
        pass  # every example run passed: the campaign passed


def seeded(test: Callable[[], None], seed: int | None, run: int) -> Callable[[], None]:
    """`test`, the `run`-th Hypothesis run of a campaign with `seed`, seeded: the first with the
    campaign's seed, so that a campaign without a time budget is unchanged, the next with seeds
    derived from it (None: Hypothesis's own random seed)."""
    if seed is None:
        return test
    run_seed = seed if run == 0 else random.Random(f"{seed}:{run}").getrandbits(64)
    return hypothesis.seed(run_seed)(test)


def _leading_schedules(
    spec: TargetSpec,
) -> tuple[list[list[StepPlan]], list[str], int | None]:
    """The fixed schedules a campaign runs first, in order, an empty one left out; their names
    (the functions of `strategies.leading` that make them); and the index among them of the one
    that starts on fresh twins (None where that one is empty)."""
    made = [(make, plans) for make in LEADING_EXAMPLES if (plans := make(spec))]
    fresh = next((i for i, (make, _) in enumerate(made) if make is ON_FRESH_TWINS), None)
    return [plans for _, plans in made], [make.__name__ for make, _ in made], fresh


def _after_leading_examples(chosen: hypothesis.settings, leading: int) -> hypothesis.settings:
    """`chosen` for the examples Hypothesis draws after the `leading` ones, which run as explicit
    examples: that many fewer, so the campaign runs `max_examples` in all; none drawn when the
    leading ones are all (Hypothesis wants at least one, or no generate phase)."""
    if chosen.max_examples > leading:
        return hypothesis.settings(chosen, max_examples=chosen.max_examples - leading)
    drawn = (hypothesis.Phase.generate, hypothesis.Phase.target)
    return hypothesis.settings(chosen, phases=[p for p in chosen.phases if p not in drawn])


_LEADING_EXAMPLES = "leading examples, fixed schedules it runs before any drawn one"
_NAMED = (
    "(the name above is the function of `strategies.schedules` that makes it, whose docstring "
    "says what it holds)"
)
LEADING_NEVER_SHRUNK = f"{_LEADING_EXAMPLES} and never shrinks {_NAMED}"
LEADING = (
    f"shrinking skipped: this is one of the campaign's {_LEADING_EXAMPLES} {_NAMED}, and its "
    "replay ends at the failing step"
)

NOT_REPEATED = (
    "shrinking stopped: the failing example passed when it ran again (a failure that depends on "
    "timing, such as a race on the GPU or a read of freed memory), so this is the smallest "
    "failing schedule seen; its snippet may need several runs to fail"
)


def out_of_time(stats: CampaignStats, started: float, seconds: float | None) -> bool:
    """Whether the time budget is spent; never before the first example has run."""
    if seconds is None or stats.examples == 0:
        return False
    return time.perf_counter() - started >= seconds


class TimeBudgetSpent(BaseException):
    """Ends Hypothesis's run once the time budget is spent and nothing failed, as
    `ShrinkBudgetSpent` ends it once shrinking has had its time."""


class NotAFinding(BaseException):
    """Ends Hypothesis's run with `error`, no finding about the runner and nothing to shrink (a
    `BaseException`: Hypothesis shrinks every `Exception` as a finding): the device out of memory
    outside a step (the twins made, a state restored) before anything failed, or a `HarnessError`.
    `run_campaign` raises `error` itself."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class CampaignStopped(BaseException):
    """Ends Hypothesis's run when the campaign's `stop()` says so and nothing failed."""


class ShrinkBudgetSpent(BaseException):
    """Ends Hypothesis's run from inside the test function: a `BaseException`, which Hypothesis
    neither records as a failure nor shrinks, but lets through (as it does Ctrl-C)."""


class ShrinkBudget:
    """The first failure's bookkeeping, and the time limit of shrinking it.

    Hypothesis has no time limit on shrinking. Once the budget is spent, the next call of the test
    function ends Hypothesis's run (`ShrinkBudgetSpent`), and the campaign reports the last
    failure seen: the shrinker runs only inputs smaller than its current smallest failing one, so
    the last failure is the smallest found. Ending the run, rather than letting the remaining
    candidates pass, also skips drawing them: drawing a schedule costs a good part of an example.
    """

    def __init__(
        self,
        stats: CampaignStats,
        started: float,
        limit: float | None,
        progress: Callable[[CampaignStats], None] | None,
    ) -> None:
        self._stats, self._started, self._limit, self._progress = stats, started, limit, progress
        self._found_at: float | None = None
        self._last_failure: Exception | None = None
        # The name of the campaign's leading example running (None: a drawn one). Hypothesis
        # runs them as explicit examples: a failure there is reported as found, never shrunk.
        self.leading: str | None = None
        self._found_step: int | None = None  # the step of that example it failed at, as found
        self._unshrunk: str | None = None  # why the first failure is not shrunk, if it is not
        self._lock = threading.Lock()  # progress runs on the ticker thread too

    @property
    def stats(self) -> CampaignStats:
        return self._stats

    @property
    def started(self) -> float:
        return self._started

    def stop_if_spent(self, seconds: float | None) -> None:
        """Called before each example: ends Hypothesis's run once shrinking has had its time, or
        once the campaign's time budget `seconds` is spent with nothing found."""
        if self.spent():
            raise ShrinkBudgetSpent
        if out_of_time(self._stats, self._started, seconds) and not self.found:
            self._stats.stopped_by_time_budget = True
            raise TimeBudgetSpent

    def failed(self, error: Exception, unshrunk: str | None = None) -> None:
        self._last_failure = error
        if self._found_at is not None:
            return
        self._found_at = time.perf_counter()
        self._unshrunk = unshrunk
        self._stats.first_failure_leading = self.leading
        # the step of the example as found; the failure's own step is the shrunk schedule's
        found_step = error.failure.step if isinstance(error, GraphmodeFailure) else None
        self._found_step = None if found_step == MADE_TWINS else found_step
        stats = self._stats
        stats.first_failure_seconds = self._found_at - self._started
        stats.first_failure_example = stats.examples
        if isinstance(error, GraphmodeFailure):
            stats.first_failure_check = error.failure.check
        elif is_device_fault(error):  # named as the parent of an isolated campaign names it
            stats.first_failure_check = NO_DEVICE_FAULT
        else:
            stats.first_failure_check = type(error).__name__
        stats.shrinking = unshrunk is None  # a failure it never shrinks is reported as found
        self.report()

    @property
    def found(self) -> bool:
        """Whether a failure has been found."""
        return self._found_at is not None

    def spent(self) -> bool:
        if self._found_at is None or self._limit is None:
            return False
        if time.perf_counter() - self._found_at < self._limit:
            return False
        self._stats.shrink_stopped_by_budget = True
        return True

    def not_repeated(self) -> None:
        """Say in the report that shrinking stopped because the failure did not repeat."""
        if self._unshrunk is None:
            self._unshrunk = NOT_REPEATED

    def smallest_failure(self) -> Exception:
        assert self._last_failure is not None  # the budget runs only once something failed
        return self._last_failure

    def report(self) -> None:
        with self._lock:
            if self._found_at is not None and self._stats.shrinking:
                self._stats.shrink_seconds = time.perf_counter() - self._found_at
            if self._progress is not None:
                self._progress(self._stats)

    @contextmanager
    def ticking(self) -> Iterator[None]:
        """Report progress every second while shrinking, also during a long example."""
        done = threading.Event()

        def tick() -> None:
            while not done.wait(1.0):
                if self._stats.shrinking:
                    self.report()

        ticker = threading.Thread(target=tick, name="graphmode-shrink-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()

    def finish(self) -> None:
        with self._lock:
            if self._stats.shrinking and self._found_at is not None:
                self._stats.shrink_seconds = time.perf_counter() - self._found_at
                self._stats.shrinking = False

    def annotated(self, failure: Failure) -> Failure:
        """`failure` with a line saying how its schedule was shrunk."""
        self.finish()
        stats = self._stats
        took = f"{stats.shrink_seconds:.1f} s"
        if self._unshrunk is not None:
            line = self._unshrunk
        elif stats.shrink_stopped_by_budget:
            line = (
                f"shrinking stopped at its budget of {self._limit:g} s after {took}: the schedule "
                "is the smallest found by then (--graphmode-shrink-seconds gives more time)"
            )
        else:
            line = f"shrinking finished in {took}"
        leading = stats.first_failure_leading
        which = "" if leading is None else f" (the leading example {leading})"
        at = "" if self._found_step is None else f", at its step {self._found_step}"
        if at and self._unshrunk in (None, NOT_REPEATED):  # shrinking ran, if only in part
            at += " (the steps above are the shrunk schedule's)"
        found = (
            f"first failing example: {stats.first_failure_example}{which}{at}, found after "
            f"{stats.first_failure_seconds or 0.0:.1f} s"
        )
        return dataclasses.replace(failure, message=f"{failure.message}\n{found}; {line}")
