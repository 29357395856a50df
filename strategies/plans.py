"""What a fuzz schedule is made of: abstract step plans and the stressors between steps.

A plan says *what kind* of step to take (how many rows, which phase, who arrives, finishes or is
preempted); the scheduler turns it into a concrete, legal `Batch`. Plans refer to live requests by
index modulo the live count, so every list of plans is legal whatever Hypothesis deletes while
shrinking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StepKind = Literal["decode", "spec", "prefill", "mixed"]
STEP_KINDS: tuple[StepKind, ...] = ("decode", "spec", "prefill", "mixed")
# What a delay makes land late on cuda (`stream_delays`): copies and event records, the step's
# computation (its eager kernels and graph replays), or the host (every copy has landed before
# the host goes on).
Late = Literal["copies", "compute", "host"]
LATE: tuple[Late, ...] = ("copies", "compute", "host")


@dataclass(frozen=True)
class Arrival:
    """A new request: its prompt length and sampling/adapter settings."""

    prompt_len: int
    seed: int | None = None
    temperature: float = 1.0
    adapter: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"Arrival.prompt_len={self.prompt_len} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"Arrival.temperature={self.temperature} must be > 0")


@dataclass(frozen=True)
class Stress:
    """Stressors applied right before the next step.

    `churn`: tensors to allocate and free on the backend device (0: none). `weight_seed`: call
    `update_weights(weight_seed)` on every twin. `delay_cycles`: on cuda, queue a sleep kernel of
    that many cycles on the current stream before the step, and one ahead of every asynchronous
    host copy and event record of the stressed twin's step, on whichever stream it runs, or,
    with `late="compute"`, on the current stream as the step begins and ahead of every graph
    replay instead (`stream_delays`): the other order of a race, a copy overwriting what a replay
    or an eager forward still reads; with `late="host"`, sleep nowhere and make every asynchronous
    copy between host and device land before the host goes on (`landed_copies`): a host write
    into a copy's source after the copy was queued then never reaches the device (`delay_cycles`
    only switches it on, `held_stream` is not used); `held_stream`: with `delay_cycles`, hold
    back only the step's `held_stream`-th stream (counted in the order the step first delays work
    on it; the harness takes it modulo the most streams the runner's earlier delayed steps met)
    and no other, so that a race between two streams shows (None: every stream);
    `scheduler_seed`: on sim, reseed the stream scheduler (both when not None).
    Poisoning needs no field: it happens before every step.

    `pipelined`: the harness submits the next step to the graph twin before it reads anything of
    the step before, as engines that overlap scheduling with execution do, and judges both once
    the second has returned (docs/contract.md, "Pipelined pairs"). Between the two submissions it
    only delays, so a pipelined stress carries no churn and no weight update: both write device
    memory the step in flight may still use, which the harness cannot order for the runner.
    """

    churn: int = 0
    weight_seed: int | None = None
    delay_cycles: int = 0
    scheduler_seed: int | None = None
    pipelined: bool = False
    late: Late = "copies"
    held_stream: int | None = None

    def __post_init__(self) -> None:
        if self.late not in LATE:
            raise ValueError(f"Stress.late={self.late!r}; use one of {LATE}")
        if self.held_stream is not None and self.held_stream < 0:
            raise ValueError(f"Stress.held_stream={self.held_stream} must be >= 0 or None")
        if self.pipelined and (self.churn or self.weight_seed is not None):
            raise ValueError(
                f"Stress(pipelined=True) takes only delay_cycles and scheduler_seed, got "
                f"churn={self.churn}, weight_seed={self.weight_seed}: the harness cannot order "
                f"its writes after the step still in flight"
            )

    @property
    def active(self) -> bool:
        return self != Stress()


@dataclass(frozen=True)
class Reset:
    """Starts the next example on twins already made (docs/contract.md, "Kept twins"): every
    twin's `state()` is restored from the copy taken when the twins were made, torch's global
    generator and the sim's stream scheduler are reseeded with `seed`, and the graphs captured so
    far stay captured. Found in the replay snippet of a failure that needed the examples before
    it on the same twins."""

    seed: int


@dataclass(frozen=True)
class StepPlan:
    """One step in abstract form; `BlockScheduler.compile` makes it concrete.

    `rows`: wanted number of requests (capped by what is ready and by the spec's limits).
    `finish` / `preempt`: indices into the live requests (modulo their count) to retire or to
    preempt (blocks freed, the request recomputes from scratch later). `spec_k` draft tokens and
    `accepted` of them kept, for "spec" steps. `chunk`: largest prefill chunk. `rotate`: row order
    offset, so a request moves between rows from step to step. `uneven`: a "spec" step's rows
    propose different draft counts, as a proposer that finds more for some requests than for
    others does (n-gram matching, a draft model stopping early): its row i proposes
    `(spec_k - i - rotate) mod (spec_k + 1)`, none included (a plain decode row among drafting
    ones); else every row proposes `spec_k` (each within what its request and the step can hold).
    """

    kind: StepKind
    rows: int
    arrivals: tuple[Arrival, ...] = ()
    finish: tuple[int, ...] = ()
    preempt: tuple[int, ...] = ()
    spec_k: int = 1
    accepted: int = 0
    chunk: int = 4
    rotate: int = 0
    stress: Stress = Stress()
    uneven: bool = False

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"StepPlan.kind={self.kind!r}; use one of {STEP_KINDS}")
        if self.rows < 1 or self.chunk < 1 or self.spec_k < 1:
            raise ValueError("StepPlan.rows, chunk and spec_k must be >= 1")
        if not 0 <= self.accepted <= self.spec_k:
            raise ValueError(f"StepPlan.accepted={self.accepted} outside [0, {self.spec_k}]")
