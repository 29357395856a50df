"""Data-parallel campaigns: N rank processes joined by torch.distributed, fuzzed in lockstep.

The parent process runs Hypothesis: it draws a `RankStep` schedule, compiles one event list per
rank and hands each rank process its list. Every rank process (started with the `spawn` method,
one per rank, gloo on sim, NCCL with one GPU each on cuda) runs its twins through
`RankLockstep` and answers with its statistics and the finding every rank agreed on.

No collective may hang a run. The process group's timeout ends a stuck collective in the rank
processes eventually, and before that the parent's watchdog notices that no rank made progress
(arrived at a step, entered or left a collective) for `timeout` seconds: it reads which step each
rank reached and which ranks wait in a collective, kills every rank process and fails the
campaign with `ranks_arrive`, naming the step and the ranks that did not arrive. Such a failure is
not shrunk (every shrinking attempt would cost the timeout again); its replay snippet re-runs the
schedule that hung.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import hypothesis
from hypothesis import strategies as st

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import TargetFactory
from pytest_graphmode.failure import Failure, GraphmodeFailure
from pytest_graphmode.fuzz.campaign import (
    ShrinkBudget,
    campaign_spec,
    run_in_rounds,
    seeded,
)
from pytest_graphmode.fuzz.campaign_process import DEFAULT_CPU_THREADS, check_cpu_threads
from pytest_graphmode.fuzz.hypothesis_scope import hypothesis_scope
from pytest_graphmode.fuzz.rank_checks import RANKS_ARRIVE
from pytest_graphmode.fuzz.rank_group import COLLECTIVES, STATUS_FIELDS, RankGroup
from pytest_graphmode.fuzz.rank_lockstep import Finding
from pytest_graphmode.fuzz.snippet import replay_ranks_snippet
from pytest_graphmode.settings import hypothesis_settings
from pytest_graphmode.strategies.rank_schedules import (
    RankEvent,
    RankFault,
    RankStep,
    compile_rank_schedule,
    rank_schedules,
)

RankEvents = list[RankEvent | RankFault]
PEER_DEATH_WAIT = 2.0  # seconds a rank's error waits for another rank's death to show
DEFAULT_TIMEOUT = 120.0  # seconds without progress of any rank before the run counts as hung
_STARTUP_SECONDS = 600.0  # importing torch and joining the group, on a loaded machine


class RankAbort(BaseException):
    """The rank processes are gone (a hang, or a rank died): the campaign ends at once.

    A BaseException, so Hypothesis does not treat it as an ordinary failure and shrink it."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class RankPool:
    """`ranks` processes, each holding one rank of the group; `run` runs one example on all."""

    def __init__(
        self,
        factory: TargetFactory,
        *,
        backend: str,
        ranks: int,
        timeout: float,
        cpu_threads: int | None = None,
    ) -> None:
        """`cpu_threads`: torch's intra-op CPU threads in each rank process (None: torch's
        default there; `campaign_process.torch_cpu_threads` says why a campaign asks for 1)."""
        check_cpu_threads(cpu_threads)
        if ranks < 2:
            raise ValueError(f"ranks={ranks}: a data-parallel run needs at least 2 ranks")
        self.ranks, self.timeout, self.backend = ranks, timeout, backend
        self._factory = factory
        context = multiprocessing.get_context("spawn")
        self._status: Any = context.Array("q", STATUS_FIELDS * ranks, lock=False)
        self._dir = tempfile.mkdtemp(prefix="graphmode-ranks-")
        rendezvous = f"file://{os.path.join(self._dir, 'rendezvous')}"
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(ranks):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_rank_main,
                args=(
                    rank,
                    ranks,
                    backend,
                    factory,
                    rendezvous,
                    theirs,
                    self._status,
                    timeout,
                    cpu_threads,
                ),
                name=f"graphmode-rank-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(process)
        self._collect(lambda rank, reply: None, _STARTUP_SECONDS, seed=None, events=None)

    def run(self, seed: int, events: Sequence[RankEvents]) -> list[tuple[CampaignStats, Finding]]:
        """Run one example; every rank's statistics and finding (None: all checks passed)."""
        for conn, mine in zip(self._conns, events, strict=True):
            conn.send(("run", seed, mine))
        replies: list[Any] = [None] * self.ranks
        self._collect(replies.__setitem__, self.timeout, seed=seed, events=events)
        return replies

    def close(self) -> None:
        """Stop every rank process (asked first, killed where it does not stop)."""
        for conn, process in zip(self._conns, self._procs, strict=True):
            if process.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(("close",))
        deadline = time.monotonic() + 10
        for process in self._procs:
            process.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _kill(self) -> None:
        for process in self._procs:
            if process.is_alive():
                process.kill()
        for process in self._procs:
            process.join(10)

    def _collect(
        self,
        store: Callable[[int, Any], None],
        timeout: float,
        *,
        seed: int | None,
        events: Sequence[RankEvents] | None,
    ) -> None:
        """Wait for one reply from every rank; a hang or a dead rank raises `RankAbort`."""
        pending = set(range(self.ranks))
        seen, last_progress = list(self._status), time.monotonic()
        while pending:
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn.poll(0.02):
                    try:
                        kind, *payload = conn.recv()
                    except EOFError:  # the process died before it could answer
                        self._procs[rank].join(5)
                        self._abort(_exited(rank, self._procs[rank].exitcode), seed, events)
                    if kind == "error":
                        self._abort_on_error(rank, payload[0], seed, events)
                    store(rank, payload[0] if len(payload) == 1 else tuple(payload))
                    pending.discard(rank)
                elif not self._procs[rank].is_alive():
                    self._abort(_exited(rank, self._procs[rank].exitcode), seed, events)
            now = time.monotonic()
            if list(self._status) != seen:
                seen, last_progress = list(self._status), now
            elif now - last_progress > timeout:
                self._abort(f"no rank made progress for {timeout:g} s", seed, events)

    def _abort_on_error(
        self, rank: int, text: str, seed: int | None, events: Sequence[RankEvents] | None
    ) -> None:
        """`rank` raised outside the target's steps. Where another rank's process died, that
        is the cause: a collective with a dead peer raises in the survivors ("connection closed
        by peer"), often before the parent sees the death, so the death is waited for a moment
        and reported (`ranks_arrive`) before the survivor's error is taken for the harness's."""
        deadline = time.monotonic() + PEER_DEATH_WAIT
        while True:
            dead = [r for r, p in enumerate(self._procs) if r != rank and not p.is_alive()]
            if dead:
                self._abort(_exited(dead[0], self._procs[dead[0]].exitcode), seed, events)
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        self._kill()
        raise RuntimeError(f"rank {rank} failed outside the target's steps:\n{text}")

    def _abort(self, what: str, seed: int | None, events: Sequence[RankEvents] | None) -> None:
        status = [
            self._status[i : i + STATUS_FIELDS] for i in range(0, len(self._status), STATUS_FIELDS)
        ]
        self._kill()
        step = max(s[0] for s in status)
        waits = Counter(s[2] for s in status if s[2])
        # The collective most ranks wait in (ties: the earlier kind); the other ranks never came.
        awaited = max(waits, key=lambda w: (waits[w], -w), default=0)
        waiting = [r for r, s in enumerate(status) if awaited and s[2] == awaited]
        missing = [r for r in range(self.ranks) if r not in waiting]
        most = max(s[1] for s in status)
        if not waiting and any(s[1] < most for s in status):
            # Asynchronous collectives (NCCL) return at once: a rank that came blocks later, on
            # the device, outside any collective call. The ranks that entered fewer collectives
            # than the others are the ones that did not arrive at the last one the others entered.
            waiting = [r for r, s in enumerate(status) if s[1] == most]
            missing = [r for r, s in enumerate(status) if s[1] < most]
            awaited = status[waiting[0]][3]
        name = COLLECTIVES[awaited] or "any collective"
        if missing:
            arrival = f"ranks {missing} did not arrive at {name}" + (
                f", which ranks {waiting} entered" if waiting else ""
            )
        else:
            # Every rank entered and none left: the calls differ (in size, kind or order), which
            # gloo answers by ending a process and NCCL by hanging.
            arrival = f"every rank entered {name} and it never completed: the ranks' calls differ"
        lines = [
            f"graphmode check {RANKS_ARRIVE!r} failed at step {step} (seed {seed}): {what}",
            arrival,
            *(
                f"  rank {r}: reached step {s[0]}, entered {s[1]} collectives, "
                + (f"waiting in {COLLECTIVES[s[2]]}" if s[2] else "not in a collective")
                for r, s in enumerate(status)
            ),
            "every rank process was killed",
        ]
        if events is None:
            lines[0] = f"graphmode ranks failed to start: {what}"
            snippet = ""
        else:
            snippet = replay_ranks_snippet(
                events, factory=self._factory, backend=self.backend, seed=seed or 0
            )
            lines += ["replay the schedule with:", snippet]
        raise RankAbort(Failure(RANKS_ARRIVE, step, "\n".join(lines), seed, snippet))


