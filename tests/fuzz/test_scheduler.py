"""The harness as scheduler: every schedule compiles to legal batches that stress the runner."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from pytest_graphmode.contract import Batch, Request, batch_problems
from pytest_graphmode.fuzz.lockstep import bucket_for
from pytest_graphmode.strategies import leading
from pytest_graphmode.strategies import schedules as schedules_module
from pytest_graphmode.strategies.plans import Arrival, StepPlan, Stress
from pytest_graphmode.strategies.scheduler import BlockAllocator, BlockScheduler, compile_schedule
from pytest_graphmode.strategies.schedules import (
    DELAY_CYCLES,
    adapter_ids,
    batch_lists,
    row_counts,
    schedules,
)
from tests.fuzz.toy import SPEC

DECODE_ONLY = dataclasses.replace(SPEC, features=frozenset({"decode"}))
TIGHT = dataclasses.replace(SPEC, num_blocks=5, max_blocks_per_req=2)
ADAPTERS = dataclasses.replace(SPEC, num_adapters=7)


@pytest.mark.parametrize(
    "spec", [SPEC, DECODE_ONLY, TIGHT, ADAPTERS], ids=["full", "decode", "tight", "adapters"]
)
@given(data=st.data())
def test_every_drawn_schedule_compiles_to_legal_batches(spec, data):
    plans = data.draw(schedules(spec, max_steps=8))
    events = compile_schedule(spec, plans, seed=data.draw(st.integers(0, 99)))
    batches = [e for e in events if isinstance(e, Batch)]
    assert len(batches) == len(plans)
    for batch in batches:
        assert batch_problems(batch, spec) == []


@given(data=st.data())
def test_requests_continue_where_their_previous_step_ended(data):
    plans = data.draw(schedules(SPEC, max_steps=8))
    events = compile_schedule(SPEC, plans, seed=3)
    cached: dict[int, int] = {}
    for batch in (e for e in events if isinstance(e, Batch)):
        for r in batch.requests:
            # a request resumes at its cached length, or restarts at 0 after a preemption, or
            # goes back after rejected draft tokens; it never skips positions
            assert r.context_len <= cached.get(r.req_id, 0)
            cached[r.req_id] = r.seq_len


def test_features_the_spec_lacks_are_never_drawn():
    @given(schedules(DECODE_ONLY, max_steps=6))
    def check(plans):
        for batch in compile_schedule(DECODE_ONLY, plans):
            if isinstance(batch, Batch):
                assert all(r.seed is None and r.adapter == 0 for r in batch.requests)
                assert all(q == 1 for q in batch.query_lens)

    check()


def test_freed_blocks_are_reused_first():
    scheduler = BlockScheduler(SPEC, seed=0)
    first = scheduler.compile(StepPlan("prefill", rows=1, arrivals=(Arrival(4),), chunk=4))
    freed = first.requests[0].block_ids
    second = scheduler.compile(StepPlan("prefill", rows=1, arrivals=(Arrival(4),), finish=(0,)))
    assert second.requests[0].block_ids == freed
    assert second.requests[0].req_id != first.requests[0].req_id


def test_allocator_never_hands_out_the_null_block():
    allocator = BlockAllocator(SPEC, random.Random(0))
    blocks = allocator.allocate(SPEC.num_blocks - 1)
    assert blocks is not None
    assert SPEC.null_block not in blocks
    assert allocator.allocate(1) is None


def test_allocator_refuses_a_double_free():
    allocator = BlockAllocator(SPEC, random.Random(0))
    blocks = allocator.allocate(1)
    assert blocks is not None
    allocator.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        allocator.free(blocks)


def test_spec_decode_steps_have_uniform_one_plus_k_queries():
    scheduler = BlockScheduler(SPEC, seed=1)
    scheduler.compile(StepPlan("prefill", rows=3, arrivals=(Arrival(2),) * 3, chunk=2))
    batch = scheduler.compile(StepPlan("spec", rows=3, spec_k=2, accepted=1))
    assert batch.query_lens == (3, 3, 3)
    assert batch.phase == "decode"


def test_rejected_drafts_are_rewritten_by_the_next_step():
    scheduler = BlockScheduler(SPEC, seed=1)
    scheduler.compile(StepPlan("prefill", rows=1, arrivals=(Arrival(2),), chunk=2))
    spec_step = scheduler.compile(StepPlan("spec", rows=1, spec_k=3, accepted=0))
    after = scheduler.compile(StepPlan("decode", rows=1))
    assert after.requests[0].context_len == spec_step.requests[0].context_len + 1


def test_preempted_requests_recompute_from_an_empty_cache():
    scheduler = BlockScheduler(SPEC, seed=1)
    scheduler.compile(StepPlan("prefill", rows=1, arrivals=(Arrival(3),), chunk=3))
    batch = scheduler.compile(StepPlan("prefill", rows=1, preempt=(0,), chunk=8))
    assert batch.requests[0].context_len == 0
    assert batch.requests[0].query_len == 4  # the prompt and the token generated since


def test_a_large_prefill_exceeds_the_largest_capture_size():
    scheduler = BlockScheduler(SPEC, seed=1)
    batch = scheduler.compile(StepPlan("prefill", rows=1, arrivals=(Arrival(12),), chunk=16))
    assert batch.num_tokens > SPEC.capture_sizes[-1]


def test_row_counts_sit_on_both_sides_of_every_bucket_boundary():
    seen: set[int] = set()

    @given(row_counts(SPEC))
    def collect(n):
        seen.add(n)

    collect()
    assert {1, 2, 3, 4, 5} <= seen


def test_boundary_row_counts_leave_up_to_two_padding_rows_or_cross_into_the_next_bucket():
    wide = dataclasses.replace(SPEC, capture_sizes=(1, 2, 4, 8, 16), max_num_reqs=16)
    # 6 and 14 leave two padding rows in the buckets of 8 and 16; 9 and 15 cross or leave one
    assert schedules_module.boundary_row_counts(wide) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 14, 15, 16]


def test_crowd_prompts_reach_the_end_of_a_long_first_block_and_stay_short_in_short_ones():
    short = {schedules_module.crowd_prompt_len(drawn, 4) for drawn in range(1, 50)}
    assert short == {1, 2, 3}
    long = {schedules_module.crowd_prompt_len(drawn, 16) for drawn in range(1, 50)}
    assert long == {1, 2, 3, 14, 15, 16}
    assert schedules_module.crowd_prompt_len(1, 16) <= 3  # shrinking keeps a crowd short
    kept_short = {schedules_module.crowd_prompt_len(drawn, 16, reach=False) for drawn in range(50)}
    assert kept_short == {1, 2, 3}


CROWDED_LONG_BLOCKS = dataclasses.replace(SPEC, block_size=16, max_num_tokens=64)


def _drawn_crowds(spec, examples):
    """The crowds Hypothesis draws for `spec` in `examples` examples, the same on every run."""
    drawn = []

    @settings(max_examples=examples, database=None, derandomize=True)
    @given(schedules_module.crowds(spec))
    def crowd(arrivals):
        drawn.append(arrivals)

    crowd()
    return drawn


def test_half_the_crowds_of_long_blocks_keep_every_prompt_short():
    # a crowd of short prompts prefills as a mixed batch of few tokens a request
    all_short = [
        all(a.prompt_len <= 3 for a in arrivals)
        for arrivals in _drawn_crowds(CROWDED_LONG_BLOCKS, 200)
        if len(arrivals) >= 4
    ]
    assert set(all_short) == {True, False}
    assert 0.25 < sum(all_short) / len(all_short) < 0.85, all_short


def test_decode_only_schedules_with_long_blocks_cross_into_a_second_block():
    long_blocks = CROWDED_LONG_BLOCKS
    crossed = []
    for arrivals in _drawn_crowds(long_blocks, 30):
        scheduler = BlockScheduler(long_blocks, seed=0)
        scheduler.compile(StepPlan("prefill", rows=16, arrivals=tuple(arrivals), chunk=64))
        for _ in range(3):
            batch = scheduler.compile(StepPlan("decode", rows=16))
            # a decode row (past its prompt, one query token) whose token starts a new block
            crossed.extend(
                r
                for r in batch.requests
                if r.context_len % 16 == 0 < r.context_len and len(r.tokens) == 1
            )
    assert crossed


def test_half_the_crowds_give_one_request_a_long_prompt_that_decodes_past_a_short_window():
    # A decode-only schedule opens with a crowd; with short prompts alone its decode steps never
    # reach a long context within a schedule. Half of the crowds that may reach a block's end
    # lead with one long prompt, prefilled over as many opening steps as the token budget needs.
    spec = dataclasses.replace(SPEC, num_blocks=40, max_blocks_per_req=8, max_num_tokens=12)
    led = [max(a.prompt_len for a in crowd) for crowd in _drawn_crowds(spec, 200)]
    assert 0.25 < sum(n > 3 for n in led) / len(led) < 0.75
    longest, lengths = [], []

    @settings(max_examples=300, database=None, derandomize=True)
    @given(schedules(spec, max_steps=8))
    def run(plans):
        lengths.append(len(plans))
        for event in compile_schedule(spec, plans):
            if isinstance(event, Batch) and all(len(r.tokens) == 1 for r in event.requests):
                longest.append(max(r.context_len for r in event.requests))

    run()
    assert max(lengths) <= 8
    assert max(longest) > 16  # past half of the 32 positions a request may hold, 12 a step


def test_stress_events_precede_their_step():
    stress = Stress(churn=2)
    events = compile_schedule(SPEC, [StepPlan("decode", rows=1, stress=stress)])
    assert events[0] == stress
    assert isinstance(events[1], Batch)


def test_plans_reject_impossible_values():
    with pytest.raises(ValueError, match="accepted"):
        StepPlan("spec", rows=1, spec_k=1, accepted=2)
    with pytest.raises(ValueError, match="kind"):
        StepPlan("verify", rows=1)  # type: ignore[arg-type]


@given(batch_lists(SPEC, max_steps=5))
def test_batch_lists_are_legal_consecutive_steps(batches):
    assert 1 <= len(batches) <= 5
    for batch in batches:
        assert batch_problems(batch, SPEC) == []


def test_a_swarms_step_strategies_are_built_once_not_once_per_step():
    # Hypothesis validates and walks every strategy object it has not drawn from before: built
    # per step, that walk cost more than the draws themselves.
    schedules_module._plan_strategies.cache_clear()
    schedules_module._plan_lists.cache_clear()

    @settings(max_examples=40, database=None, derandomize=True)
    @given(data=st.data())
    def draw(data):
        plans = data.draw(schedules(SPEC, max_steps=8))
        assert plans

    draw()
    built = schedules_module._plan_strategies.cache_info()
    # one set per swarm, two where admissions are off (the opening step's and the steady steps')
    swarms_drawn = schedules_module._plan_lists.cache_info().misses
    assert swarms_drawn <= built.misses <= 2 * swarms_drawn
    assert built.hits > 3 * built.misses  # most steps reuse their swarm's strategies


@pytest.mark.parametrize("spec", [SPEC, DECODE_ONLY, TIGHT], ids=["full", "decode", "tight"])
def test_the_partial_bucket_schedule_grows_a_batch_within_one_captured_size(spec):
    events = compile_schedule(spec, leading.first_partial_bucket(spec), seed=0)
    batches = [e for e in events if isinstance(e, Batch)]
    assert all(batch_problems(b, spec) == [] for b in batches)
    n = min(4, spec.max_num_reqs)
    rows = [len(b.requests) for b in batches]
    # the tight cache holds the next blocks of only two requests, which the last step runs
    assert rows == [n - 1, n - 1, 1, n, n - 1, n - 1 if spec is not TIGHT else 2], rows
    # the full batch is the partial one's requests and one more, and the last two are padded again
    partial, joined, full, padded, continued = batches[1:6]
    ids = [r.req_id for r in partial.requests]
    assert [r.req_id for r in full.requests] == [*ids, joined.requests[0].req_id]
    assert set(r.req_id for r in padded.requests) < set(r.req_id for r in full.requests)
    if spec is not TIGHT:  # the last continues the one before: the same rows, a token further
        assert [r.req_id for r in continued.requests] == [r.req_id for r in padded.requests]
        assert [r.context_len for r in continued.requests] == [r.seq_len for r in padded.requests]
    assert all(len(r.tokens) == 1 for b in batches[1:] for r in b.requests if r.context_len)
    sampled = joined.requests[0].seed is not None
    assert sampled == ("sampling" in spec.features)


def test_the_partial_bucket_schedule_ends_one_request_past_the_largest_captured_size():
    # a step may hold 6 requests, the largest graph 4: one more request than fits any graph
    past = dataclasses.replace(SPEC, capture_sizes=(1, 2, 4))
    events = compile_schedule(past, leading.first_partial_bucket(past), seed=0)
    batches = [e for e in events if isinstance(e, Batch)]
    assert all(batch_problems(b, past) == [] for b in batches)
    assert [len(b.requests) for b in batches] == [3, 3, 1, 4, 3, 3, 1, 5]
    last = batches[-1]
    assert all(len(r.tokens) == 1 and r.context_len for r in last.requests)  # a decode batch
    # where the cache cannot hold them all, the schedule stops after the rotated batches
    tight = dataclasses.replace(past, num_blocks=5, max_blocks_per_req=2)
    assert len(leading.first_partial_bucket(tight)) == 6


def test_the_partial_bucket_schedule_is_empty_where_a_step_holds_one_request():
    single = dataclasses.replace(SPEC, max_num_reqs=1)
    assert leading.first_partial_bucket(single) == []


LONG_BLOCKS = dataclasses.replace(SPEC, block_size=16, num_blocks=8, max_num_tokens=16)


@pytest.mark.parametrize(
    "spec",
    [SPEC, DECODE_ONLY, LONG_BLOCKS, dataclasses.replace(LONG_BLOCKS, max_num_tokens=8)],
    ids=["full", "decode", "long-blocks", "long-blocks-small-budget"],
)
def test_the_front_departure_schedule_grows_a_survivor_after_the_first_row_left(spec):
    events = compile_schedule(spec, leading.first_front_departure(spec), seed=0)
    batches = [e for e in events if isinstance(e, Batch)]
    assert all(batch_problems(b, spec) == [] for b in batches)
    first = batches[0].requests[0]
    present = [any(r.req_id == first.req_id for r in b.requests) for b in batches]
    # the first request is in every step until it leaves, and two steps follow its departure
    assert present == [True] * (len(batches) - 2) + [False, False], present
    before, after = batches[-3], batches[-2:]
    assert len(before.requests) == 3 and [len(b.requests) for b in after] == [2, 2]
    last = before.requests[-1].req_id  # admitted last, so in the row a condense moves
    survivor = [next(r for r in b.requests if r.req_id == last) for b in after]
    size = spec.block_size
    # it starts a new block in the second step after the departure, not in the first
    assert [r.context_len % size for r in survivor] == [size - 1, 0]
    assert [len(r.tokens) for r in survivor] == [1, 1]
    departed = next(r for r in before.requests if r.req_id == first.req_id)
    assert len(departed.block_ids) == 2 > len(survivor[0].block_ids) == 1
    assert departed.seed is None
    assert (survivor[0].seed is not None) == ("sampling" in spec.features)


@pytest.mark.parametrize(
    "spec",
    [
        dataclasses.replace(SPEC, max_num_reqs=2),
        dataclasses.replace(SPEC, max_blocks_per_req=1),
        TIGHT,  # five blocks besides the null block are needed at once, four there are
        dataclasses.replace(SPEC, block_size=1),
        dataclasses.replace(LONG_BLOCKS, features=frozenset({"decode"})),  # a token a step
    ],
    ids=["two-rows", "one-block", "tight", "one-slot-blocks", "long-blocks-without-prefill"],
)
def test_the_front_departure_schedule_is_left_out_where_it_cannot_run(spec):
    assert leading.first_front_departure(spec) == []


WIDE = dataclasses.replace(SPEC, max_num_reqs=8, max_num_tokens=32, num_blocks=20)


@pytest.mark.parametrize(
    ("spec", "rows", "query_len"),
    [(SPEC, (4, 4, 3, 3), 4), (WIDE, (8, 8, 6, 6), 4), (DECODE_ONLY, (4, 4, 3), 1)],
    ids=["one-padding-row", "two-padding-rows", "decode-only"],
)
def test_the_stale_tail_schedule_shrinks_a_batch_within_its_graph(spec, rows, query_len):
    events = compile_schedule(spec, leading.first_stale_tail(spec), seed=0)
    batches = [e for e in events if isinstance(e, Batch)]
    assert all(batch_problems(b, spec) == [] for b in batches)
    assert tuple(len(b.requests) for b in batches) == rows
    full, shrunk = batches[1], batches[2]
    # the same captured size serves both: the shrunk batch's padding rows follow the full one's
    assert bucket_for(spec, full.num_reqs) == bucket_for(spec, shrunk.num_reqs) == rows[0]
    assert all(len(r.tokens) == 1 and r.context_len == 1 for r in full.requests)
    assert all(len(r.tokens) == query_len and r.context_len == 2 for r in shrunk.requests)
    # the first requests go on, the last ones finished
    assert [r.req_id for r in shrunk.requests] == [r.req_id for r in full.requests][: rows[2]]


@pytest.mark.parametrize("spec", [SPEC, WIDE], ids=["one-padding-row", "two-padding-rows"])
def test_the_stale_tail_schedule_decodes_the_rows_of_a_partly_rejected_speculative_step(spec):
    events = compile_schedule(spec, leading.first_stale_tail(spec), seed=0)
    speculative, after = [e for e in events if isinstance(e, Batch)][2:]
    drafts = len(speculative.requests[0].tokens) - 1
    assert drafts >= 2  # some accepted, some rejected
    assert [r.req_id for r in after.requests] == [r.req_id for r in speculative.requests]
    for before, now in zip(speculative.requests, after.requests, strict=True):
        assert len(now.tokens) == 1
        # past the accepted drafts and the bonus token, short of where the drafts reached
        assert now.context_len == before.context_len + drafts // 2 + 1 < before.seq_len


@pytest.mark.parametrize("spec", [SPEC, DECODE_ONLY], ids=["speculative", "decode-only"])
def test_the_stale_tail_steps_after_the_prefill_make_the_host_late(spec):
    # A runner that writes its padding rows into pinned staging after queueing their upload
    # shows it on cuda only where the upload lands first: what the step before left is uploaded.
    prefill, *after = leading.first_stale_tail(spec)
    assert prefill.stress == Stress()
    assert after and all(p.stress == Stress(delay_cycles=DELAY_CYCLES, late="host") for p in after)


def test_a_delayed_step_alone_makes_its_copies_or_the_host_late_and_a_pair_copies_or_compute():
    single = schedules_module.stresses(SPEC, pipelined=False)
    for late in ("copies", "host"):
        found = find(single, lambda s, late=late: s.delay_cycles > 0 and s.late == late)
        assert found == Stress(delay_cycles=DELAY_CYCLES, late=late)
    with pytest.raises(NoSuchExample):
        find(single, lambda s: s.late == "compute")  # it would delay nothing a step reads
    pairs = schedules_module.stresses(SPEC)
    for late in ("copies", "compute"):
        assert find(pairs, lambda s, late=late: s.pipelined and s.late == late).late == late
    with pytest.raises(NoSuchExample):  # it would land the copies a pair's race needs in flight
        find(pairs, lambda s: s.pipelined and s.late == "host")


def test_a_stress_without_a_delay_carries_none_of_the_delays_settings():
    # They change nothing without a delay, yet would make a no-op a stressed step in the
    # schedule and its replay snippet.
    for pipelined in (False, True):
        with pytest.raises(NoSuchExample):
            find(
                schedules_module.stresses(SPEC, pipelined),
                lambda s: not s.delay_cycles and (s.held_stream is not None or s.late != "copies"),
            )
    held = find(schedules_module.stresses(SPEC), lambda s: s.held_stream is not None)
    assert held.delay_cycles == DELAY_CYCLES


# Graphs every 8 tokens from 8 (as engines capture them): 6 requests of 1 + 3 tokens fill 24.
EVERY_EIGHT = dataclasses.replace(WIDE, capture_sizes=(1, 2, 4, 8, 16, 24, 32))


def test_the_stale_tail_speculative_step_pads_a_graph_keyed_by_tokens_too():
    events = compile_schedule(EVERY_EIGHT, leading.first_stale_tail(EVERY_EIGHT), seed=0)
    speculative = [e for e in events if isinstance(e, Batch)][2]
    assert speculative.num_reqs == 6 and bucket_for(EVERY_EIGHT, speculative.num_reqs) == 8
    # two drafts, not three: 18 tokens pad to a graph of 24 tokens as 6 rows pad to 8
    assert speculative.num_tokens == 18 not in EVERY_EIGHT.capture_sizes


@pytest.mark.parametrize(
    "spec",
    [
        dataclasses.replace(SPEC, capture_sizes=(1, 2, 3, 4, 5, 6)),  # no size leaves padding
        dataclasses.replace(SPEC, capture_sizes=(1,)),
        dataclasses.replace(SPEC, max_num_reqs=3),  # the graph of 4 rows is never full
        dataclasses.replace(SPEC, num_blocks=4),  # four requests' blocks do not fit
    ],
    ids=["dense-sizes", "one-size", "fewer-rows-than-the-graph", "small-cache"],
)
def test_the_stale_tail_schedule_is_left_out_where_it_cannot_run(spec):
    assert leading.first_stale_tail(spec) == []


@pytest.mark.parametrize(
    ("spec", "seeds", "adapters"),
    [
        (SPEC, (6, 7, None), (1, 1, 1)),
        (ADAPTERS, (6, 7, None), (1, 7, 1)),
        (DECODE_ONLY, (None,) * 3, (0,) * 3),
    ],
    ids=["one-adapter", "seven-adapters", "neither"],
)
def test_the_handover_schedule_runs_requests_with_other_values_alone_in_turn(spec, seeds, adapters):
    events = compile_schedule(spec, leading.first_handover(spec), seed=0)
    batches = [e for e in events if isinstance(e, Batch)]
    assert all(batch_problems(b, spec) == [] for b in batches)
    batches = batches[:6]  # the handover; what follows it is the next test's
    assert [b.num_reqs for b in batches] == [1] * 6
    assert [b.phase for b in batches] == ["prefill", "decode"] * 3
    decodes = [b.requests[0] for b in batches[1::2]]
    # each request decodes alone on the graph of one row, after the one before it finished
    assert [r.req_id for r in decodes] == [0, 1, 2]
    assert {bucket_for(spec, b.num_tokens) for b in batches[1::2]} == {spec.capture_sizes[0]}
    assert tuple(r.seed for r in decodes) == seeds
    assert tuple(r.adapter for r in decodes) == adapters
    assert [r.temperature for r in decodes] == [0.25, 4.0, 0.25]


@pytest.mark.parametrize(
    ("spec", "prefills"),
    [
        (SPEC, True),
        (DECODE_ONLY, False),
        (dataclasses.replace(SPEC, capture_sizes=(1, 2, 3)), False),
    ],
    ids=["prefill", "decode-only", "no-even-size-of-four-or-more"],
)
def test_the_handover_schedule_then_lists_a_new_request_first_and_grows_a_query(spec, prefills):
    events = compile_schedule(spec, leading.first_handover(spec), seed=0)
    batches = [e for e in events if isinstance(e, Batch)][6:]
    joined = batches[0]
    # one-token rows, the new request listed before the one that continues
    assert [(r.context_len, len(r.tokens)) for r in joined.requests] == [(0, 1), (2, 1)]
    assert len(batches) == (3 if prefills else 1)
    if prefills:
        short, long = batches[1:]
        # one padded token count, the longest query 2, then all of it
        assert bucket_for(spec, short.num_tokens) == bucket_for(spec, long.num_tokens) == 4
        assert (max(short.query_lens), max(long.query_lens)) == (2, 4)
        assert all(r.context_len == 0 for r in (*short.requests, *long.requests))


@pytest.mark.parametrize(
    "spec",
    [
        dataclasses.replace(SPEC, block_size=1, max_blocks_per_req=1),
        dataclasses.replace(SPEC, block_size=1, num_blocks=2),
    ],
    ids=["one-slot-per-request", "one-slot-in-the-cache"],
)
def test_the_handover_schedule_is_left_out_where_a_request_cannot_decode(spec):
    assert leading.first_handover(spec) == []


@pytest.mark.parametrize(
    ("spec", "longest"),
    [(SPEC, 14), (LONG_BLOCKS, 62), (DECODE_ONLY, 6)],
    ids=["prompt-within-budget", "prompt-past-budget", "a-token-a-step"],
)
def test_the_phase_change_schedule_decodes_the_long_request_alone_whatever_the_budget(
    spec, longest
):
    # capacity - 2 where the budget takes the prompt in the steps the schedule may hold; without
    # the "prefill" feature a prompt takes a step a token, and is shortened to fit
    events = compile_schedule(spec, leading.first_phase_change(spec), seed=0)
    batches = [e for e in events if isinstance(e, Batch)]
    assert all(batch_problems(b, spec) == [] for b in batches)
    assert len(batches) <= leading.MAX_LEADING_STEPS
    long_id = batches[2].requests[0].req_id  # admitted by the pair's second step
    alone = [b.requests[0] for b in batches if [r.req_id for r in b.requests] == [long_id]]
    decoded = [r for r in alone if len(r.tokens) == 1 and r.context_len >= longest]
    assert decoded, [(r.context_len, len(r.tokens)) for r in alone]
    # the first request stays in every step while the long prompt is prefilled
    first_id = batches[0].requests[0].req_id
    prefilling = [
        b for b in batches[3:] if any(r.req_id == long_id and len(r.tokens) > 1 for r in b.requests)
    ]
    assert all(any(r.req_id == first_id for r in b.requests) for b in prefilling)


@pytest.mark.parametrize(
    ("num_adapters", "drawn"),
    [(1, (0, 1)), (2, (0, 1, 2)), (3, (0, 1, 2, 3)), (7, (0, 1, 2, 3, 7))],
)
def test_arrivals_name_the_base_the_first_adapters_and_the_last(num_adapters, drawn):
    assert adapter_ids(dataclasses.replace(SPEC, num_adapters=num_adapters)) == drawn


def test_a_campaign_sends_two_adapters_to_one_graph_where_the_spec_has_them():
    # A graph captured for one adapter must meet another: two adapters beside the base in one
    # schedule, each in a decode step of the same padded size.
    @settings(max_examples=200, database=None, derandomize=True)
    @given(data=st.data())
    def draw(data):
        plans = data.draw(schedules(ADAPTERS, max_steps=8))
        events = compile_schedule(ADAPTERS, plans, seed=3)
        seen: dict[int, set[int]] = {}
        for batch in (e for e in events if isinstance(e, Batch) and e.phase == "decode"):
            seen.setdefault(bucket_for(ADAPTERS, batch.num_tokens), set()).update(batch.adapters)
        found.append(any(len(adapters - {0}) > 1 for adapters in seen.values()))

    found: list[bool] = []
    draw()
    assert any(found)


@pytest.mark.parametrize(
    ("spec", "prompt", "sampled"),
    [(SPEC, 2, True), (DECODE_ONLY, 1, False)],
    ids=["prefill", "decode-only"],
)
def test_the_stream_sweep_decodes_beside_a_prefill_with_each_stream_held_back_in_turn(
    spec, prompt, sampled
):
    events = compile_schedule(spec, leading.first_stream_sweep(spec), seed=0)
    batches = [e for e in events if isinstance(e, Batch)]
    assert all(batch_problems(b, spec) == [] for b in batches)
    stresses = [e for e in events if isinstance(e, Stress)]
    assert [s.held_stream for s in stresses] == [0, 1, 2]
    assert all(s.delay_cycles and not s.pipelined for s in stresses)
    # each delayed step follows its stress: A decoding one token beside a newcomer's prompt
    delayed = [events[events.index(s) + 1] for s in stresses]
    for step, batch in enumerate(delayed):
        first, newcomer = batch.requests
        assert (first.req_id, first.context_len, len(first.tokens)) == (0, 1 + step, 1)
        assert (newcomer.req_id, newcomer.context_len, len(newcomer.tokens)) == (
            1 + step,
            0,
            prompt,
        )
    assert (batches[0].requests[0].seed is not None) == sampled


def test_the_stream_sweep_is_left_out_where_a_step_cannot_hold_two_requests():
    one = dataclasses.replace(SPEC, max_num_reqs=1)
    assert leading.first_stream_sweep(one) == []


PAST_FITS = dataclasses.replace(SPEC, capture_sizes=(1, 2, 4), num_blocks=24)


@pytest.mark.parametrize(
    ("spec", "returns_at"),
    [(PAST_FITS, (2, 3, 5)), (DECODE_ONLY, (1, 3, 4))],
    ids=["prefill", "decode-only"],
)
def test_the_graph_stream_sweep_holds_each_stream_back_as_a_request_returns_then_past_the_graphs(
    spec, returns_at
):
    events = compile_schedule(spec, leading.first_graph_stream_sweep(spec), seed=0)
    batches = [e for e in events if isinstance(e, Batch)]
    assert all(batch_problems(b, spec) == [] for b in batches)
    stresses = [e for e in events if isinstance(e, Stress)]
    assert [s.held_stream for s in stresses] == [0, 1, 2] * (2 if spec is PAST_FITS else 1)
    assert all(s.delay_cycles and not s.pipelined for s in stresses)
    delayed = [i + 1 for i, e in enumerate(events) if isinstance(e, Stress)]
    # the first three: two requests decode together, one of them back from sitting out the step
    # before, which the other ran alone
    for at, context in zip(delayed[:3], returns_at, strict=True):
        before, step = events[at - 2], events[at]
        assert isinstance(before, Batch) and isinstance(step, Batch)
        assert step.num_reqs == 2 and all(len(r.tokens) == 1 for r in step.requests)
        (back,) = [r for r in step.requests if r.req_id not in {q.req_id for q in before.requests}]
        assert back.context_len == context
    # then every live request decodes, one more than the largest graph holds
    for at in delayed[3:]:
        step = events[at]
        assert step.num_reqs == max(spec.capture_sizes) + 1
        assert all(len(r.tokens) == 1 and r.context_len > 0 for r in step.requests)
    assert (batches[0].requests[0].seed is not None) == ("sampling" in spec.features)


def test_the_graph_stream_sweep_leaves_out_what_its_spec_cannot_hold():
    # six requests a step, graphs up to 8: no step past the largest graph
    assert len(leading.first_graph_stream_sweep(SPEC)) == 7
    one = dataclasses.replace(SPEC, max_num_reqs=1)
    assert leading.first_graph_stream_sweep(one) == []
    short = dataclasses.replace(SPEC, max_blocks_per_req=1)  # four positions a request
    assert leading.first_graph_stream_sweep(short) == []


@pytest.mark.parametrize(
    ("spec", "rows", "drafts"),
    [
        (SPEC, 5, 1),  # graphs up to 8: 5 requests of 2 tokens
        # graphs up to 16, 8 requests a step: 9 of 2 tokens would be too many, 6 of 3 fit
        (
            dataclasses.replace(
                SPEC,
                capture_sizes=(1, 2, 4, 8, 16),
                max_num_reqs=8,
                max_num_tokens=24,
                num_blocks=64,
            ),
            6,
            2,
        ),
    ],
    ids=["toy", "sixteen-token-graphs"],
)
def test_a_speculative_step_of_a_graphs_request_count_goes_just_past_the_largest_graph(
    spec, rows, drafts
):
    events = compile_schedule(spec, leading.first_tokens_past_the_largest_graph(spec))
    batches = [e for e in events if isinstance(e, Batch)]
    assert all(batch_problems(b, spec) == [] for b in batches)
    assert [b.num_reqs for b in batches] == [rows] * 5
    speculative = batches[2]
    assert speculative.query_lens == (1 + drafts,) * rows
    largest = spec.capture_sizes[-1]
    assert largest < speculative.num_tokens <= spec.max_num_tokens
    # every draft was accepted: the decode after it starts past all of them
    assert [r.context_len for r in batches[3].requests] == [3 + drafts] * rows
    # then the same requests listed from the second admitted on, proposing drafts - 1 down to
    # none, then drafts again: rows whose draft counts differ, in another order than admitted
    uneven = batches[4]
    admitted = [r.req_id for r in batches[0].requests]
    assert [r.req_id for r in uneven.requests] == admitted[1:] + admitted[:1]
    assert uneven.query_lens == tuple(1 + (drafts - row - 1) % (drafts + 1) for row in range(rows))
    assert len(set(uneven.query_lens)) > 1


def test_the_tokens_past_the_largest_graph_need_speculative_decoding():
    assert leading.first_tokens_past_the_largest_graph(DECODE_ONLY) == []
    tight = dataclasses.replace(SPEC, max_num_tokens=SPEC.capture_sizes[-1])
    assert leading.first_tokens_past_the_largest_graph(tight) == []


@pytest.mark.parametrize("spec", [SPEC, DECODE_ONLY], ids=["prefill", "decode-only"])
def test_a_preempted_request_comes_back_beside_the_one_that_took_its_blocks(spec):
    events = compile_schedule(spec, leading.first_return_after_preemption(spec), seed=0)
    batches = [e for e in events if isinstance(e, Batch)]
    assert all(batch_problems(b, spec) == [] for b in batches)

    def a_in(batch: Batch) -> Request:
        return next(r for r in batch.requests if r.req_id == 0)

    first_life = a_in(batches[2])
    assert [r.req_id for r in batches[3].requests] == [1, 2]  # A waits, C takes its blocks
    assert set(first_life.block_ids) <= set(batches[3].requests[1].block_ids)
    back = [a_in(b) for b in batches[4:]]
    assert back[0].context_len == 0 and first_life.context_len == 2
    # A computes its four tokens again, then decodes twice with B and C, on one-token rows
    assert sum(len(r.tokens) for r in back[:-2]) == 4
    assert all(b.query_lens == (1, 1, 1) and b.num_reqs == 3 for b in batches[-2:])
    assert [r.context_len for r in back[-2:]] == [4, 5]


def test_the_return_after_preemption_needs_three_requests_and_their_blocks():
    assert leading.first_return_after_preemption(dataclasses.replace(SPEC, max_num_reqs=2)) == []
    assert leading.first_return_after_preemption(TIGHT) == []


@pytest.mark.parametrize("spec", [SPEC, DECODE_ONLY], ids=["prefill", "decode-only"])
def test_a_request_comes_back_after_sitting_out_padded_replays(spec):
    plans = leading.first_return_after_padded_steps(spec)
    batches = [e for e in compile_schedule(spec, plans, seed=0) if isinstance(e, Batch)]
    assert all(batch_problems(b, spec) == [] for b in batches)
    ids = [[r.req_id for r in b.requests] for b in batches]
    assert ids == [[0, 1, 2, 3]] * 2 + [[1, 2, 3]] * 2 + [[0, 1, 2, 3]] * 2
    # without A, three rows pad the graph of four
    assert all(bucket_for(spec, b.num_tokens) == 4 for b in batches[2:4])
    back = [b.requests[0] for b in batches[4:]]
    assert [(r.req_id, r.context_len) for r in back] == [(0, 2), (0, 3)]  # continuing
    sampled = "sampling" in spec.features
    assert (back[0].seed is not None) == sampled


def test_the_return_after_padded_steps_needs_a_padded_count_and_room():
    consecutive = dataclasses.replace(SPEC, capture_sizes=(1, 2, 3, 4))
    assert leading.first_return_after_padded_steps(consecutive) == []
    assert leading.first_return_after_padded_steps(dataclasses.replace(SPEC, max_num_reqs=3)) == []
    assert leading.first_return_after_padded_steps(TIGHT) == []


def test_boundary_draft_counts_put_a_speculative_step_at_or_just_past_a_capture_size():
    spec = dataclasses.replace(
        SPEC, capture_sizes=(1, 2, 4, 8, 16), max_num_reqs=8, max_num_tokens=20, num_blocks=64
    )
    # six requests: 12 tokens fit 16 (and are past 8), 18 are just past 16; 24 exceed the budget
    assert schedules_module.boundary_draft_counts(spec, 6) == [1, 2]
    # two requests: 4 fit 4, 6 are past it, 8 fit 8, 10 are past it
    assert schedules_module.boundary_draft_counts(spec, 2) == [1, 2, 3, 4]
    for rows in range(1, spec.max_num_reqs + 1):
        for drafts in schedules_module.boundary_draft_counts(spec, rows):
            tokens = rows * (1 + drafts)
            assert any(
                tokens <= c < tokens + rows or tokens - rows <= c < tokens
                for c in spec.capture_sizes
            )
    assert schedules_module.boundary_draft_counts(spec, 0) == []


def test_an_uneven_speculative_step_gives_its_rows_different_draft_counts_none_included():
    prompt = StepPlan(kind="prefill", rows=4, arrivals=(Arrival(prompt_len=1),) * 4)
    even = StepPlan(kind="spec", rows=4, spec_k=3, accepted=0)
    uneven = dataclasses.replace(even, uneven=True, rotate=2)
    for plan, drafts in ((even, [3, 3, 3, 3]), (uneven, [1, 0, 3, 2])):
        events = compile_schedule(SPEC, [prompt, StepPlan(kind="decode", rows=4), plan], seed=0)
        spec_step = [e for e in events if isinstance(e, Batch)][-1]
        assert batch_problems(spec_step, SPEC) == []
        assert spec_step.query_lens == tuple(1 + d for d in drafts)


@settings(max_examples=200, deadline=None)
@given(plan=schedules_module.step_plans(SPEC))
def test_only_speculative_steps_are_drawn_uneven(plan):
    assert plan.kind == "spec" or not plan.uneven


def test_speculative_steps_are_drawn_uneven_too_and_even_is_the_simpler():
    plans = schedules_module.step_plans(SPEC)
    assert find(plans, lambda p: p.uneven).kind == "spec"
    assert find(plans, lambda p: p.kind == "spec").uneven is False
