"""The lockstep driver: runs one schedule through up to five twins of a target, checking each step.

Twins, all made by the same factory with the same seed (hence the same weights and state):
- `graph`: graph mode, poisoned before every step (static buffers, null block), stressed: on cuda
  its step, and a weight update before it, run with delayed streams when the step's stress asks
  for delays;
- `eager`: eager mode, the reference; its null block is poisoned too;
- `clean`: graph mode, never poisoned; `padding_inert` demands bit-identical valid rows;
- `company`: eager mode, never poisoned, runs only the sampled requests, their KV blocks renamed
  (see `sampling_check.py`); made only for targets with the "sampling" feature;
- `greedy company`: the same for about half of the greedy requests; made for every target whose
  logits do not depend on their batch (`batch_invariant`).
Only the two graph twins capture graphs: capture dominates the cost of an example. Only the graph
twin's step is delayed: a race that every twin ran into alike could give the same wrong values on
all of them, and the twins it is compared with must be undisturbed references.

A step whose `Stress` says `pipelined` runs with the step before it as a pipelined pair
(`_run_pair`): the references (eager, clean, company) still run in lockstep, each read at its
step, but the graph twin gets both steps back to back and is read only after the second.

Twins made `kept=True` serve several examples (`kept_twins.py`): a `Reset` event restores every
twin's `state()` from the copy taken when they were made and starts the next example, with the
graphs captured so far still captured.
"""

from __future__ import annotations

import dataclasses
import random
import traceback
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

import torch

from pytest_graphmode.campaign_stats import CampaignStats
from pytest_graphmode.contract import Batch, GraphTarget, StepResult, TargetFactory, TargetSpec
from pytest_graphmode.failure import MADE_TWINS, Failure, GraphmodeFailure
from pytest_graphmode.fuzz import sampling_check
from pytest_graphmode.fuzz.checks import REPLAY_MATCHES_EAGER, Outcome
from pytest_graphmode.fuzz.construction import (
    construction_raised,
    made_twins_violations,
    state_not_live,
)
from pytest_graphmode.fuzz.escaped import harness_error, runner_call
from pytest_graphmode.fuzz.failure_message import Ran, failure_message
from pytest_graphmode.fuzz.host_times import HostTimes
from pytest_graphmode.fuzz.kv_checks import STATES_MATCH
from pytest_graphmode.fuzz.packed_state import packed_state_as_bytes
from pytest_graphmode.fuzz.registry import (
    REGISTRY,
    Evidence,
    Kept,
    State,
    is_device_fault,
    is_out_of_device_memory,
)
from pytest_graphmode.fuzz.snippet import replay_snippet
from pytest_graphmode.fuzz.tolerance import matmul_precision
from pytest_graphmode.fuzz.violation import Violation
from pytest_graphmode.runtime.backends import Backend, capture_error_of
from pytest_graphmode.runtime.backends.footprint import issuing
from pytest_graphmode.strategies import stressors
from pytest_graphmode.strategies.idle_blocks import (
    MarkedBlocks,
    mark_idle_blocks,
    mark_slots_to_write,
    unwritten_slots,
)
from pytest_graphmode.strategies.plans import Reset, Stress
from pytest_graphmode.strategies.stream_delays import StreamsMet

Event = Batch | Stress | Reset


def bucket_for(spec: TargetSpec, num_tokens: int) -> int:
    """The capture size a padded graph would use for `num_tokens`; 0 above the largest."""
    return next((size for size in spec.capture_sizes if size >= num_tokens), 0)


def snapshot(state: Mapping[str, torch.Tensor]) -> State:
    """A CPU copy of a twin's `state()`, to compare with the state after a step."""
    return {key: value.detach().to("cpu", copy=True) for key, value in state.items()}


def key_text(key: object) -> str:
    """A graph key as the summary shows it: a dataclass by its fields that hold something (no
    class name, no None or empty field), anything else by its repr."""
    if dataclasses.is_dataclass(key) and not isinstance(key, type):
        fields = ((field.name, getattr(key, field.name)) for field in dataclasses.fields(key))
        held = [(n, v) for n, v in fields if not (v is None or (isinstance(v, tuple) and not v))]
        return "(" + ", ".join(f"{n}={v!r}" for n, v in held) + ")"
    return repr(key)