def _exited(rank: int, code: int | None) -> str:
    """How a rank process ended: its exit code, and the signal that ended it where one did."""
    text = f"rank {rank}'s process ended with exit code {code}"
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            text += f" ({signal.Signals(-code).name})"
    return text


def _rank_main(
    rank: int,
    world: int,
    backend: str,
    factory: TargetFactory,
    rendezvous: str,
    conn: Connection,
    status: Any,
    timeout: float,
    cpu_threads: int | None,
) -> None:
    """A rank process: join the group, then run examples until asked to close."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on every machine
    if cpu_threads is not None:  # for the process's life: it serves this campaign only
        import torch

        torch.set_num_threads(cpu_threads)
    try:
        group = RankGroup.join(
            rank, world, backend, rendezvous, status, timedelta(seconds=2 * timeout + 60)
        )
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    try:
        while True:
            message = conn.recv()
            if message[0] == "close":
                break
            _, seed, events = message
            conn.send(("done", *group.run_example(factory, seed, events)))
    except EOFError:
        pass  # the parent is gone
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        group.leave()


def _fold(
    stats: CampaignStats,
    replies: Sequence[tuple[CampaignStats, Finding | None]],
    *,
    factory: TargetFactory,
    backend: str,
    seed: int,
    events: Sequence[RankEvents],
) -> CampaignStats:
    """Merge every rank's statistics into `stats`; raise `GraphmodeFailure` for a finding.

    Every rank answered, so every rank arrived at every collective of the steps it counted:
    `ranks_arrive` passed on each of them (a rank that did not arrive aborts the run instead)."""
    for rank_stats, _ in replies:
        rank_stats.checks_run[RANKS_ARRIVE] += rank_stats.steps
        merged = stats.merge(dataclasses.replace(rank_stats, examples=0))
        for field in dataclasses.fields(stats):
            setattr(stats, field.name, getattr(merged, field.name))
    finding = next((found for _, found in replies if found is not None), None)
    if finding is None:
        return stats
    snippet = replay_ranks_snippet(events, factory=factory, backend=backend, seed=seed)
    where = "every rank" if finding.rank is None else f"rank {finding.rank}"
    message = "\n".join(
        [
            f"graphmode check {finding.check!r} failed at step {finding.step} on {where} of "
            f"{len(events)} (seed {seed})",
            finding.text,
            "replay the minimal schedule with:",
            snippet,
        ]
    )
    raise GraphmodeFailure(Failure(finding.check, finding.step, message, seed, snippet), stats)


def replay_ranks(
    events: Sequence[RankEvents],
    *,
    factory: TargetFactory,
    backend: str = "sim",
    seed: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
) -> CampaignStats:
    """Run every rank's `events` (one list per rank) in rank processes with every check; raise
    `GraphmodeFailure` like a campaign."""
    stats = CampaignStats(examples=1)
    started = time.perf_counter()
    pool = RankPool(factory, backend=backend, ranks=len(events), timeout=timeout)
    try:
        replies = pool.run(seed, events)
        return _fold(stats, replies, factory=factory, backend=backend, seed=seed, events=events)
    except RankAbort as aborted:
        raise GraphmodeFailure(aborted.failure, stats) from None
    finally:
        pool.close()
        stats.seconds = time.perf_counter() - started


def run_rank_campaign(
    factory: TargetFactory,
    *,
    ranks: int,
    backend: str = "sim",
    max_examples: int = 50,
    max_steps: int = 12,
    seed: int | None = None,
    features: frozenset[str] | None = None,
    progress: Callable[[CampaignStats], None] | None = None,
    settings: hypothesis.settings | None = None,
    stats: CampaignStats | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    seconds: float | None = None,
    shrink_seconds: float | None = None,
    cpu_threads: int | None = DEFAULT_CPU_THREADS,
    leading: bool = True,
) -> CampaignStats:
    """`run_campaign` over `ranks` data-parallel ranks: every check of one rank on every rank,
    plus the checks of `registry.RANK_CHECKS`: `ranks_agree` (every rank runs the same graph at
    every step) and `ranks_arrive` (no collective hangs for `timeout` seconds). Statistics count
    the steps of every rank; `stats`, when given, is counted into as in `run_campaign`, and so are
    the time budget `seconds`, the limit on shrinking `shrink_seconds` (a shrink step of a
    hanging rank costs `timeout`) and torch's CPU threads `cpu_threads`, here in every rank.
    Every example of a rank campaign is drawn: it has no leading examples for `leading=False` to
    leave out (the argument is taken so that one set of options serves both kinds of campaign)."""
    del leading  # nothing to leave out: see the docstring
    spec = campaign_spec(factory, backend, features)
    stats = CampaignStats() if stats is None else stats
    stats.time_budget_seconds = seconds
    stats.shrink_budget_seconds = shrink_seconds
    started = time.perf_counter()
    budget = ShrinkBudget(stats, started, shrink_seconds, progress)
    pool = RankPool(factory, backend=backend, ranks=ranks, timeout=timeout, cpu_threads=cpu_threads)

    @hypothesis.given(
        steps=rank_schedules(spec, ranks, max_steps), example_seed=st.integers(0, 2**31 - 1)
    )
    def example(steps: list[RankStep], example_seed: int) -> None:
        budget.stop_if_spent(seconds)
        events = compile_rank_schedule(spec, steps, seed=example_seed)
        stats.examples += 1
        try:
            replies = pool.run(example_seed, events)
            _fold(
                stats, replies, factory=factory, backend=backend, seed=example_seed, events=events
            )
        except GraphmodeFailure as failed:
            budget.failed(failed)
            raise
        except RankAbort as aborted:
            budget.failed(GraphmodeFailure(aborted.failure, stats))
            raise
        finally:
            budget.report()

    chosen = settings or hypothesis_settings(max_examples)

    def hypothesis_run(run: int, examples: int) -> Callable[[], None]:
        return seeded(hypothesis.settings(chosen, max_examples=examples)(example), seed, run)

    try:
        with hypothesis_scope(), budget.ticking():
            run_in_rounds(hypothesis_run, budget, seconds, chosen.max_examples)
    except (GraphmodeFailure, RankAbort) as ended:
        failure = budget.annotated(ended.failure)
        stats.failures.append(failure)
        raise GraphmodeFailure(failure, stats) from None
    finally:
        pool.close()
        budget.finish()
        stats.seconds += time.perf_counter() - started
    return stats
