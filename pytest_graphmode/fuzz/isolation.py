"""`run_isolated`: a campaign in a child process, so that a device fault ends the child, not the
test session.

An out-of-bounds index on the GPU is an illegal memory access or a device-side assert: it poisons
the process's CUDA context for good, and may abort the process outright. Run in-process, such a
runner ends the session with a raw error, or with no summary and no report at all. Here the
campaign runs in a child process (started with `spawn`: a forked child cannot use CUDA) that
streams back its statistics after every example and, before every step, which step of which
example it is running. When the child dies, or reports that the device faulted, the parent turns
what it last heard into a failure of the check `no_device_fault`, with the step, the schedule up to
that step and its replay snippet, and the next campaign starts in a fresh child.

A device fault is not shrunk: once the context is poisoned, every later input fails too, and
shrinking would "find" a meaningless smallest schedule.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import hypothesis

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import Batch, GraphTarget, TargetFactory
from pytest_graphmode.failure import MADE_TWINS, Failure, GraphmodeFailure
from pytest_graphmode.fuzz.campaign_process import DEFAULT_CPU_THREADS
from pytest_graphmode.fuzz.registry import (
    NO_DEVICE_FAULT,
    is_device_fault,
    is_out_of_device_memory,
)
from pytest_graphmode.loader import TargetError, check_twins
from pytest_graphmode.strategies.plans import Stress

SILENCE_LIMIT_SECONDS = 600.0
"""How long the child may send nothing (no step started, no example finished) before the parent
gives up on it: a step that hangs on the device never returns."""
_FAULT_EXIT = 70


class IsolatedCampaignError(RuntimeError):
    """The campaign raised in its child process something other than a failed check (a broken
    factory, a harness error); the message holds the child's traceback."""


class CampaignOutOfMemory(IsolatedCampaignError):
    """The campaign's child process ran out of device memory outside any step (making its
    targets, say): no check failed, the device had too little room for the campaign."""


def isolates(option: str, backend: str, factory: TargetFactory) -> bool:
    """Whether a run with `--graphmode-isolate=option` runs `factory`'s targets on the concrete
    `backend` in child processes: "on", or "auto" on cuda for a factory that can reach a child
    (a lambda or a local function cannot, and runs in this process)."""
    if option == "auto":
        return backend == "cuda" and can_isolate(factory)
    return option == "on"


def can_isolate(factory: TargetFactory) -> bool:
    """Whether `factory` can be sent to a child process (importable by name, or a partial of
    something that is)."""
    try:
        pickle.dumps(factory)
    except Exception:  # pickling raises several types, all meaning "not by reference"
        return False
    return True


def run_isolated(
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
    silence_limit: float = SILENCE_LIMIT_SECONDS,
    seconds: float | None = None,
    cpu_threads: int | None = DEFAULT_CPU_THREADS,
    check_twins_first: bool = False,
    stop: Callable[[], bool] | None = None,
    leading: bool = True,
) -> CampaignStats:
    """`run_campaign` with the same arguments, run in a child process; a child that faults or
    dies is a `GraphmodeFailure` of `no_device_fault`. `factory` must pickle (`can_isolate`).
    `stop`, asked several times a second, ends the campaign as passed when true (the child is
    killed; what it counted until then is kept).
    With `check_twins_first`, the child checks the twins against the contract before the
    campaign (`loader.check_twins`, with `seed`, 0 when None) and a `TargetError` it raises is
    raised here."""
    if not can_isolate(factory):
        raise TypeError(
            f"{factory!r} cannot be sent to a child process: an isolated campaign needs a target "
            "factory importable by name (a module-level function, or functools.partial of one); "
            "use --graphmode-isolate=off to run it in this process"
        )
    stats = CampaignStats() if stats is None else stats
    arguments = dict(
        backend=backend,
        max_examples=max_examples,
        max_steps=max_steps,
        seed=seed,
        features=features,
        settings=settings,
        shrink_seconds=shrink_seconds,
        seconds=seconds,
        cpu_threads=cpu_threads,
        leading=leading,
    )
    started = time.perf_counter()
    child = start_child(factory, arguments, check_twins_first, stats)
    try:
        outcome = _listen(child, progress, silence_limit, stop)
    finally:
        child.end()
    if outcome[0] == "stopped":
        return stats
    ended = child.ended(outcome, factory, backend, started, progress, silence_limit)
    if ended is not None:
        raise ended
    return stats