def step_outcome(target: GraphTarget, batch: Batch) -> Outcome:
    """`target.step(batch)`, or the traceback of what it raised."""
    try:
        return Outcome(target.step(batch))
    except Exception as exc:  # a runner's failure is a finding, reported with its traceback
        return Outcome(None, _traceback_led_by_notes(exc))


def _traceback_led_by_notes(exc: BaseException) -> str:
    """The traceback of `exc`, led by the error and its notes where it has notes: the sim's say
    which queued or recorded operation raised, and would come only after a traceback through
    the sim's own frames."""
    text = traceback.format_exc()
    if not getattr(exc, "__notes__", None):
        return text
    head = "".join(traceback.format_exception_only(exc)).rstrip()
    return f"{head}\n{text}"


def frozen(result: StepResult) -> StepResult:
    """A host copy of `result` as it is now, whatever its runner does next."""
    return dataclasses.replace(
        result,
        logits=result.logits.detach().cpu().clone(),
        next_tokens=result.next_tokens.detach().cpu().clone(),
    )


def _frozen(outcome: Outcome) -> Outcome:
    return outcome if outcome.result is None else Outcome(frozen(outcome.result))


@dataclass(frozen=True)
class _Step:
    """A batch of a schedule, the stress before it, and the batch's index in the event list."""

    stress: Stress
    batch: Batch
    index: int


def _steps(events: Sequence[Batch | Stress]) -> list[_Step]:
    steps: list[_Step] = []
    pending = Stress()
    for index, event in enumerate(events):
        if isinstance(event, Stress):
            pending = event
            continue
        steps.append(_Step(pending, event, index))
        pending = Stress()
    return steps


@dataclass(frozen=True)
class _References:
    """One step of the reference twins, read at that step: host copies (`eager`, `clean`, the
    company twins') and the eager twin's result itself (`live`, for `results_stay_valid`)."""

    eager: Outcome
    clean: Outcome
    companies: tuple[sampling_check.CompanyRun, ...]
    live: StepResult | None


