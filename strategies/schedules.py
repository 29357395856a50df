"""Hypothesis strategies for step plans and whole schedules, derived from a `TargetSpec`.

Row counts are drawn mostly next to capture sizes (c - 2 to c + 1), so consecutive steps cross
bucket boundaries in both directions (3 -> 9 -> 2 requests) and most steps have padding rows;
prompt lengths sit often on a block boundary or at the per-request block limit (the longest
context a request may have), a quarter of them anywhere up to it, and prompt lengths and chunks
reach past the largest capture size, so some steps must take the eager path. Consecutive steps of
the same size but another kind, query length or adapter mix are what probe an incomplete graph
key.
Schedules whose swarm switches admissions and regrouping off drain from their tail instead
(`swarm.SHAPES`): a departed request's row becomes a padding row of the same graph.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

from hypothesis import strategies as st

from pytest_graphmode.contract import Batch, TargetSpec
from pytest_graphmode.strategies.plans import (
    STEP_KINDS,
    Arrival,
    Late,
    StepKind,
    StepPlan,
    Stress,
)
from pytest_graphmode.strategies.scheduler import compile_schedule
from pytest_graphmode.strategies.swarm import EVERYTHING, Swarm, swarms

# Adapter ids beside the base (0): the first few, so that rows and steps share an adapter often
# and a graph that serves one adapter meets another, and the highest, at the end of any table of
# adapters a runner keeps.
_LOW_ADAPTERS = 3
# A temperature baked in at capture changes a sampled token more often the further the true one
# lies from it (padding rows and many captures hold 1.0).
TEMPERATURES = (0.25, 0.5, 1.0, 2.0, 4.0)
MAX_SPEC_K = 4  # draft tokens a speculative step proposes at most
DELAY_CYCLES = 2_000_000  # long enough that an unsynchronised copy stream visibly lags behind
# Which stream a delay holds back: every one (what shrinking tends to), or one of the first three a
# step uses (a compute, a copy and an output stream cover the runners seen so far; the harness
# takes it modulo the streams a runner's earlier delayed steps met, `stream_delays.StreamsMet`).
HELD_STREAMS = (None, 0, 1, 2)
# What a delayed step that is not half of a pipelined pair makes late: its copies, or the host
# (a copy issued then overwritten on the host within the step). Its computation only matters to
# a step after it, which a pair has.
ONE_STEP_LATE: tuple[Late, ...] = ("copies", "host")
# What a delayed pair makes late: each shows one order of a race between its two steps. A late
# host would land the first step's copies before the second step's host code could overwrite
# their sources, hiding the race a pair is for; single steps draw it.
PAIR_LATE: tuple[Late, ...] = ("copies", "compute")


def context_capacity(spec: TargetSpec) -> int:
    """The most tokens one request's context may hold: its block limit, or the pool's blocks."""
    return min(spec.max_blocks_per_req, spec.num_blocks - 1) * spec.block_size


def boundary_row_counts(spec: TargetSpec) -> list[int]:
    """The request counts next to each capture size c, with 1 and the most a step may hold: c + 1
    (the next bucket up, or the eager path), c (no padding), c - 1 (one padding row) and c - 2
    (two). Two padding rows are the fewest in which a padding row follows another: a value a
    padding row takes from the row before it (where its queries start, for one) then comes from
    padding, which a runner may have left as an earlier, larger batch wrote it."""
    edges = {c + d for c in spec.capture_sizes for d in (-2, -1, 0, 1)} | {1, spec.max_num_reqs}
    return sorted(n for n in edges if 1 <= n <= spec.max_num_reqs)


def row_counts(spec: TargetSpec) -> st.SearchStrategy[int]:
    """Request counts, half of them from `boundary_row_counts`."""
    near = boundary_row_counts(spec)
    return st.one_of(st.sampled_from(near), st.integers(1, spec.max_num_reqs))


def arrivals(spec: TargetSpec) -> st.SearchStrategy[Arrival]:
    capacity = context_capacity(spec)
    largest = spec.capture_sizes[-1] if spec.capture_sizes else 1
    long_prompt = min(capacity, max(largest + 1, 2 * spec.block_size))
    # One token either side of a block boundary, and at the block limit: the last blocks of the
    # table fill (and its last column is used) only for requests that long.
    size = spec.block_size
    edges = sorted(
        n
        for n in {size - 1, size, size + 1, capacity - 2, capacity - 1, capacity}
        if 1 <= n <= capacity
    )
    seeds = st.none()
    if "sampling" in spec.features:
        seeds = st.one_of(st.none(), st.integers(0, 2**31 - 1))
    adapters = st.sampled_from(adapter_ids(spec)) if "adapters" in spec.features else st.just(0)
    return st.builds(
        Arrival,
        prompt_len=st.one_of(
            st.integers(1, min(capacity, 2 * spec.block_size)),
            st.integers(1, long_prompt),
            st.sampled_from(edges),
            # Anywhere up to the block limit: a request that starts there decodes on graphs at
            # contexts no short prompt reaches within a schedule (past a sliding window, a
            # ring's wrap or a short rotary table), and has steps left to do so.
            st.integers(1, capacity),
        ),
        seed=seeds,
        temperature=st.sampled_from(TEMPERATURES),
        adapter=adapters,
    )


def adapter_ids(spec: TargetSpec) -> tuple[int, ...]:
    """The adapter ids arrivals draw from: the base, the first few adapters and the last one."""
    return tuple(sorted({*range(min(spec.num_adapters, _LOW_ADAPTERS) + 1), spec.num_adapters}))


def arrival_lists(spec: TargetSpec) -> st.SearchStrategy[list[Arrival]]:
    """None, a few of any length, or a crowd of short prompts: a crowd is what lets decode steps
    grow past the larger buckets (3 -> 9 -> 2 requests) within a dozen steps. A crowd's size is a
    row count, mostly next to a capture size, so the decode steps it starts are padded."""
    return st.one_of(st.just([]), st.lists(arrivals(spec), max_size=4), crowds(spec))


def crowds(spec: TargetSpec) -> st.SearchStrategy[list[Arrival]]:
    """Requests with short prompts (`crowd_prompt_len`), as many as a row count. With blocks
    longer than 4 slots, half of the crowds keep every prompt at 1-3 tokens (`reach=False`): a
    crowd's opening prefill of such prompts is a mixed batch of few tokens a request, which a
    runner that judges a batch uniform from its token total alone replays on a decode graph."""
    size = spec.block_size
    if size <= 4:
        return _crowds(spec, True)
    return st.booleans().flatmap(functools.partial(_crowds, spec))


@functools.lru_cache(maxsize=256)
def _crowds(spec: TargetSpec, reach: bool) -> st.SearchStrategy[list[Arrival]]:
    size = spec.block_size
    short = arrivals(spec).map(
        lambda a: dataclasses.replace(a, prompt_len=crowd_prompt_len(a.prompt_len, size, reach))
    )
    sized = {n: st.lists(short, min_size=n, max_size=n) for n in range(1, spec.max_num_reqs + 1)}
    if reach:  # a crowd kept short stays short: its opening prefill is few tokens a request
        sized = {n: _led(crowd, spec, n) for n, crowd in sized.items()}
    return row_counts(spec).flatmap(sized.__getitem__)


def _led(
    crowd: st.SearchStrategy[list[Arrival]], spec: TargetSpec, n: int
) -> st.SearchStrategy[list[Arrival]]:
    """`crowd`, or (half of the time) the same with one member, at a drawn place, given a long
    prompt, up to the block limit. A crowd's decode-only steps are where a runner that graphs
    decode batches replays most; with short prompts alone those replays never see a long context
    (past a sliding window, a ring cache's wrap, a rotary table's end), which no later step
    reaches within a schedule either. A crowd past the step's token budget is prefilled over as
    many opening steps as it takes (`_first_then`)."""
    longest, longest_short = context_capacity(spec), longest_crowd_prompt(spec.block_size)
    if longest <= longest_short or "prefill" not in spec.features:
        return crowd  # without prefill a long prompt takes a step a token
    leader = st.tuples(st.integers(0, n - 1), st.integers(longest_short + 1, longest))
    return st.tuples(crowd, st.one_of(st.none(), leader)).map(_with_leader)


def _with_leader(drawn: tuple[list[Arrival], tuple[int, int] | None]) -> list[Arrival]:
    crowd, leader = drawn
    if leader is None:
        return crowd
    place, prompt_len = leader
    return [
        dataclasses.replace(a, prompt_len=prompt_len) if i == place else a
        for i, a in enumerate(crowd)
    ]


def crowd_prompt_len(drawn: int, block_size: int, reach: bool = True) -> int:
    """A crowd member's prompt length, from an arrival's drawn one: 1-3 tokens, so that a crowd
    of many requests fits a step's token budget, and with blocks longer than 4 slots, for half of
    the members, the last 3 positions of the first block instead (`block_size - 2` to
    `block_size`). A decode-only schedule of a dozen steps advances a 1-3 token prompt by a dozen
    positions: with 16-slot blocks it would never cross into a second block, and a token that
    starts a new block is where a block table's new column, a slot mapping and a block count must
    all follow (`kv_writes_land`). With blocks of 4 slots or fewer, 1-3 tokens already reach the
    block's end, and the draws are what they always were. `reach=False`: 1-3 tokens whatever the
    block size (half of a long-block spec's crowds, `crowds`)."""
    short = 1 + drawn % 3
    if not reach or block_size <= 4 or drawn % 2:  # odd: short, as shrinking (towards 1) keeps it
        return short
    return block_size + 1 - short


def longest_crowd_prompt(block_size: int) -> int:
    """The longest prompt `crowd_prompt_len` gives a crowd that may reach a block's end."""
    return block_size if block_size > 4 else 3


def stresses(
    spec: TargetSpec, pipelined: bool = True, swarm: Swarm = EVERYTHING
) -> st.SearchStrategy[Stress]:
    """None (what shrinking tends to), stressors in lockstep, or (unless `pipelined` is False) a
    pipelined step: about one step in three is submitted before the harness reads the one before
    it. Only the stressors `swarm` leaves on are drawn."""
    weight_seeds = st.none()
    if "weight_update" in spec.features:
        weight_seeds = st.one_of(st.none(), st.integers(1, 2**16))
    delays, held_streams, scheduler_seeds = st.just(0), st.none(), st.none()
    lates: st.SearchStrategy[Late] = st.just("copies")
    if "delays" in swarm.stressors:
        # Three steps in four where delays are on: on cuda a race shows only on a delayed step
        # whose held stream is the late side of it (`HELD_STREAMS`). Shrinking goes to 0.
        delays = st.integers(0, 3).map(lambda n: DELAY_CYCLES if n else 0)
        held_streams = st.sampled_from(HELD_STREAMS)
        lates = st.sampled_from(ONE_STEP_LATE)
        scheduler_seeds = st.one_of(st.none(), st.integers(0, 2**16))
    active = st.builds(
        Stress,
        churn=st.integers(0, 3) if "churn" in swarm.stressors else st.just(0),
        weight_seed=weight_seeds,
        delay_cycles=delays,
        held_stream=held_streams,
        scheduler_seed=scheduler_seeds,
        late=lates,
    )
    # A pair's delay makes its copies land late, or its computation: on cuda each shows one order
    # of a race between the two steps (`stream_delays`).
    pairs = st.builds(
        Stress,
        pipelined=st.just(True),
        delay_cycles=delays,
        held_stream=held_streams,
        scheduler_seed=scheduler_seeds,
        late=st.sampled_from(PAIR_LATE),
    )
    active, pairs = active.map(without_idle_delay), pairs.map(without_idle_delay)
    if not pipelined or "pipelined" not in swarm.stressors:
        return st.one_of(st.just(Stress()), active)
    return st.one_of(st.just(Stress()), active, pairs)


def without_idle_delay(stress: Stress) -> Stress:
    """`stress` without the delay's settings where it has no delay: `held_stream` and `late`
    change nothing then, and left in they make a no-op count as a stressed step in the schedule
    and its replay snippet. Applied after the draw: a choice sequence draws the same steps as
    before."""
    if stress.delay_cycles:
        return stress
    return dataclasses.replace(stress, held_stream=None, late="copies")


def draft_counts(spec: TargetSpec, rows: int) -> st.SearchStrategy[int]:
    """Draft tokens per request of a speculative step of `rows` requests: any count up to
    `MAX_SPEC_K` (what shrinking tends to), or, half of the time, one that puts the step's tokens
    (1 + k a row) at or just below a capture size, or just past it. Drawn apart from the row
    count, the tokens of a speculative step meet a capture size seldom, and go just past the
    largest one hardly ever: a runner that keys its graphs by tokens pads them there, or runs a
    batch its graphs do not fit."""
    near = boundary_draft_counts(spec, rows)
    anything = st.integers(1, MAX_SPEC_K)
    return st.one_of(anything, st.sampled_from(near)) if near else anything


def boundary_draft_counts(spec: TargetSpec, rows: int) -> list[int]:
    """The draft counts (1 to `MAX_SPEC_K`) for which `rows` requests' tokens are the most that
    fit a capture size, or the fewest past it, within a step's token budget."""
    near: set[int] = set()
    for c in spec.capture_sizes if rows else ():
        at_most = c // rows - 1  # the most drafts whose tokens fit c
        near |= {
            drafts
            for drafts in (at_most, at_most + 1)
            if 1 <= drafts <= MAX_SPEC_K and rows * (1 + drafts) <= spec.max_num_tokens
        }
    return sorted(near)


def step_kinds(spec: TargetSpec) -> st.SearchStrategy[StepKind]:
    """Mostly decode: the shape graphs serve; the other kinds probe key fields and fallbacks."""
    others = [
        k for k in STEP_KINDS if k != "decode" and (k != "spec" or "spec_decode" in spec.features)
    ]
    return st.one_of(st.just("decode"), st.sampled_from(others))


def decode_kinds(spec: TargetSpec) -> st.SearchStrategy[StepKind]:
    """The decode-shaped kinds: requests that are past their prompt, one token each or with
    speculative drafts."""
    if "spec_decode" in spec.features:
        return st.sampled_from(("decode", "spec"))
    return st.just("decode")


@dataclass(frozen=True)
class _PlanStrategies:
    """The strategies one step plan draws from, for one spec, swarm and `pipelined`."""

    kind: st.SearchStrategy[StepKind]
    rows: st.SearchStrategy[int]
    arrivals: st.SearchStrategy[list[Arrival]]
    finish: st.SearchStrategy[list[int]]
    preempt: st.SearchStrategy[list[int]]
    spec_k: tuple[st.SearchStrategy[int], ...]  # by the step's rows
    accepted: tuple[st.SearchStrategy[int], ...]  # by spec_k
    chunk: st.SearchStrategy[int]
    rotate: st.SearchStrategy[int]
    stress: st.SearchStrategy[Stress]


Role = Literal["any", "opening", "steady"]
"""A step's place in its schedule: `any` step of a schedule that admits requests at every step;
with admissions switched off, the `opening` step admits a crowd of short prompts and prefills them
whole, and every `steady` step after it is decode-shaped, admits nothing and preempts nothing."""


@functools.lru_cache(maxsize=256)
def _plan_strategies(
    spec: TargetSpec, pipelined: bool, swarm: Swarm, role: Role = "any"
) -> _PlanStrategies:
    """Built once per spec and swarm, not once per step: Hypothesis validates every strategy
    object the first time it draws from it and works out its properties (can it be empty, are its
    values reusable) by walking it, which cost more than the draws themselves when each of a
    schedule's plans built its strategies anew. The draws are the same either way."""
    spec = swarm.spec(spec)
    largest = spec.capture_sizes[-1] if spec.capture_sizes else 1
    kind, rows, arrived = step_kinds(spec), row_counts(spec), arrival_lists(spec)
    chunk = st.one_of(st.integers(1, largest), st.integers(1, spec.max_num_tokens))
    rotate = st.integers(0, 63)
    finish, preempt = (
        st.lists(st.integers(0, 63), max_size=2),
        st.lists(st.integers(0, 63), max_size=1),
    )
    if role == "opening":
        kind, rows, arrived = st.just("prefill"), st.just(spec.max_num_reqs), crowds(spec)
        chunk = st.just(spec.max_num_tokens)
    elif role == "steady":
        # A preempted request computes its prompt again, and once every request has finished a
        # new one is admitted: both are prefills. Requests finish one at a time at most.
        kind, arrived = decode_kinds(spec), st.just([])
        finish, preempt = st.lists(st.integers(0, 63), max_size=1), st.just([])
        if swarm.drains:
            # Draining: every live request decodes one token, in admission order (rotation 0),
            # and the last one (index -1, modulo the live count) finishes before the step or
            # stays. Plain decode, so that a runner that graphs nothing else replays every step
            # (speculative steps three in four instead: the stale row slower to find, measured).
            kind, rows, rotate = st.just("decode"), st.just(spec.max_num_reqs), st.just(0)
            finish = st.one_of(st.just([]), st.just([-1]))
    return _PlanStrategies(
        kind=kind,
        rows=rows,
        arrivals=arrived,
        finish=finish,
        preempt=preempt,
        spec_k=tuple(draft_counts(spec, rows) for rows in range(spec.max_num_reqs + 1)),
        accepted=tuple(st.integers(0, k) for k in range(MAX_SPEC_K + 1)),
        chunk=chunk,
        rotate=rotate,
        stress=stresses(spec, pipelined, swarm),
    )


@st.composite
def step_plans(
    draw: st.DrawFn,
    spec: TargetSpec,
    pipelined: bool = True,
    swarm: Swarm = EVERYTHING,
    role: Role = "any",
) -> StepPlan:
    """One step; its features and stressors are those of `spec` that `swarm` leaves on, its
    kind and arrivals those of its `role`."""
    parts = _plan_strategies(spec, pipelined, swarm, role)
    kind, rows = draw(parts.kind), draw(parts.rows)
    spec_k = draw(parts.spec_k[min(rows, spec.max_num_reqs)])
    return StepPlan(
        kind=kind,
        rows=rows,
        arrivals=tuple(draw(parts.arrivals)),
        finish=tuple(draw(parts.finish)),
        preempt=tuple(draw(parts.preempt)),
        spec_k=spec_k,
        accepted=draw(parts.accepted[spec_k]),
        chunk=draw(parts.chunk),
        rotate=draw(parts.rotate),
        stress=draw(parts.stress),
        # Drawn last, and for speculative steps only: the draws of every other step stay as
        # they were. Even shrinks first: the simpler schedule.
        uneven=kind == "spec" and draw(st.booleans()),
    )


def schedules(
    spec: TargetSpec, max_steps: int = 12, *, pipelined: bool = True
) -> st.SearchStrategy[list[StepPlan]]:
    """Lists of 1..max_steps plans, each list with its own swarm (`swarm.py`: a random part of
    the features and stressors switched off for the whole schedule); any such list compiles to
    legal batches. `pipelined=False` draws no pipelined pairs: every step runs in lockstep."""
    if max_steps < 1:
        raise ValueError(f"max_steps={max_steps} must be >= 1")
    return swarms(spec).flatmap(functools.partial(_plan_lists, spec, pipelined, max_steps))


@functools.lru_cache(maxsize=256)
def _plan_lists(
    spec: TargetSpec, pipelined: bool, max_steps: int, swarm: Swarm
) -> st.SearchStrategy[list[StepPlan]]:
    """One schedule's plans under `swarm`; built once per swarm (see `_plan_strategies`). With
    admissions switched off, only the first step admits requests (`swarm.SHAPES`)."""
    if "admissions" in swarm.shapes:
        return st.lists(step_plans(spec, pipelined, swarm), min_size=1, max_size=max_steps)
    # At least one steady step where there is room: a schedule of the opening step alone would
    # only prefill, which a runner that graphs decode steps runs eagerly. A draining batch gets
    # three: it loses a row in about half of its steps, and a row it lost is padding only in a
    # step after that.
    fewest = 3 if swarm.drains else 1
    steady = st.lists(
        step_plans(spec, pipelined, swarm, "steady"),
        min_size=min(fewest, max_steps - 1),
        max_size=max_steps - 1,
    )
    opening = step_plans(spec, pipelined, swarm, "opening")
    then = functools.partial(_first_then, swarm.spec(spec), max_steps, fewest)
    return st.tuples(opening, steady).map(then)


def _first_then(
    spec: TargetSpec, max_steps: int, fewest: int, parts: tuple[StepPlan, list[StepPlan]]
) -> list[StepPlan]:
    """The opening step, the prefill steps that finish its crowd's prompts where they are more
    than one step's token budget (a crowd with a long prompt: the steady steps after it are
    decode-shaped and would never prefill the rest), then the steady steps: no fewer than
    `fewest` where the schedule drew them, no more than `max_steps` in all."""
    opening, steady = parts
    more = 0
    if "prefill" in spec.features:
        tokens = sum(arrival.prompt_len for arrival in opening.arrivals)
        room = max_steps - 1 - min(len(steady), fewest)
        more = max(0, min(-(-tokens // spec.max_num_tokens) - 1, room))
    prefill = StepPlan(kind="prefill", rows=spec.max_num_reqs, chunk=spec.max_num_tokens)
    return [opening, *[prefill] * more, *steady[: max_steps - 1 - more]]


@st.composite
def batch_lists(draw: st.DrawFn, spec: TargetSpec, max_steps: int = 12) -> list[Batch]:
    """Consecutive legal batches for one fresh target (stressors left out), for `@given` tests
    that drive a runner directly rather than through the lockstep driver."""
    plans = [dataclasses.replace(p, stress=Stress()) for p in draw(schedules(spec, max_steps))]
    events = compile_schedule(spec, plans, seed=draw(st.integers(0, 2**31 - 1)))
    return [e for e in events if isinstance(e, Batch)]