@dataclass
class _Heard:
    """The last example and step the child said it was running."""

    seed: int | None = None
    events: Sequence[Batch | Stress] = field(default_factory=list)
    step: int | None = None


class CampaignChild:
    """A campaign running in a child process, and what its parent has heard from it: its
    statistics (`stats`, updated as messages arrive) and the example and step it last began."""

    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        receiver: Connection,
        stats: CampaignStats,
    ) -> None:
        self.process, self.receiver, self.stats = process, receiver, stats
        self.heard = _Heard()
        self._last = time.monotonic()

    def receive(
        self,
        timeout: float,
        progress: Callable[[CampaignStats], None] | None,
        silence_limit: float,
    ) -> tuple[str, Any] | None:
        """Take one message, waiting up to `timeout` seconds for it: the child's end (`done`,
        `failure`, `target`, `error`, `memory`, `fault`) or its death (`died`, `silent`) as (kind,
        payload), None while it runs on."""
        if not self.receiver.poll(timeout):
            if not self.process.is_alive() and not self.receiver.poll(0):
                return "died", None
            if time.monotonic() - self._last > silence_limit:
                return "silent", None
            return None
        try:
            kind, payload, counted = self.receiver.recv()
        except EOFError:  # the child is gone; whatever it sent before has been read
            return "died", None
        self._last = time.monotonic()
        if counted is not None:
            self.stats.update_from(CampaignStats.from_json(counted))
        if kind == "example":
            self.heard.seed, self.heard.events, self.heard.step = payload[0], payload[1], None
        elif kind == "step":
            self.heard.step = payload
        elif kind == "progress":
            if progress is not None:
                progress(self.stats)
        else:
            return kind, payload
        return None

    def end(self) -> None:
        """Kill the child if it still runs (Ctrl-C, silence, or its work is no longer wanted),
        and reap it."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.receiver.close()

    def ended(
        self,
        outcome: tuple[str, Any],
        factory: TargetFactory,
        backend: str,
        started: float,
        progress: Callable[[CampaignStats], None] | None,
        silence_limit: float,
    ) -> BaseException | None:
        """What the campaign's end `outcome` raises (None: it passed). A child that faulted,
        died or fell silent is a failure of `no_device_fault`, counted into `stats`; `started`:
        when the campaign began, in this process's `time.perf_counter`."""
        kind, payload = outcome
        stats = self.stats
        if kind == "done":
            return None
        if kind == "failure":  # the child's statistics, already taken, list it
            return GraphmodeFailure(Failure.from_json(payload), stats)
        if kind == "target":
            return TargetError(payload)
        if kind == "error":
            return IsolatedCampaignError(f"the campaign's child process raised:\n{payload}")
        if kind == "memory":
            return CampaignOutOfMemory(
                f"the campaign's child process ran out of device memory:\n{payload}"
            )
        if kind == "fault":
            cause = f"the device faulted:\n{payload}"
        elif kind == "silent":
            cause = (
                f"the campaign's child process sent nothing for {silence_limit:g} s and was killed"
            )
        else:
            cause = f"the campaign's child process died ({_exit_reason(self.process.exitcode)})"
        failure = _fault_failure(cause, self.heard, factory, backend)
        if not stats.seconds:  # the child died before it could count its time
            stats.seconds = time.perf_counter() - started
        if stats.first_failure_check is None:
            stats.first_failure_seconds = time.perf_counter() - started
            stats.first_failure_example = stats.examples
            stats.first_failure_check = NO_DEVICE_FAULT
        stats.shrinking = False
        stats.failures.append(failure)
        if progress is not None:
            progress(stats)
        return GraphmodeFailure(failure, stats)