class RestoreRefused(Exception):
    """The kept twins cannot start the next example for something the runner did; `violation`
    says what, as a failure of its check."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.describe())
        self.violation = violation


class Lockstep:
    """Owns the twins of one example; `run` raises `GraphmodeFailure` on the first violation."""

    def __init__(
        self,
        factory: TargetFactory,
        *,
        backend: str,
        seed: int,
        stats: CampaignStats,
        kept: bool = False,
    ) -> None:
        from pytest_graphmode.runtime import backends

        # A runner that draws from torch's global generator (knowingly or not) must give the
        # same values in a campaign and in the replay of its snippet: both start here, from the
        # example's seed, before any target is made.
        torch.manual_seed(seed)
        self.backend: Backend = backends.get(backend)
        self.backend.set_scheduler_seed(seed)
        # For the twins' life (close() leaves it): the backend active, and on sim `torch.cuda`
        # resolving to it, so plain torch.cuda runners run too.
        self._scope = backends.target_scope(backend)
        self._scope.__enter__()
        self.backend.take_races()  # found before this example: not its races
        self._activated = True
        self._factory, self._backend_name, self.seed, self.stats = factory, backend, seed, stats
        self._targets: list[GraphTarget] = []
        # The graph twin's latest result: the caller holds it while the next step runs.
        self._graph_result: StepResult | None = None
        self.twin_seed = seed  # the seed the twins were made with; `seed` is the example's
        self.examples = 1  # examples run on these twins: 1 + the `Reset` events run
        # The seed of the last `update_weights` call on the twins (None: their weights are still
        # the factory's). Restoring `state()` does not undo it: the next example starts from them.
        self.weight_seed: int | None = None
        self._history: list[Event] = []  # the events of the examples run before this one
        # How the graph twin ran each step of this example (by step), for a failure's message.
        self._ran: dict[int, Ran | None] = {}
        self._saved: list[dict[str, torch.Tensor]] = []
        # Measured on cuda only, the one backend whose delays it sizes.
        self.host_times = HostTimes(measure=self.backend.name == "cuda")
        # The streams the graph twin's delayed steps of each phase met: a held stream past them is
        # taken modulo. Per phase: an eager prefill may queue on one stream where a replayed
        # decode queues on three, and the most of all phases would leave the prefill's held 1
        # and 2 holding nothing, as before.
        self.streams_met: defaultdict[str, StreamsMet] = defaultdict(StreamsMet)
        try:
            self.graph, self.eager = self._make_pair()
            self.clean = self._make("graph")
            self.spec = self.graph.spec
            # name -> (twin, the sub-batch of a batch it runs, None for none)
            self.companies: dict[str, tuple[GraphTarget, Callable[[Batch], Batch | None]]] = {}
            if "sampling" in self.spec.features:
                sampled = (self._make("eager"), self._sampled_company)
                self.companies[sampling_check.COMPANY] = sampled
            if self.spec.batch_invariant:
                greedy = (self._make("eager"), self._greedy_company)
                self.companies[sampling_check.GREEDY_COMPANY] = greedy
        except BaseException:
            self.close()
            raise
        for twin in self._targets:
            if twin.spec != self.spec:
                self.close()
                raise ValueError(
                    f"the factory made twins with different specs: {twin.spec} vs "
                    f"{self.spec}; a factory must be deterministic in its seed"
                )
            problem = state_not_live(twin)
            if problem is not None:
                self.close()
                raise ValueError(problem)
        try:
            self._judge_made_twins()
        except BaseException:
            self.close()
            raise
        self._renaming = sampling_check.BlockRenaming.drawn(self.spec, seed)
        if kept:
            # Kept on the device: a `Reset` is then one device-side copy per tensor.
            self._saved = [
                {key: value.detach().clone() for key, value in twin.state().items()}
                for twin in self._targets
            ]

    def _judge_made_twins(self) -> None:
        """Raise `GraphmodeFailure` unless the twins start identical (`construction.py`)."""
        races = self.backend.take_races()
        others = [
            ("graph", self.graph),
            ("clean", self.clean),
            *((name, twin) for name, (twin, _) in self.companies.items()),
        ]
        violations, twin = made_twins_violations(
            races,
            snapshot(self.eager.state()),
            # Compared as they are (states_match copies each to the host): nothing runs between.
            [(name, t.state()) for name, t in others],
            self.spec,
        )
        if not violations:
            return
        what = (
            "a stream race while the twins were made (every twin ran the same code into it)"
            if not twin
            else f"the {twin} twin and the eager twin, made by the same factory with the same "
            "seed, differ before any step: something the first did while it was made (a capture "
            "or warm-up at start-up, for example) changed state the eager twin's construction "
            "did not"
        )
        snippet = self._snippet([])
        message = "\n".join(
            [
                f"graphmode check {violations[0].check!r} failed before step 0, when the twins "
                f"were made (seed {self.seed})",
                violations[0].describe(),
                what,
                "replay it (the twins are made, no step runs) with:",
                snippet,
            ]
        )
        failure = Failure(violations[0].check, MADE_TWINS, message, self.twin_seed, snippet)
        raise GraphmodeFailure(failure, self.stats)

    def _make_pair(self) -> tuple[GraphTarget, GraphTarget]:
        """The graph and eager twins; a factory that raises for either is a failure before step 0
        (`construction_raised`), with the snippet that makes them, not an error of the harness.
        Both are tried, so that the report says whether graph mode alone fails."""
        made: list[GraphTarget] = []
        errors: list[str | None] = []
        for mode in ("graph", "eager"):
            try:
                made.append(self._make(mode))
                errors.append(None)
            except Exception as error:
                if is_device_fault(error) or is_out_of_device_memory(error):
                    # Not the runner's graph mode: the context is lost (an isolated campaign's
                    # parent reports it), or the device is full (the campaign ends with it).
                    raise
                errors.append(traceback.format_exc())
        if not any(errors):
            return made[0], made[1]
        violation = construction_raised(errors[0], errors[1])
        snippet = self._snippet([])
        message = "\n".join(
            [
                f"graphmode check {violation.check!r} failed before step 0, when the twins were "
                f"made (seed {self.seed})",
                violation.describe(),
                "replay it (the twins are made, no step runs) with:",
                snippet,
            ]
        )
        failure = Failure(violation.check, MADE_TWINS, message, self.twin_seed, snippet)
        raise GraphmodeFailure(failure, self.stats)

    def _snippet(self, events: Sequence[Event]) -> str:
        """The source that replays `events` on fresh twins made as these were."""
        return replay_snippet(
            events, factory=self._factory, backend=self._backend_name, seed=self.twin_seed
        )

    def _make(self, mode: Literal["graph", "eager"]) -> GraphTarget:
        made = self._factory(mode, seed=self.seed, backend=self._backend_name)
        target = packed_state_as_bytes(made)
        self._targets.append(target)
        return target

    def close(self) -> None:
        for target in self._targets:
            target.close()
        self._targets.clear()
        if self._activated:
            self._activated = False
            self._scope.__exit__(None, None, None)

    def reset(self, seed: int) -> None:
        """Start the next example on these twins, with `seed` (see `Reset`); raise
        `RestoreRefused` where the runner keeps them from it."""
        if not self._saved:
            raise ValueError("these twins keep no copy of their state: make them with kept=True")
        # Counted first: a failure on the way is the next example's, and says so.
        self.seed = seed
        self.examples += 1
        for twin, saved in zip(self._targets, self._saved, strict=True):
            state = twin.state()
            if state.keys() != saved.keys():
                detail = (
                    "a twin's state() keys changed since it was made: the harness restores a "
                    "kept twin through the tensors state() returns, so their keys must stay those "
                    "the twin was made with"
                )
                expected, actual = str(sorted(saved)), str(sorted(state))
                changed = Violation(STATES_MATCH, detail, expected=expected, actual=actual)
                raise RestoreRefused(changed)
            with stressors.writes_into_targets():
                for key, tensor in state.items():
                    tensor.copy_(saved[key])
        try:
            self.backend.synchronize()
        except RuntimeError as error:
            if capture_error_of(error) is None:
                raise
            detail = (
                "capture_not_ended: a capture was still in progress when the harness "
                "synchronized the device to start the next example on the kept twins (a capture "
                "the runner began on another thread and had not ended when its step returned): "
                "CUDA refuses a device synchronize during any capture, so a runner's captures "
                f"must end before its step returns ({error})"
            )
            raise RestoreRefused(Violation(REPLAY_MATCHES_EAGER, detail)) from error
        self.backend.take_races()  # the harness's own restoring copies
        torch.manual_seed(seed)
        self.backend.set_scheduler_seed(seed)
        self._renaming = sampling_check.BlockRenaming.drawn(self.spec, seed)
        self._graph_result = None

    def run(self, events: Sequence[Event]) -> None:
        """Run `events`, one example or (separated by `Reset` events) several on these twins,
        and check every step."""
        example: list[Batch | Stress] = []
        reset: Reset | None = None  # the one that starts `example`
        for event in events:
            if isinstance(event, Reset):
                self._run_after(reset, example)
                reset, example = event, []
            else:
                example.append(event)
        self._run_after(reset, example)

    def _run_after(self, reset: Reset | None, example: list[Batch | Stress]) -> None:
        """Run `example` after its `reset` (None: the twins' first example)."""
        if reset is not None:
            self._restore(reset, example)
        self._run_example(example)
        self._history += example

    def _restore(self, reset: Reset, example: Sequence[Batch | Stress]) -> None:
        """`reset` the twins for `example`; what the runner breaks on the way (a method that
        raises, `state()` keys that changed, a capture not ended, an earlier asynchronous error
        surfacing at the synchronize) is a failure at the example's first step."""
        self._history.append(reset)  # the snippet replays the examples before, then this reset
        try:
            self.reset(reset.seed)
        except Exception as error:
            if is_device_fault(error) or is_out_of_device_memory(error):
                raise  # the campaign reports these itself (isolation, `NotAFinding`)
            steps = _steps(example)
            batch, events = (steps[0].batch, example[: steps[0].index + 1]) if steps else (None, [])
            when = "restoring the kept twins' state() before the example's first step (its Reset)"
            if isinstance(error, RestoreRefused):
                self._fail(error.violation, 0, batch, events, when=when)
            self._fail_escaped(error, 0, batch, events, when=when)

    def replayed(self, events: Sequence[Batch | Stress]) -> list[Event]:
        """What replays `events`, the example now running, on fresh twins made as these were:
        every example run on these twins before it, each after its `Reset`, then `events`."""
        return [*self._history, *events]

    def _run_example(self, events: Sequence[Batch | Stress]) -> None:
        """Run one example's `events` and check every step. A step whose stress is `pipelined`
        forms a pair with the step before it, unless that one is already the second of a pair:
        pairs do not chain, since a result need stay valid only until the step after it
        returns."""
        steps = _steps(events)
        self._ran.clear()
        kept: list[Kept] = []
        previous: Batch | None = None
        step = 0
        while step < len(steps):
            first = steps[step]
            try:
                if step + 1 < len(steps) and steps[step + 1].stress.pipelined:
                    kept = self._run_pair(step, first, steps[step + 1], previous, kept, events)
                    previous = steps[step + 1].batch
                    step += 2
                    continue
                with issuing(f"step {step}"):  # a race's sides say which step they came from
                    held = self._stress(first.stress, previous, first.batch, self._rng(step))
                    violations, kept = self._check_step(step, first.batch, kept, first.stress)
                held.clear()  # churned tensors live exactly across the step
            except GraphmodeFailure:
                raise
            except Exception as error:
                if is_device_fault(error) or is_out_of_device_memory(error):
                    raise  # the campaign reports these itself (isolation, `NotAFinding`)
                self._fail_escaped(error, step, first.batch, events[: first.index + 1])
            if violations:
                self._fail(violations[0], step, first.batch, events[: first.index + 1])
            previous = first.batch
            step += 1

    def _fail_escaped(
        self,
        error: Exception,
        step: int,
        batch: Batch | None,
        events: Sequence[Batch | Stress],
        when: str | None = None,
    ) -> NoReturn:
        """Raise what `error`, escaped from the harness's work around `step` (`when`: other
        work, such as a `Reset`), is (`escaped.py`): a failure of `replay_matches_eager` where a
        runner method raised it (a runner's methods must not raise on a legal schedule, outside
        its step no more than in it), else a `HarnessError`."""
        twins = {"graph": self.graph, "eager": self.eager, "clean": self.clean}
        twins.update((name, twin) for name, (twin, _) in self.companies.items())
        call = runner_call(error, twins)
        if call is None:
            snippet = self._snippet(self.replayed(events))
            at = f"at step {step} (seed {self.twin_seed})" + (f", {when}" if when else "")
            raise harness_error(error, at, snippet) from error
        whose = "the runner's" if call.twin is None else f"the {call.twin} twin's"
        detail = (
            f"{call.twin or 'target'}_raised: {whose} {call.method} raised, called by the harness "
            f"outside the step ({call.caller}); a runner's methods must not raise on a legal "
            f"schedule:\n{''.join(traceback.format_exception(error))}"
        )
        self._fail(Violation(REPLAY_MATCHES_EAGER, detail), step, batch, events, when=when)

    def _graph_step(
        self, batch: Batch, stress: Stress, outlast: Sequence[Batch] | None = None
    ) -> Outcome:
        """The graph twin's step under `stress`'s delay, preceded in the same scope by its
        weight update when `stress` has one. Right before the step, after the harness's own
        poisoning, marks and snapshots (which wait for the device): on cuda an update the step
        does not wait for is then still in flight when the step reads the weights, and a loader
        that refills a pinned staging buffer before its last copy out of it ran loads other
        weights than the references, which load them undelayed. On cuda the delay holds the
        step's streams back for as long as the host takes to run the steps of `outlast` (None:
        this one; `host_times.py`)."""
        delayed = stressors.delays_on(self.backend, stress)
        hold = 0
        if delayed:
            hold = self.host_times.hold_cycles(self.backend.device, outlast or [batch])
        with stressors.delayed_step(self.backend, stress, hold, self.streams_met[batch.phase]):
            if stress.weight_seed is not None:
                self.graph.update_weights(stress.weight_seed)
            if stressors.stressed_timing(self.backend, stress):
                # its host time may include a sleep or a copy it waits for
                return step_outcome(self.graph, batch)
            return self.host_times.timed("graph", batch, lambda: step_outcome(self.graph, batch))

    def _rng(self, step: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + step)

    def _stress(
        self, stress: Stress, previous: Batch | None, batch: Batch, rng: random.Random
    ) -> list[torch.Tensor]:
        if stress.weight_seed is not None:
            self.weight_seed = stress.weight_seed
            # The references only: the graph twin's update comes last, right before its step
            # (`_graph_step`). A loader that frees the tensors its graphs read (and loads new
            # ones elsewhere) leaves them free with the old weights in them, where a reference
            # updated after it could allocate its own new weights, the same values, into that
            # memory on cuda and so give the stale graph the right weights by chance.
            for twin in self._targets:
                if twin is not self.graph:
                    twin.update_weights(stress.weight_seed)
        blocks, slots = stressors.live_indices(self.spec, [b for b in (previous, batch) if b])
        stressors.poison_static_buffers(
            self.graph.static_buffers(), live_blocks=blocks, live_slots=slots, rng=rng
        )
        stressors.poison_null_block(self.graph.state(), self.spec)
        stressors.poison_null_block(self.eager.state(), self.spec)
        kept = stressors.churn(self.backend.device, stress.churn, rng)
        stressors.delay(self.backend, stress)
        return kept

    def _check_step(
        self, step: int, batch: Batch, kept: list[Kept], stress: Stress
    ) -> tuple[list[Violation], list[Kept]]:
        marked = self._mark_blocks([batch])
        try:
            return self._checked_step(step, batch, kept, stress)
        finally:
            marked.restore()

    def _mark_blocks(self, batches: Sequence[Batch]) -> MarkedBlocks:
        """Mark the blocks no request of `batches` lists, and the slots `batches` write, on the
        graph and eager twins, before their state is snapshotted for the step (`idle_blocks.py`):
        a write to an idle block then shows even when it stores the bits the slot held, and a
        slot left unwritten shows as still marked. Both twins alike, so that their states still
        match; the clean and company twins are references and stay as they are. Only the idle
        blocks are restored afterwards."""
        states = [self.graph.state(), self.eager.state()]
        mark_slots_to_write(states, self.spec, batches)
        return mark_idle_blocks(states, self.spec, batches)

    def _checked_step(
        self, step: int, batch: Batch, kept: list[Kept], stress: Stress
    ) -> tuple[list[Violation], list[Kept]]:
        graph_before, eager_before = snapshot(self.graph.state()), snapshot(self.eager.state())
        graph = self._graph_step(batch, stress)
        refs = self._reference_steps(batch)
        eager, clean = refs.eager, refs.clean
        self._count(step, batch, graph.result)
        now = [(r, _clones(r), step) for r in (graph.result, eager.result) if r is not None]
        raised = bool(graph.error or eager.error)
        evidence = Evidence(
            batch=batch,
            spec=self.spec,
            graph=graph,
            eager=eager,
            clean=clean,
            graph_before=graph_before,
            eager_before=eager_before,
            graph_after={} if raised else snapshot(self.graph.state()),
            eager_after={} if raised else snapshot(self.eager.state()),
            clean_after={} if raised else snapshot(self.clean.state()),
            views=[] if raised else self.graph.address_views(),
            kept=kept,
            companies=refs.companies,
            step=step,
            races=self.backend.take_races(),
            matmul=matmul_precision(self.backend.name),
        )
        self._graph_result = graph.result
        return self._first_violation(evidence), now

    def _first_violation(self, evidence: Evidence) -> list[Violation]:
        """The first check of the registry that finds something wrong with `evidence`."""
        for check in REGISTRY:
            if evidence.twin_raised and not check.judges_raising_twins:
                continue
            if not check.applies(evidence):
                continue
            self.stats.checks_run[check.name] += 1
            found = check.judge(evidence)
            if found:
                return found
        return []

    def _reference_steps(self, batch: Batch) -> _References:
        """`batch` on the eager and clean twins, its sampled requests on the company twin and
        some of its greedy ones on the greedy company twin (`sampling_check.company_batch`,
        `greedy_company_batch`; a twin without requests in the batch does not step). A company
        twin's slots to write are marked before its step and read right after it
        (`kv_writes_land`): its requests live in other rows and blocks than on the other twins,
        so a table gone wrong with that history shows there first."""
        eager = self.host_times.timed("eager", batch, lambda: step_outcome(self.eager, batch))
        clean = step_outcome(self.clean, batch)
        companies = tuple(
            self._company_step(name, twin, sub)
            for name, (twin, sub_batch) in self.companies.items()
            if (sub := sub_batch(batch)) is not None
        )
        return _References(eager, clean, companies, eager.result)

    def _sampled_company(self, batch: Batch) -> Batch | None:
        invariant = self.spec.batch_invariant
        return sampling_check.company_batch(batch, self._renaming, batch_invariant=invariant)

    def _greedy_company(self, batch: Batch) -> Batch | None:
        return sampling_check.greedy_company_batch(batch, self.seed, self._renaming)

    def _company_step(self, name: str, twin: GraphTarget, sub: Batch) -> sampling_check.CompanyRun:
        slots = mark_slots_to_write([twin.state()], self.spec, [sub])
        outcome = step_outcome(twin, sub)
        unwritten: list[int] = []
        if outcome.error is None:
            unwritten = unwritten_slots(twin.state(), self.spec, slots)
        return sampling_check.CompanyRun(name, sub, outcome, tuple(unwritten))

    def _references(self, batch: Batch) -> _References:
        """`_reference_steps`, its outcomes copied to the host as they are now."""
        refs = self._reference_steps(batch)
        return dataclasses.replace(
            refs,
            eager=_frozen(refs.eager),
            clean=_frozen(refs.clean),
            companies=tuple(
                dataclasses.replace(run, outcome=_frozen(run.outcome)) for run in refs.companies
            ),
        )

    def _run_pair(
        self,
        step: int,
        first: _Step,
        second: _Step,
        previous: Batch | None,
        kept: Sequence[Kept],
        events: Sequence[Batch | Stress],
    ) -> list[Kept]:
        """Steps `step` and `step + 1` as a pipelined pair; the results to keep afterwards.

        The reference twins run both steps first, in lockstep. Then the graph twin gets both
        steps back to back: between them the harness only delays (no poisoning, no snapshot, no
        read), as an engine that schedules the next step while the last one runs. Both steps are
        judged once the second has returned, each against the references read at its step, and
        the states over the pair (before the first step, after the second): the writes with the
        first step, the states after the pair with the second (see `Evidence`).
        """
        # The second step's work names step + 1 (`_pair_evidence`).
        with issuing(f"step {step}, the first of a pipelined pair"):
            churned = self._stress(first.stress, previous, first.batch, self._rng(step))
            marked = self._mark_blocks([first.batch, second.batch])
            try:
                judged, graph1, ref1 = self._pair_evidence(step, first, second, kept)
            finally:
                marked.restore()
        churned.clear()
        for evidence in judged:
            violations = self._first_violation(evidence)
            if violations:
                self._fail(
                    violations[0],
                    evidence.step,
                    evidence.batch,
                    events[: second.index + 1],
                    pair=(first.batch, second.batch),
                )
        assert graph1 is not None and ref1 is not None  # a pair that ended early failed above
        self._graph_result = graph1.result
        now: list[Kept] = []
        if graph1.result is not None:
            now.append((graph1.result, _clones(graph1.result), step + 1))
        copy = ref1.eager.result  # the eager result's host copy, taken at its step
        if ref1.live is not None and copy is not None:
            now.append((ref1.live, (copy.logits, copy.next_tokens), step + 1))
        return now

    def _pair_evidence(
        self, step: int, first: _Step, second: _Step, kept: Sequence[Kept]
    ) -> tuple[list[Evidence], Outcome | None, _References | None]:
        """Run the pair on every twin: the evidence to judge each step with, the graph twin's
        outcome of the second step and the references of the second step (None: not run, the
        first step already failed)."""
        graph_before, eager_before = snapshot(self.graph.state()), snapshot(self.eager.state())
        ref0 = self._references(first.batch)
        # Read now, after the eager twin's first step: unchanged by it, as the contract asks.
        kept0 = [(frozen(result), then, at) for result, then, at in kept]
        ref1: _References | None = None
        second_step = f"step {step + 1}, the second of a pipelined pair"
        if not ref0.eager.error:  # else the pair fails at its first step
            stressors.poison_null_block(self.eager.state(), self.spec)
            with issuing(second_step):
                ref1 = self._references(second.batch)
        ended = ref1 is None or bool(ref1.eager.error)
        eager_after = {} if ended else snapshot(self.eager.state())
        clean_after = {} if ended else snapshot(self.clean.state())

        held_before = self._graph_result
        both = [first.batch, second.batch]
        graph0 = self._graph_step(first.batch, _pair_delay(first.stress, second.stress), both)
        graph1: Outcome | None = None
        if ref1 is not None and graph0.error is None:
            with issuing(second_step):
                stressors.delay(self.backend, second.stress)
                graph1 = self._graph_step(second.batch, second.stress)
        self._count(step, first.batch, graph0.result)
        self.stats.pipelined_steps += 1
        # A twin that raised owes no consistent state: the pair's states are then not read.
        states_read = not (graph0.error or ref0.eager.error or ended)
        states_read = states_read and graph1 is not None and graph1.error is None
        held = [(held_before, step - 1)] if held_before is not None else []
        if graph1 is not None and graph1.result is not None:
            held.append((graph1.result, step + 1))
        graph_after = snapshot(self.graph.state()) if states_read else {}
        eager_after = eager_after if states_read else {}
        judged = [
            Evidence(
                batch=first.batch,
                spec=self.spec,
                graph=graph0,
                eager=ref0.eager,
                clean=ref0.clean,
                graph_before=graph_before,
                eager_before=eager_before,
                graph_after=graph_after,
                eager_after=eager_after,
                clean_after={},
                views=[],
                kept=kept0,
                companies=ref0.companies,
                states_read=states_read,
                pipelined="first",
                paired=(second.batch,),
                held=held,
                step=step,
                # Everything both steps of every twin left: judged with the first step.
                races=self.backend.take_races(),
                matmul=matmul_precision(self.backend.name),
            )
        ]
        if ref1 is not None and graph1 is not None:
            self._count(step + 1, second.batch, graph1.result)
            self.stats.pipelined_steps += 1
            eager0 = ref0.eager.result
            # The pair's states, as the first step's; this step's own results and references.
            judged.append(
                dataclasses.replace(
                    judged[0],
                    batch=second.batch,
                    graph=graph1,
                    eager=ref1.eager,
                    clean=ref1.clean,
                    clean_after=clean_after if states_read else {},
                    views=self.graph.address_views() if states_read else [],
                    kept=(
                        [(frozen(ref0.live), (eager0.logits, eager0.next_tokens), step)]
                        if ref0.live is not None and eager0 is not None
                        else []
                    ),
                    companies=ref1.companies,
                    pipelined="second",
                    paired=(first.batch,),
                    held=(),
                    step=step + 1,
                    races=None,
                    matmul=matmul_precision(self.backend.name),
                )
            )
        return judged, graph1, ref1

    def _count(self, step: int, batch: Batch, result: StepResult | None) -> None:
        self._ran[step] = (
            None if result is None else Ran(result.path, result.graph_key, result.reason)
        )
        self.stats.steps += 1
        self.stats.buckets_hit[bucket_for(self.spec, batch.num_tokens)] += 1
        if result is not None:
            self.stats.paths[result.path] += 1
            if result.path != "eager" and result.graph_key is not None:
                self.stats.graph_keys[key_text(result.graph_key)] += 1
            if result.path != "full" and result.reason:
                self.stats.fallback_reasons[result.reason] += 1

    def _fail(
        self,
        violation: Violation,
        step: int,
        batch: Batch | None,
        events: Sequence[Batch | Stress],
        pair: tuple[Batch, Batch] | None = None,
        when: str | None = None,
    ) -> NoReturn:
        """Raise the failure of `violation` at `step` (`batch` None: an example without steps),
        `when` the harness's work it was found in where that is not the step's own; `pair`: the
        batches of the pipelined pair `step` belongs to (`step` is the pair's first or second
        step), both described."""
        snippet = self._snippet(self.replayed(events))
        # The seed a user passes to `replay`: the twins'. A kept twins' example has its own, which
        # the snippet's `Reset` carries.
        where = f"seed {self.twin_seed}"
        if self.examples > 1:
            where += (
                f", the snippet's; example {self.examples} on twins made with it, "
                f"Reset(seed={self.seed})"
            )
        if when is not None:
            where += f", {when}"
        message = failure_message(violation, step, batch, pair, where, self._ran, snippet)
        failure = Failure(violation.check, step, message, self.twin_seed, snippet)
        raise GraphmodeFailure(failure, self.stats)


def _clones(result: StepResult) -> tuple[torch.Tensor, torch.Tensor]:
    """Host copies of a result's logits and tokens, for `results_stay_valid`."""
    return result.logits.detach().cpu().clone(), result.next_tokens.detach().cpu().clone()


def _pair_delay(first: Stress, second: Stress) -> Stress:
    """The stress a pipelined pair's first step runs under: its own, with the pair's delay (and
    what it makes land late) when the pair has one. A race between the two steps (the second
    step's preparation rewriting what the first step's copies or replay still read, or not
    waiting for its events) shows on the GPU only while that work of the first step is still in
    flight as the second is prepared, so the pair's delay covers the first step too; drawn only
    on the second, it met a delayed first step in about one pair in six."""
    if not second.delay_cycles:
        return first
    cycles = max(first.delay_cycles, second.delay_cycles)
    return dataclasses.replace(
        first, delay_cycles=cycles, late=second.late, held_stream=second.held_stream
    )
