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
MAX_LEADING_STEPS = 12  # a fixed leading example longer than this is left out
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
# A step whose asynchronous copies between host and device land, on cuda, before its host code
# goes on.
_HOST_LATE = Stress(delay_cycles=DELAY_CYCLES, late="host")


def _capacity(spec: TargetSpec) -> int:
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
    capacity = _capacity(spec)
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
    longest, longest_short = _capacity(spec), longest_crowd_prompt(spec.block_size)
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


def first_pair(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule whose pipelined pairs run an eager step then a graph step, and two
    decode steps: a request is admitted with a two-token prompt (one token without the "prefill"
    feature) and prefilled, its first decode step submitted before the prefill is read; then two
    more decode steps the same way, twice. A campaign runs it as its first example: Hypothesis's
    own first example is its simplest draw, a single step, and a race between two steps (an event
    not waited for, a staging buffer rewritten while the step before still reads it) needs two
    steps that both run on the device, the one before mostly eager (a prefill: most runners graph
    decode steps only) or a graph replay.

    It is not what `schedules` draws first because shrinking moves towards the simplest draw: were
    a pair the simplest, every shrunk schedule would keep one, and a bug of one step would be
    reported with three.

    The pairs are delayed (on cuda, `stress.delay_cycles`; nothing changes on sim), so that on the
    GPU the first step is still in flight when the second is prepared, as the race needs: in the
    first two pairs its copies and event records land late (a replay that does not wait for its
    upload reads the inputs before they land, a host that rewrites pinned staging too early
    changes what is still to be copied: after an eager step too, where a runner orders the
    staging of its eager steps otherwise than its replays'), in the last its computation does,
    eager kernels and graph replays (an upload that does not wait for the work before it
    overwrites the inputs that work is still to read)."""
    single = StepPlan(kind="decode", rows=1)
    pairs = [
        dataclasses.replace(
            single, stress=Stress(pipelined=True, delay_cycles=DELAY_CYCLES, late=late)
        )
        for late in PAIR_LATE
    ]
    prompt = 2 if "prefill" in spec.features else 1
    opening = StepPlan(kind="prefill", rows=1, arrivals=(Arrival(prompt_len=prompt),))
    return [opening, pairs[0], single, pairs[0], single, pairs[1]]


def first_phase_change(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a graph replay is still in flight when an eager step
    starts, a graph captured before a weight update replays after it, and a graph captured on a
    short context replays on the longest. A campaign runs it as its second example, after
    `first_pair`, on the same twins.

    A request with a one-token prompt is admitted and decoded. The next step admits a second
    request, whose prompt leaves room for two tokens below the per-request block limit, and
    prefills it, pipelined with that decode (and delayed, as `first_pair` is): a runner that runs
    prefills on a stream of its own, or rewrites a buffer the replay still reads, races there.
    Where the step's token budget does not take the prompt whole, the steps after the pair
    prefill the rest beside the first request's decode (with the prompt shortened where that
    would take the schedule past `MAX_LEADING_STEPS`). Then the weights change (where the spec
    updates weights; delayed too, so that on cuda a loader racing its own pinned staging loads
    other weights into the graph twin) and the first request decodes alone, on the graph
    captured before the change; the two decode together; the long request decodes alone, on the
    graph the short one was captured with; and (where the spec has speculative decoding) the
    short one decodes a draft token, a step with the request count of one graph and the token
    count of another. A random schedule holds these rarely: half of them switch weight updates
    off, a quarter switch pipelined pairs off, most pairs join two steps of the same phase, and
    most prompts are short."""
    capacity = _capacity(spec)
    whole = spec.max_num_tokens
    chunk = _prefill_chunk(spec)
    # Where the budget does not take the prompt whole, the rest is prefilled in the steps after
    # the pair, beside the first request's decode (a request absent from a step is a finished one
    # to some runners); at most as many steps as keep the schedule within MAX_LEADING_STEPS, the
    # prompt shortened to what they hold.
    beside = spec.max_num_reqs >= 2 and whole >= 2
    per_step = min(chunk, whole - 1) if beside else chunk
    most = MAX_LEADING_STEPS - 7  # the schedule's seven other steps, the speculative one included
    prompt = min(max(1, capacity - 2), chunk + most * per_step)
    rest = -(-(prompt - min(prompt, chunk)) // per_step)
    long_prompt = Arrival(
        prompt_len=prompt,
        seed=1 if "sampling" in spec.features else None,
        temperature=0.5,
    )
    # Delayed (on cuda): a weight loader whose copies out of pinned staging race its own host
    # writes then loads other weights into the graph twin than into the references.
    update = (
        Stress(weight_seed=1, delay_cycles=DELAY_CYCLES)
        if "weight_update" in spec.features
        else Stress()
    )
    pair = Stress(pipelined=True, delay_cycles=DELAY_CYCLES)
    # Two tokens of one request: as many requests as the last graph of one-token rows, as many
    # tokens as the two-request one, so a key without the query length replays one of them.
    speculative = (
        [StepPlan(kind="spec", rows=1, spec_k=1, accepted=1)]
        if "spec_decode" in spec.features
        else []
    )
    return [
        StepPlan(kind="decode", rows=1),
        StepPlan(kind="decode", rows=1),
        StepPlan(kind="prefill", rows=1, arrivals=(long_prompt,), chunk=chunk, stress=pair),
        *[StepPlan(kind="mixed" if beside else "prefill", rows=2, chunk=chunk)] * rest,
        StepPlan(kind="decode", rows=1, stress=update),
        StepPlan(kind="decode", rows=2),
        StepPlan(kind="decode", rows=1, rotate=1),
        *speculative,
    ]


def _prefill_chunk(spec: TargetSpec) -> int:
    """The most prompt tokens one step of a leading example prefills: the step's token budget, or
    one without the "prefill" feature (the scheduler feeds such prompts a token a step)."""
    return spec.max_num_tokens if "prefill" in spec.features else 1


def first_partial_bucket(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a graph captured with a padding row replays a full batch,
    and then a batch with a padding row again. A campaign runs it as its third example, after
    `first_phase_change`, on the same twins.

    With n = min(4, the most requests a step may hold): n - 1 requests with one-token prompts are
    admitted and decode together (a graph of n rows captured for n - 1 of them, with captured sizes
    1, 2, 4, ...); the n-th request is admitted (sampled, where the spec samples) and the n decode
    together, on that graph; then n - 1 of them again, rows rotated, in two steps. A value the
    runner read on the host at capture (the rows a kernel appends to the cache, whether any row
    samples) replays for the full batch as it was for the partial one, and a padding row the
    runner does not reset keeps the full batch's last row. The second of the two steps continues
    the first (the same requests in the same rows, a token further): a runner that advances a
    continuing batch's inputs on the device instead of preparing them on the host (multi-step
    decoding, a step that overlaps the next one's preparation) advances the padding row too,
    from the full batch's stale row, only there. A random schedule seldom grows a batch within one
    captured size, with the batch it was captured for as its first, and seldom continues a batch
    that shrank within one.

    Where a step may hold more requests than the largest captured size, more one-token requests
    then join and all of them decode together, one request past that size: a batch that no
    captured graph fits, which a runner that clamps its lookup to the largest graph replays on
    it (rows past it neither computed nor written to the cache). A random schedule reaches it
    only once enough requests live at once, which drawn schedules seldom hold in a campaign's
    first hundred examples. Empty where a step holds one request."""
    n = min(4, spec.max_num_reqs)
    if n < 2:
        return []
    sampled = Arrival(prompt_len=1, seed=2 if "sampling" in spec.features else None)
    return [
        StepPlan(kind="prefill", rows=n - 1, arrivals=(Arrival(prompt_len=1),) * (n - 1)),
        StepPlan(kind="decode", rows=n - 1),
        StepPlan(kind="prefill", rows=1, arrivals=(sampled,)),
        StepPlan(kind="decode", rows=n),
        StepPlan(kind="decode", rows=n - 1, rotate=1),
        StepPlan(kind="decode", rows=n - 1, rotate=1),
        *_past_the_largest_graph(spec, live=n),
    ]


def first_front_departure(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a request leaves the batch's first row while the requests
    admitted after it stay, and one of those then starts a new block and samples. A campaign runs
    it as its fourth example, after `first_partial_bucket`, on the same twins.

    Three requests are admitted in turn: A, greedy, two blocks long (a prompt one token past the
    first block); B, greedy, one token; C, two slots short of one block (sampled at temperature 2
    where the spec samples, and with an adapter where the spec has them). The step that prefills
    B and C decodes A too (A absent from a step would be a finished request to a runner whose
    scheduler sends only what changed), and so does every step that has to go on with C's
    prefill within the token budget. Then all three decode; then A finishes and B and C decode,
    C in its first block's last slot; then B and C decode again, and C's token starts its second
    block. A runner that closes the hole A left by moving C into A's row (or by shifting B and C
    down) must move every per-row value with it: a block count left as A's puts C's new block in
    the wrong column of the block table (`kv_writes_land`); a greedy flag, seed or temperature
    left as A's samples C's token otherwise than the company twin, which runs C without A
    (`sampling_independent`: A is greedy so that it is not in that twin's batch, where the same
    move would leave C the same wrong values). A random schedule seldom holds this with blocks
    longer than a few slots: a request that survives a departure must then start a new block,
    which a decode step of 16-slot blocks does once in 16 steps. Empty where a step
    holds fewer than three requests, a request fewer than two blocks, or the cache fewer than the
    five blocks the schedule holds at once, and where the prompts would take more than
    `MAX_LEADING_STEPS` steps (long blocks without the "prefill" feature: one token a step)."""
    size, budget = spec.block_size, spec.max_num_tokens
    fits = (
        size >= 2
        and spec.max_num_reqs >= 3
        and min(spec.max_blocks_per_req, spec.num_blocks - 1) >= 2
        and spec.num_blocks - 1 >= 5
    )
    if not fits:
        return []
    first = Arrival(prompt_len=size + 1)
    # C's prompt ends two slots short of its block's end, so that its token starts the next block
    # in the second step after A left, not in the step A leaves (with 2-slot blocks, one short:
    # the three then decode together only in the mixed step).
    together = [StepPlan(kind="decode", rows=3)] if size >= 3 else []
    later = Arrival(
        prompt_len=size - 1 - len(together),
        seed=4 if "sampling" in spec.features else None,
        temperature=2.0,
        adapter=1 if "adapters" in spec.features else 0,
    )
    # A's prefill alone, then C's beside A's and B's one token each, in as many steps as the
    # budget takes (one token a step without the "prefill" feature).
    chunk = _prefill_chunk(spec)
    prefill_a = -(-first.prompt_len // chunk)
    prefill_c = -(-later.prompt_len // min(chunk, budget - 2))
    plans = [
        StepPlan(kind="prefill", rows=1, arrivals=(first,), chunk=chunk),
        *[StepPlan(kind="prefill", rows=1, chunk=chunk)] * (prefill_a - 1),
        StepPlan(kind="mixed", rows=3, arrivals=(Arrival(prompt_len=1), later), chunk=chunk),
        *[StepPlan(kind="mixed", rows=3, chunk=chunk)] * (prefill_c - 1),
        *together,
        StepPlan(kind="decode", rows=2, finish=(0,)),
        StepPlan(kind="decode", rows=2),
    ]
    return plans if len(plans) <= MAX_LEADING_STEPS else []


def first_stale_tail(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a batch shrinks within one captured graph while its queries
    grow: the padding rows of a speculative step follow a larger decode batch on the same graph.
    A campaign runs it as its fifth example, after `first_front_departure`, on the same twins.

    c one-token requests are admitted and decode together on the graph of c rows, c the smallest
    capture size whose bucket also serves c - 2 requests (two padding rows; one where no capture
    size leaves two). Then the last two finish and the other c - 2 run a speculative step, each
    with the most draft tokens (up to 3) that keep c rows of them within the token budget, padded
    to the same c rows (fewer drafts where the step's tokens would fill a capture size exactly,
    so that a graph keyed by token count is padded too: `_stale_tail_drafts`). Every per-row value staged for a padding row (where its queries start and
    end, its sequence length, its block-table row) is then whatever the decode step left there,
    unless the runner rewrites it: where queries start, for one, a decode step leaves one token
    a row apart, so a stale padding row's query range reaches back into the valid requests' tokens.
    A value the runner stages once and uploads whole (a pinned host buffer, say) cannot be
    poisoned by the harness, so only a schedule shows it; a random one holds a larger batch then a
    padded speculative one on the same graph seldom, since row counts change at most steps.
    Without speculative decoding the last step decodes one token a row.

    The speculative step accepts about half of its drafts (none of one), and the same rows then
    decode one token each: each row's position and slot move back from where the drafts reached
    to where the accepted ones end. A runner that carries positions from step to step (advancing
    them on the device where a batch seems to continue the last, or rolling back only when every
    draft is rejected) writes that token's KV at the wrong slot. A random schedule seldom
    follows a partly rejected speculative step with a decode of exactly its rows.

    The steps after the prefill make the host late on cuda (`Stress.late="host"`): every
    asynchronous copy between host and device has landed before the runner's host code goes on.
    A runner that writes its padding rows into pinned staging after queueing their upload then
    uploads what the step before left there, as a runner that never rewrites them does; undelayed,
    its host write mostly wins the race, and the bug shows by chance. Nothing changes on sim,
    whose race check sees such a write whichever order it lands in.
    Empty where no capture size leaves a padding row, or a step or the cache cannot hold the c
    requests."""
    rows = _shrunk_rows(spec)
    if rows is None:
        return []
    c, live = rows
    drafts = _stale_tail_drafts(spec, c, live) if "spec_decode" in spec.features else 0
    positions = 3 + drafts  # a one-token prompt, its first token, a decode step's, the drafts
    fits = (
        positions <= _capacity(spec)
        and c * _blocks(spec, 2) <= spec.num_blocks - 1
        and live * _blocks(spec, positions) <= spec.num_blocks - 1
    )
    if not fits:
        return []
    gone = (-1,) * (c - live)  # the last request, then the new last one
    if not drafts:
        return [
            StepPlan(kind="prefill", rows=c, arrivals=(Arrival(prompt_len=1),) * c),
            StepPlan(kind="decode", rows=c, stress=_HOST_LATE),
            StepPlan(kind="decode", rows=live, finish=gone, stress=_HOST_LATE),
        ]
    # Fewer positions than the drafts reached: a rejected draft's are taken again by the decode.
    return [
        StepPlan(kind="prefill", rows=c, arrivals=(Arrival(prompt_len=1),) * c),
        StepPlan(kind="decode", rows=c, stress=_HOST_LATE),
        StepPlan(
            kind="spec",
            rows=live,
            spec_k=drafts,
            accepted=drafts // 2,
            finish=gone,
            stress=_HOST_LATE,
        ),
        StepPlan(kind="decode", rows=live, stress=_HOST_LATE),
    ]


def first_handover(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which one graph serves requests with other per-request values in
    turn. A campaign runs it as its sixth example, after `first_stale_tail`, on the same twins.

    Three requests with one-token prompts take turns: each is admitted (the one before it
    finishing in the same step), then decodes alone. A samples at the lowest temperature drawn,
    on the first adapter; B samples at the highest, on the last adapter the spec declares; C is
    greedy, on the first adapter again (sampling and adapters where the spec has them). Their
    decode steps have one request each and, where the spec has adapters, each on one, so they
    run on one graph even where a runner keys its graphs by whether a batch uses adapters.
    Whatever the runner read from the batch on the host when it captured that graph (a
    temperature, a seed, whether a row samples, which adapter's weights to apply when the batch
    has only one) replays for B and C as it was. A random schedule seldom runs such a handover:
    per-request values are drawn per arrival, most decode steps hold several requests, and two
    requests alone on one graph in turn with different values need a departure and an admission
    between them.

    Then D, a one-token prompt, joins C listed before it: a batch of one-token rows whose new
    request comes first. A runner that orders its rows its own way (requests that continue a
    sequence first, as engines that reorder a batch for their kernels do) must give the results
    back in the batch's order; schedules list new requests last unless a step rotates its rows.

    Last (where the spec prefills), two prefill steps of the same padded token count c (the
    smallest even capture size of at least 4 a step may fill): c / 2 two-token prompts, then one
    prompt of c tokens. A graph captured for the first (its longest query 2, read on the host to size
    attention's query window, as varlen attention metadata's `max_query_len` is) replays the
    second as it was. Empty where the cache cannot hold one request's two positions."""
    if _blocks(spec, 2) > min(spec.max_blocks_per_req, spec.num_blocks - 1):
        return []
    seeds = (6, 7) if "sampling" in spec.features else (None, None)
    ids = adapter_ids(spec) if "adapters" in spec.features else (0,)
    first, last = ids[min(1, len(ids) - 1)], ids[-1]
    coldest, hottest = min(TEMPERATURES), max(TEMPERATURES)
    turns = (
        Arrival(prompt_len=1, seed=seeds[0], temperature=coldest, adapter=first),
        Arrival(prompt_len=1, seed=seeds[1], temperature=hottest, adapter=last),
        Arrival(prompt_len=1, temperature=coldest, adapter=first),
    )
    plans = []
    for turn, arrival in enumerate(turns):
        gone = (0,) if turn else ()  # the request before it, the only one live
        plans += [
            StepPlan(kind="prefill", rows=1, arrivals=(arrival,), finish=gone),
            StepPlan(kind="decode", rows=1),
        ]
    # C, then D admitted after it: rotated by one, D's row comes first.
    if spec.max_num_reqs >= 2:
        plans.append(StepPlan(kind="mixed", rows=2, arrivals=(Arrival(prompt_len=1),), rotate=1))
    return plans + _short_then_long_queries(spec, live=min(2, spec.max_num_reqs))


def first_stream_sweep(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which each of a step's first streams runs late alone. A campaign
    runs it as its seventh example, after `first_handover`, on the same twins.

    A request A (sampled where the spec samples, so its tokens differ from step to step) is
    admitted and prefilled; then, in each of three mixed steps, A decodes while a new request is
    admitted and prefilled (a two-token prompt; one token without the "prefill" feature), the
    newcomer of the step before finishing. A step that holds a decode row beside a prefill is
    where a runner that replays graphs for one-token rows and runs the rest eagerly uses the most
    streams: an upload stream, the compute stream, an output stream for the sampled tokens. The
    three mixed steps are delayed on cuda holding back only the step's stream 0, 1 and 2 in turn
    (`Stress.held_stream`; nothing changes on sim): a race between two streams, such as a
    download the host reads after waiting for another stream, shows only while the stream of its
    late side is held back alone. Random schedules draw the held stream per delayed step, and a
    mixed step delayed with the right one in about one in thirty. Empty where a step cannot hold
    two requests or the cache A's five positions beside a newcomer."""
    held = [k for k in HELD_STREAMS if k is not None]
    fits = (
        spec.max_num_reqs >= 2
        and spec.max_num_tokens >= 3
        and 2 + len(held) <= _capacity(spec)
        and _blocks(spec, 2 + len(held)) + 2 * _blocks(spec, 2) <= spec.num_blocks - 1
    )
    if not fits:
        return []
    first = Arrival(prompt_len=1, seed=8 if "sampling" in spec.features else None)
    prompt = 2 if "prefill" in spec.features else 1
    plans = [StepPlan(kind="prefill", rows=1, arrivals=(first,))]
    for turn, stream in enumerate(held):
        plans.append(
            StepPlan(
                kind="mixed",
                rows=2,
                arrivals=(Arrival(prompt_len=prompt),),
                finish=(1,) if turn else (),
                stress=_held_alone(stream),
            )
        )
    return plans


def first_graph_stream_sweep(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which each of a step's first streams runs late alone in decode
    steps on a graph: a request back from sitting out a step, then more requests than the largest
    graph. A campaign runs it as its tenth example, after `first_capture_on_long_contexts`, on the
    same twins.

    `first_stream_sweep` holds streams back in mixed steps, which most graph runners run eagerly
    or piecewise; a runner's decode replays have streams of their own around them. Two requests,
    A (sampled where the spec samples) and B, are admitted; then, three times, one of them decodes
    alone while the other sits the step out, and the two decode together on a graph, delayed on
    cuda with the step's stream 0, 1 and 2 held back alone in turn. The request back from sitting
    out is where a runner that reloads or restores what a request holds between its steps (KV
    blocks swapped out to host memory, a recurrent state, per-request buffers) does that work: a
    reload on a copy stream that the replay does not wait for lands late and overwrites what the
    replay wrote. Its contexts then (2, 3 and 5 positions with a two-token prompt) are not a
    multiple of 4, so its last block is partial and the step's token lands in a reloaded block.
    Then requests join until there is one more than the largest graph holds, and all of them
    decode three times, holding back stream 0, 1 and 2 in turn: a runner that replays one graph
    more than once per step (micro-batches) overlaps one replay's download or upload with the
    next replay there. A random schedule holds one given stream back alone in a step in about one
    step in sixteen, in the half of its examples whose swarm leaves delays on, and seldom holds a
    return step or a step past the largest graph so. The second half is left out where a step or
    the cache cannot hold that many requests; the whole is empty where a step cannot hold two
    requests or the cache their six positions each."""
    held = [k for k in HELD_STREAMS if k is not None]
    prompt = 2 if "prefill" in spec.features else 1
    positions = 2 * len(held)  # what A and B hold after their turns, at most
    returns_fit = (
        min(spec.max_num_reqs, spec.max_num_tokens) >= 2
        and spec.max_num_tokens >= 1 + prompt
        and positions <= _capacity(spec)
        and 2 * _blocks(spec, positions) <= spec.num_blocks - 1
    )
    if not returns_fit:
        return []
    seed = 10 if "sampling" in spec.features else None
    plans = [StepPlan(kind="prefill", rows=2, arrivals=(Arrival(1, seed=seed), Arrival(prompt)))]
    for turn, stream in enumerate(held):
        # rotated by the turn, A and B take turns sitting out; the one who sat out comes back
        alone = StepPlan(kind="decode", rows=1, rotate=turn % 2)
        together = StepPlan(kind="decode", rows=2, stress=_held_alone(stream))
        plans += [alone, together]
    return plans + _past_the_largest_graph_held(spec, held, live_positions=positions)


def _held_alone(stream: int) -> Stress:
    """A step delayed on cuda with only its `stream`-th stream held back."""
    return Stress(delay_cycles=DELAY_CYCLES, held_stream=stream)


def _past_the_largest_graph_held(
    spec: TargetSpec, held: list[int], live_positions: int
) -> list[StepPlan]:
    """Two live requests of up to `live_positions` positions are joined by one-token prompts
    until there is one more than the largest captured size, and all decode once for each stream
    in `held`, holding it back alone; empty where a step, a request or the cache cannot hold
    them."""
    past = max(spec.capture_sizes, default=0) + 1
    longest = live_positions + len(held)
    joining = past - 2
    fits = (
        spec.capture_sizes
        and 2 < past <= min(spec.max_num_reqs, spec.max_num_tokens)
        and longest <= _capacity(spec)
        and 2 * _blocks(spec, longest) + joining * _blocks(spec, 1 + len(held))
        <= spec.num_blocks - 1
    )
    if not fits:
        return []
    join = StepPlan(kind="prefill", rows=joining, arrivals=(Arrival(prompt_len=1),) * joining)
    return [join, *(StepPlan(kind="decode", rows=past, stress=_held_alone(k)) for k in held)]


def first_tokens_past_the_largest_graph(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule whose speculative step has the request count of a captured graph
    and more tokens than the largest one. A campaign runs it as its eighth example, after
    `first_stream_sweep`, on the same twins.

    R one-token requests are admitted and decode once, then run a speculative step with k draft
    tokens each, all accepted, and decode once more: k the fewest drafts (up to `MAX_SPEC_K`)
    for which R = largest capture size // (1 + k) + 1 requests fit a step, so that R * (1 + k)
    tokens are just past the largest capture size while R requests are as few as that allows. A
    runner that decides whether a batch fits a graph by its request count alone (and not by its
    tokens) replays the largest graph with the tokens past it cut off. A random schedule seldom
    holds it: the draft count is drawn apart from the row count, and most speculative steps hold a
    few rows.

    Then, where the cache holds k more positions a request, the same R requests run one more
    speculative step listed from the second admitted on, proposing k - 1 draft tokens down to
    none and then k again (`StepPlan.uneven`), none accepted: rows whose draft counts differ, in
    another order than the runner's rows may be. A runner that splits the step's flat logits into
    requests by counts taken in one order while its rows are laid out in another reads a
    neighbour's logits (vLLM PR 14645), which the twins share and only other company shows; a
    random schedule draws such a step seldom: half of its speculative steps are even, and most
    uneven ones hold one request or list their requests in the order the runner holds them.
    Empty without speculative decoding, where no such R and k fit a step's token budget and
    request limit, or where the cache cannot hold the R requests."""
    if "spec_decode" not in spec.features or not spec.capture_sizes:
        return []
    largest = spec.capture_sizes[-1]
    for drafts in range(1, MAX_SPEC_K + 1):
        rows = largest // (1 + drafts) + 1
        positions = 3 + drafts  # the prompt, the first decode, the drafts, the last decode
        fits = (
            rows <= spec.max_num_reqs
            and rows * (1 + drafts) <= spec.max_num_tokens
            and positions <= _capacity(spec)
            and rows * _blocks(spec, positions) <= spec.num_blocks - 1
        )
        if fits:
            plans = [
                StepPlan(kind="prefill", rows=rows, arrivals=(Arrival(prompt_len=1),) * rows),
                StepPlan(kind="decode", rows=rows),
                StepPlan(kind="spec", rows=rows, spec_k=drafts, accepted=drafts),
                StepPlan(kind="decode", rows=rows),
            ]
            if (
                positions + drafts <= _capacity(spec)
                and rows * _blocks(spec, positions + drafts) <= spec.num_blocks - 1
            ):
                # listed from the second admitted on; drafts - 1 down to none, then drafts again
                uneven = StepPlan(kind="spec", rows=rows, spec_k=drafts, rotate=1, uneven=True)
                plans.append(uneven)
            return plans
    return []


def first_capture_on_long_contexts(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a graph first captured for rows that are all long replays a
    batch with a short row. A campaign runs it as its ninth example, after
    `first_tokens_past_the_largest_graph` (its eighth where that one is left out), on fresh twins
    made for it wherever it falls (kept twins are also made again every `kept_twins.FRESH_EVERY`
    examples), so a runner that captures a graph the first time a batch needs it captures its
    graph of two rows here.

    Two requests with prompts four positions short of the per-request limit are admitted and
    prefilled together (half the step's token budget each, in as many steps as that takes), then
    decode together: the graph of two rows meets two long contexts first. Then the first one
    finishes and a one-token prompt is admitted beside the second one's decode, and the two decode
    together on that graph. A value the runner derived on the host from the capture batch as a
    lower bound (the first block a sliding window reads, the fewest blocks any row holds, a split
    of the context by its longest row that leaves the shortest one empty) replays for the short
    row as it was for the long ones. A random schedule holds this rarely: fresh twins' first graph
    steps mostly follow a crowd of short prompts, and `first_phase_change` captures on a short
    context before it replays the longest. Empty without the "prefill" feature (one token a step
    could not reach a long context within `MAX_LEADING_STEPS`), where a step holds fewer than two
    requests or tokens, or where the cache cannot hold the three requests.

    Where the spec samples, the two long requests sample (one at the lowest temperature, one at
    the highest) and the newcomer is greedy: the graph is captured on a batch with no greedy row,
    which a random schedule seldom captures on (half of its requests are greedy), and then
    replays a greedy one. A choice the runner made on the host from the capture batch's sampling
    (that every row samples, so the greedy branch can go, as an `all_random` flag says) replays
    for the greedy row as it was; `first_handover` shows the graph of one row the same.

    Where the spec has speculative decoding, the two long requests run one speculative step
    between their prompts and their first decode, proposing one draft each, none accepted: the
    first decode captures its graph on rows whose last step rejected a draft. A runner whose
    forward corrects its own inputs in place for the drafts the last step rejected (an overlap
    scheduler prepares a request as if every draft was accepted) and captures on the live batch
    after warm-up runs on the same inputs applies the correction once per run (TensorRT-LLM PR
    7373); a random schedule seldom captures right after a rejection (twins are fresh every
    eighth example, and most first captures follow a crowd of short prompts). The last decode
    then writes the per-request limit's last position."""
    room = 4  # positions after the prompt: the decodes (one short of the limit, or at it)
    budget = spec.max_num_tokens // 2
    if "prefill" not in spec.features or spec.max_num_reqs < 2 or budget < 1:
        return []
    # one draft a row, rejected: the first decode's capture follows a rejection
    rejected = [StepPlan(kind="spec", rows=2, spec_k=1)] if "spec_decode" in spec.features else []
    prefill_steps = MAX_LEADING_STEPS - 3 - len(rejected)
    prompt = min(_capacity(spec) - room, prefill_steps * budget)
    if prompt < 2 or 2 * _blocks(spec, prompt + room) + 1 > spec.num_blocks - 1:
        return []
    # Sampled where the spec samples, at the two ends of the temperatures, and the newcomer
    # greedy: the graph of two rows is captured on rows that all sample, then replays a greedy one.
    sampled = "sampling" in spec.features
    long = [
        Arrival(prompt_len=prompt, seed=seed if sampled else None, temperature=temperature)
        for seed, temperature in ((8, min(TEMPERATURES)), (9, max(TEMPERATURES)))
    ]
    return [
        StepPlan(kind="prefill", rows=2, arrivals=tuple(long), chunk=budget),
        *[StepPlan(kind="prefill", rows=2, chunk=budget)] * (-(-prompt // budget) - 1),
        *rejected,
        StepPlan(kind="decode", rows=2),
        StepPlan(kind="mixed", rows=2, finish=(0,), arrivals=(Arrival(prompt_len=1),)),
        StepPlan(kind="decode", rows=2),
    ]


def first_return_after_preemption(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a preempted request comes back and decodes on a graph. A
    campaign runs it as its eleventh example, after `first_graph_stream_sweep`, on the same
    twins.

    Two requests with one-token prompts, A (sampled where the spec samples) and B, are admitted
    and decode twice on a graph. Then A is preempted: B decodes beside C, a new one-token prompt
    that takes the blocks A freed. Then A comes back with `context_len` 0 and computes its four
    tokens again (one prefill chunk, or one token a step without the "prefill" feature) while B
    and C decode, and the three decode twice more on a graph. Whatever a runner keeps per request
    or per row and clears only when a request is new to it (counts of the tokens it produced for
    a repetition penalty, a speculative or recurrent state, a row's sampling values), or keeps
    from A's first life in a table or buffer (A's old block table row, now C's blocks), meets A's
    second life here. A random schedule preempts seldom, and more seldom still in a step
    followed by replays of the same requests. Empty where a step cannot hold three requests or
    the cache cannot hold them."""
    positions = 4  # A's prompt and the three tokens of its first life: what it computes again
    recompute = 1 if "prefill" in spec.features else positions
    longest = positions + recompute + 2  # B's positions by the last step, the longest
    fits = (
        min(spec.max_num_reqs, spec.max_num_tokens) >= 3
        and longest <= _capacity(spec)
        and 3 * _blocks(spec, longest) <= spec.num_blocks - 1
    )
    if not fits:
        return []
    seed = 9 if "sampling" in spec.features else None
    a_and_b = (Arrival(prompt_len=1, seed=seed), Arrival(prompt_len=1))
    plans = [
        StepPlan(kind="prefill", rows=2, arrivals=a_and_b),
        StepPlan(kind="decode", rows=2),
        StepPlan(kind="decode", rows=2),
        # A preempted; rotated by one, B and the newcomer C run, A (first in the list) waits.
        StepPlan(kind="mixed", rows=2, preempt=(0,), arrivals=(Arrival(prompt_len=1),), rotate=1),
    ]
    plans += [StepPlan(kind="mixed", rows=3, chunk=positions)] * recompute
    return plans + [StepPlan(kind="decode", rows=3)] * 2


def first_return_after_padded_steps(spec: TargetSpec) -> list[StepPlan]:
    """The simplest schedule in which a request that sat out padded replays comes back and
    samples. A campaign runs it as its twelfth example, after `first_return_after_preemption`, on
    the same twins.

    With r the fewest requests a graph pads (the smallest count of two or more that is no capture
    size but below the largest): A (sampled where the spec samples, at the highest temperature,
    admitted first) and r others with one-token prompts are admitted and decode together; then
    the r others decode twice without A, padded, A first in the list and left out; then A comes
    back, continuing where it was, and all decode twice more. A padding row given an absent
    request's place (the lowest sequence slot the batch does not hold, the first row the step
    leaves free) moves what the runner keeps there for A: the offset of A's random stream, its
    produced-token counts, its state. A random schedule leaves the first request out of a padded
    decode step and brings it back seldom: requests admitted first finish first. Empty where no
    count is padded, or a step or the cache cannot hold the r + 1 requests."""
    largest = max(spec.capture_sizes, default=0)
    r = next((n for n in range(2, largest) if n not in spec.capture_sizes), None)
    longest = 6  # A's prompt and its decodes; the others' are one fewer
    fits = (
        r is not None
        and r + 1 <= min(spec.max_num_reqs, spec.max_num_tokens)
        and longest <= _capacity(spec)
        and (r + 1) * _blocks(spec, longest) <= spec.num_blocks - 1
    )
    if r is None or not fits:
        return []
    seed = 11 if "sampling" in spec.features else None
    first = Arrival(prompt_len=1, seed=seed, temperature=max(TEMPERATURES))
    return [
        StepPlan(kind="prefill", rows=r + 1, arrivals=(first, *[Arrival(prompt_len=1)] * r)),
        StepPlan(kind="decode", rows=r + 1),
        # rotated by one, A (first in the list) is the one left out
        *[StepPlan(kind="decode", rows=r, rotate=1)] * 2,
        *[StepPlan(kind="decode", rows=r + 1)] * 2,
    ]


def _short_then_long_queries(spec: TargetSpec, live: int) -> list[StepPlan]:
    """Two prefill steps padded to one capture size c: c / 2 two-token prompts, then one prompt
    of c tokens (`first_handover`), beside `live` requests of three positions at most; empty
    where no such c fits a step, a request or the cache."""
    if "prefill" not in spec.features:
        return []
    most = min(spec.max_num_tokens, _capacity(spec))
    c = next(
        (
            s
            for s in spec.capture_sizes
            if 4 <= s <= most and s % 2 == 0 and s // 2 <= spec.max_num_reqs
        ),
        None,
    )
    if c is None:
        return []
    held = live * _blocks(spec, 3) + c // 2 * _blocks(spec, 2) + _blocks(spec, c)
    if held > spec.num_blocks - 1:
        return []
    short = StepPlan(kind="prefill", rows=c // 2, arrivals=(Arrival(prompt_len=2),) * (c // 2))
    long = StepPlan(kind="prefill", rows=1, arrivals=(Arrival(prompt_len=c),), chunk=c)
    return [short, long]


def _stale_tail_drafts(spec: TargetSpec, c: int, live: int) -> int:
    """The draft tokens per request of `first_stale_tail`'s speculative step: the most (up to 3)
    that keep c rows of them within the token budget, but fewer where `live` requests of that
    many tokens fill a capture size exactly and fewer do not: a runner that keys its verify
    graphs by token count then pads the step too (6 requests of 4 tokens fill a graph of 24)."""
    most = max(0, min(3, spec.max_num_tokens // c - 1))
    for drafts in range(most, 0, -1):
        if live * (1 + drafts) not in spec.capture_sizes:
            return drafts
    return most


def _shrunk_rows(spec: TargetSpec) -> tuple[int, int] | None:
    """(c, n): the smallest capture size c a step may fill whose bucket also serves n = c - 2
    requests, else n = c - 1; None where no capture size a step may fill leaves a padding row."""
    most = min(spec.max_num_reqs, spec.max_num_tokens)
    sizes = spec.capture_sizes
    for padding in (2, 1):
        for below, c in zip((0, *sizes), sizes, strict=False):
            if c <= most and c - padding > below:
                return c, c - padding
    return None


def _blocks(spec: TargetSpec, positions: int) -> int:
    """The KV blocks a request needs to hold `positions` positions."""
    return -(-positions // spec.block_size)


def _past_the_largest_graph(spec: TargetSpec, live: int) -> list[StepPlan]:
    """`live` requests become one more than the largest captured size, which then decode
    together; empty where a step cannot hold them all or the cache cannot. The first requests
    hold five tokens by then (a one-token prompt and four decodes)."""
    past = max(spec.capture_sizes, default=0) + 1
    blocks_each = _blocks(spec, 5)
    fits = (
        live < past <= min(spec.max_num_reqs, spec.max_num_tokens)
        and blocks_each <= spec.max_blocks_per_req
        and past * blocks_each <= spec.num_blocks - 1  # the null block is padding's
    )
    if not spec.capture_sizes or not fits:
        return []
    joining = past - live
    return [
        StepPlan(kind="prefill", rows=joining, arrivals=(Arrival(prompt_len=1),) * joining),
        StepPlan(kind="decode", rows=past),
    ]


@st.composite
def batch_lists(draw: st.DrawFn, spec: TargetSpec, max_steps: int = 12) -> list[Batch]:
    """Consecutive legal batches for one fresh target (stressors left out), for `@given` tests
    that drive a runner directly rather than through the lockstep driver."""
    plans = [dataclasses.replace(p, stress=Stress()) for p in draw(schedules(spec, max_steps))]
    events = compile_schedule(spec, plans, seed=draw(st.integers(0, 2**31 - 1)))
    return [e for e in events if isinstance(e, Batch)]