def start_child(
    factory: TargetFactory,
    arguments: dict[str, Any],
    check_twins_first: bool,
    stats: CampaignStats,
    name: str = "graphmode-campaign",
) -> CampaignChild:
    """Start `run_campaign(factory, **arguments)` in a child process (`spawn`), counting into
    `stats`. `arguments` may hold `deadline` instead of `seconds`: a `time.time()` after which no
    example starts, so that a child started late keeps to its parent's clock."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_child_main, args=(sender, factory, arguments, check_twins_first), name=name
    )
    process.start()
    sender.close()  # the child holds the only sending end: its death closes the pipe
    return CampaignChild(process, receiver, stats)


def _listen(
    child: CampaignChild,
    progress: Callable[[CampaignStats], None] | None,
    silence_limit: float,
    stop: Callable[[], bool] | None,
) -> tuple[str, Any]:
    """Relay the child's messages until it reports an end, stops talking, or `stop()` is true
    (then `("stopped", None)`)."""
    # Asked often enough, when something else may stop the campaign, that little of the
    # child's work is wasted.
    timeout = 1.0 if stop is None else 0.2
    while True:
        outcome = child.receive(timeout, progress, silence_limit)
        if outcome is not None:
            return outcome
        if stop is not None and stop():
            return "stopped", None


def _fault_failure(cause: str, heard: _Heard, factory: TargetFactory, backend: str) -> Failure:
    from pytest_graphmode.fuzz.snippet import replay_snippet

    schedule: list[str] = []
    snippet = ""
    if heard.seed is None:  # the contract check's twins, or the target that tells the spec
        where = "before the first example (making the targets that check the runner)"
        step = MADE_TWINS
    elif heard.step is None:
        where = "before the first step of an example (making or preparing the targets)"
        step = MADE_TWINS
    else:
        step = heard.step
        batches = [index for index, event in enumerate(heard.events) if isinstance(event, Batch)]
        events = heard.events[: batches[step] + 1]
        batch = heard.events[batches[step]]
        assert isinstance(batch, Batch)
        where = (
            f"at step {step} (seed {heard.seed}): {batch.num_reqs} requests, "
            f"{batch.num_tokens} tokens, phase {batch.phase}, query lengths {batch.query_lens}"
        )
        snippet = replay_snippet(events, factory=factory, backend=backend, seed=heard.seed)
        schedule = [
            "the schedule up to that step, not shrunk (a faulted device fails every later input); "
            "replay it in a fresh process with:",
            snippet,
        ]
    message = "\n".join(
        [
            f"graphmode check {NO_DEVICE_FAULT!r} failed {where}",
            cause,
            *schedule,
        ]
    )
    return Failure(NO_DEVICE_FAULT, step, message, heard.seed, snippet)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _child_main(
    sender: Connection, factory: TargetFactory, arguments: dict[str, Any], check_first: bool
) -> None:
    """The child: run the campaign, telling the parent what it is doing as it goes."""
    from pytest_graphmode.fuzz.campaign import run_campaign

    # Ctrl-C reaches the whole process group; the parent decides, and kills this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    backend = str(arguments["backend"])
    stats = CampaignStats()
    watch = _Watch(sender, stats, backend)
    if "deadline" in arguments:
        arguments = dict(arguments)
        left = arguments.pop("deadline") - time.time()
        if left <= 0:  # started after its parent's time budget was spent: nothing to run
            sender.send(("done", None, stats.to_json()))
            sender.close()
            return
        arguments["seconds"] = left
    try:
        # The plugin's check of the twins, made here rather than in the pytest process (where
        # `plugin.pytest_sessionstart` makes it for campaigns run in-process): making them runs
        # the runner's code on the device, and a runner whose construction faults it poisons the
        # CUDA context of the process that made it, which then dies when some tensor of it is
        # freed. pytest died so (SIGABRT, no summary, no report) in two runs of three on the
        # H200, with a runner whose capture read a staging buffer still being rewritten.
        if check_first:
            check_twins(factory, seed=arguments["seed"] or 0, backend=backend)
        run_campaign(
            watch.factory(factory),
            progress=lambda current: sender.send(("progress", None, current.to_json())),
            stats=stats,
            on_example=watch.example,
            **arguments,
        )
    except GraphmodeFailure as failed:
        watch.probe()
        sender.send(("failure", failed.failure.to_json(), stats.to_json()))
    except TargetError as problem:
        if problem.__cause__ is not None and is_device_fault(problem.__cause__):
            watch.fault(problem.__cause__)
        watch.probe()
        sender.send(("target", str(problem), stats.to_json()))
    except BaseException as error:
        if is_device_fault(error):
            watch.fault(error)
        watch.probe()
        kind = "memory" if is_out_of_device_memory(error) else "error"
        sender.send((kind, traceback.format_exc(), stats.to_json()))
    else:
        watch.probe()
        sender.send(("done", None, stats.to_json()))
    sender.close()


class _Watch:
    """The child's reports: each example's events, each step before it runs, device faults."""

    def __init__(self, sender: Connection, stats: CampaignStats, backend: str) -> None:
        self._sender, self._stats, self._backend = sender, stats, backend
        self._batches: list[Batch] = []
        self._step: int | None = None
        # Steps already counted: a pipelined pair returns to its first step (the references run
        # both steps before the graph twin does), and a step is judged once.
        self._counted: set[int] = set()

    def factory(self, factory: TargetFactory) -> TargetFactory:
        """`factory`, its targets reporting each step before running it. Keeps the factory's
        name, which the replay snippets of ordinary failures import."""

        @functools.wraps(factory)
        def watched(mode: Any, *, seed: int, backend: str) -> GraphTarget:
            return _WatchedTarget(factory(mode, seed=seed, backend=backend), self)

        return watched

    def example(self, seed: int, events: Sequence[Batch | Stress]) -> None:
        self.probe()  # a fault surfacing late belongs to the example before this one
        self._batches = [event for event in events if isinstance(event, Batch)]
        self._step = None
        self._counted = set()
        # With the counts so far, this example included: a fault before its first step is then
        # reported at this example, not at the one before.
        self._sender.send(("example", (seed, list(events)), self._stats.to_json()))

    def stepping(self, batch: Batch) -> None:
        step = next((i for i, known in enumerate(self._batches) if known is batch), None)
        if step is None or step == self._step:
            return  # another twin of the same step, or a batch derived from it
        self._step = step
        if step not in self._counted:
            self._counted.add(step)
            self._stats.checks_run[NO_DEVICE_FAULT] += 1
        self._sender.send(("step", step, self._stats.to_json()))

    def probe(self) -> None:
        """On cuda, raise nothing but report and exit when the device has faulted."""
        if self._backend != "cuda":
            return
        import torch

        try:
            torch.cuda.synchronize()
        except Exception as error:  # the context is poisoned: nothing more can run here
            self.fault(error)

    def fault(self, error: BaseException) -> None:
        text = "".join(traceback.format_exception(error)).rstrip()
        self._sender.send(("fault", text, self._stats.to_json()))
        self._sender.close()
        os._exit(_FAULT_EXIT)  # no clean-up: it would touch the poisoned context again


class _WatchedTarget:
    """A target that reports each step to the `_Watch` before running it."""

    def __init__(self, target: GraphTarget, watch: _Watch) -> None:
        self._target, self._watch = target, watch

    def step(self, batch: Batch) -> Any:
        self._watch.stepping(batch)
        try:
            return self._target.step(batch)
        except BaseException as error:
            if is_device_fault(error):
                self._watch.fault(error)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)
