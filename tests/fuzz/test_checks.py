"""Each oracle, as a pure function: silent on a correct step, precise on a broken one."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest
import torch

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.fuzz import addresses, checks, kv_checks, sampling_check, tolerance
from pytest_graphmode.fuzz.checks import Outcome
from pytest_graphmode.fuzz.lockstep import step_outcome
from pytest_graphmode.fuzz.violation import differences
from pytest_graphmode.strategies.idle_blocks import MARK

SPEC = TargetSpec(
    num_blocks=4,
    block_size=2,
    max_blocks_per_req=2,
    vocab_size=4,
    max_num_reqs=2,
    max_num_tokens=4,
    capture_sizes=(1, 2),
    features=frozenset({"decode", "sampling"}),
)
# req 7 writes position 2 (block 3, slot 6); req 8 writes position 0 (block 1, slot 2)
BATCH = Batch(
    (
        Request(7, (1,), context_len=2, block_ids=(2, 3)),
        Request(8, (2,), context_len=0, block_ids=(1,), seed=5),
    )
)


def result(logits, tokens=(0, 1), path="full", key=2) -> StepResult:
    return StepResult(torch.tensor(logits), torch.tensor(tokens), path, key)


GOOD = [[4.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]]


def kv(**changes: float) -> dict[str, torch.Tensor]:
    values = torch.zeros(SPEC.num_slots, 3)
    for slot, value in changes.items():
        values[int(slot[1:])] = value
    return {"kv": values}


def test_identical_twins_match():
    assert (
        checks.replay_matches_eager(BATCH, Outcome(result(GOOD)), Outcome(result(GOOD)), SPEC) == []
    )


def test_logits_beyond_tolerance_fail_with_row_and_request():
    bad = [[4.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.01, 0.0]]
    [v] = checks.replay_matches_eager(BATCH, Outcome(result(bad)), Outcome(result(GOOD)), SPEC)
    assert (v.check, v.row, v.req_id) == ("replay_matches_eager", 1, 8)


def test_logits_within_float32_tolerance_pass():
    near = [[4.0 + 1e-5, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 1e-5]]
    assert (
        checks.replay_matches_eager(BATCH, Outcome(result(near)), Outcome(result(GOOD)), SPEC) == []
    )


def test_float32_logits_of_a_model_that_keeps_bfloat16_state_get_its_tolerance():
    # A float32 LM head over bfloat16 hidden states: float32 bits, bfloat16's rounding.
    off = [[4.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.01, 0.0]]
    graph, eager = Outcome(result(off)), Outcome(result(GOOD))
    assert checks.replay_matches_eager(BATCH, graph, eager, SPEC, torch.bfloat16) == []
    [v] = checks.replay_matches_eager(BATCH, graph, eager, SPEC, torch.float32)
    assert v.row == 1


def test_state_precision_is_the_coarsest_floating_slot_major_state():
    slots = SPEC.num_slots
    state = {
        "kv": torch.zeros(slots, 3, dtype=torch.bfloat16),
        "codes": torch.zeros(slots, dtype=torch.float8_e4m3fn),
        "ids": torch.zeros(slots, dtype=torch.int64),
        "weights": torch.zeros(slots + 1, 2, dtype=torch.float8_e5m2),  # not slot-major
    }
    assert tolerance.state_precision(state, SPEC) == torch.float8_e4m3fn
    # The power-of-two scales of an MX cache are scales, not values: no precision of the model.
    state["mx_scales"] = torch.zeros(slots, dtype=torch.float8_e8m0fnu)
    assert tolerance.state_precision(state, SPEC) == torch.float8_e4m3fn
    del state["mx_scales"]
    del state["codes"]
    assert tolerance.state_precision(state, SPEC) == torch.bfloat16
    assert tolerance.state_precision({"ids": state["ids"]}, SPEC) is None


@pytest.mark.parametrize(
    ("dtype", "relative"),
    [
        (torch.float8_e4m3fn, 2**-4),
        (torch.float8_e4m3fnuz, 2**-4),
        (torch.float8_e5m2, 2**-3),
        (torch.bfloat16, 4e-2),
        (torch.float16, 2e-2),
        (torch.float32, 1e-4),
    ],
)
def test_logits_tolerance_by_the_precision_they_are_computed_in_or_over(dtype, relative):
    assert tolerance.logits_rtol(dtype) == relative


def test_float32_logits_of_a_model_that_keeps_a_float8_cache_get_half_a_unit():
    # Two paths that quantize a key by other arithmetic land on neighbouring float8 codes: a
    # logit moves by a few hundredths of the row's scale.
    off = [[4.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.15, 0.0]]  # 0.05 of the row's scale
    graph, eager = Outcome(result(off)), Outcome(result(GOOD))
    assert checks.replay_matches_eager(BATCH, graph, eager, SPEC, torch.float8_e4m3fn) == []
    [v] = checks.replay_matches_eager(BATCH, graph, eager, SPEC, torch.float32)
    assert v.row == 1
    # e5m2 has one mantissa bit fewer than e4m3: half its unit is 0.125.
    off = [[4.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.3, 0.0]]
    graph = Outcome(result(off))
    assert checks.replay_matches_eager(BATCH, graph, eager, SPEC, torch.float8_e5m2) == []
    [v] = checks.replay_matches_eager(BATCH, graph, eager, SPEC, torch.bfloat16)
    assert v.row == 1
    far = [[4.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.2, 0.0]]  # beyond half of e4m3's unit of 3
    [v] = checks.replay_matches_eager(BATCH, Outcome(result(far)), eager, SPEC, torch.float8_e4m3fn)
    assert v.row == 1


def test_float32_scales_beside_a_float8_cache_are_judged_relative_to_themselves():
    # A scale from the amax of bfloat16 keys: 2% off on another path, far below 1.
    slots = SPEC.num_slots
    codes = torch.zeros(slots, 3).to(torch.float8_e4m3fn)
    scales = torch.full((slots,), 0.0047)
    near, far = scales.clone(), scales.clone()
    near[6], far[6] = 0.00455, 0.003  # a rounding; another token's scale
    eager = {"codes": codes, "scales": scales}
    assert kv_checks.states_match(BATCH, {"codes": codes, "scales": near}, eager, SPEC) == []
    [v] = kv_checks.states_match(BATCH, {"codes": codes, "scales": far}, eager, SPEC)
    assert v.slot == 6
    # Without coarser state beside them, float32 scales keep float32's tolerance.
    [v] = kv_checks.states_match(BATCH, {"scales": near}, {"scales": scales}, SPEC)
    assert v.slot == 6


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_positive_infinite_graph_logits_fail(value):
    bad = [[4.0, 0.0, 0.0, 0.0], [0.0, value, 0.0, 0.0]]
    [v] = checks.replay_matches_eager(BATCH, Outcome(result(bad)), Outcome(result(GOOD)), SPEC)
    assert "NaN or +inf" in v.detail and v.row == 1


INF = float("-inf")
# A grammar's bitmask (or a top-k filter) leaves -inf in the tokens it masks out.
MASKED = [[4.0, INF, 0.0, INF], [INF, 3.0, 0.0, 0.0]]


def test_tokens_masked_alike_on_both_twins_pass():
    graph, eager = Outcome(result(MASKED)), Outcome(result(MASKED))
    assert checks.replay_matches_eager(BATCH, graph, eager, SPEC) == []


@pytest.mark.parametrize("row", [0, 1])
def test_a_token_masked_on_one_twin_only_fails(row):
    stale = [list(r) for r in MASKED]
    stale[row][2] = INF  # a mask left from another request
    [v] = checks.replay_matches_eager(BATCH, Outcome(result(stale)), Outcome(result(MASKED)), SPEC)
    assert (v.row, v.expected, v.actual) == (row, "0.0", "-inf")


def test_a_sampled_token_with_masked_logits_is_still_judged():
    # Row 1 is sampled: identical masked logits must draw the same token.
    graph, eager = Outcome(result(MASKED, tokens=(0, 2))), Outcome(result(MASKED))
    [v] = checks.replay_matches_eager(BATCH, graph, eager, SPEC)
    assert v.req_id == 8 and "seed 5" in v.detail


def test_greedy_token_mismatch_with_a_clear_margin_fails():
    [v] = checks.replay_matches_eager(
        BATCH, Outcome(result(GOOD, tokens=(2, 1))), Outcome(result(GOOD)), SPEC
    )
    assert (v.row, v.expected, v.actual) == (0, "0", "2")


def test_greedy_token_mismatch_on_a_tie_is_not_decidable():
    tie = [[4.0, 4.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]]
    graph, eager = Outcome(result(tie, tokens=(1, 1))), Outcome(result(tie, tokens=(0, 1)))
    assert checks.replay_matches_eager(BATCH, graph, eager, SPEC) == []


def test_sampled_token_mismatch_with_identical_logits_fails():
    graph, eager = Outcome(result(GOOD, tokens=(0, 3))), Outcome(result(GOOD))
    [v] = checks.replay_matches_eager(BATCH, graph, eager, SPEC)
    assert v.req_id == 8 and "seed 5" in v.detail


def test_graph_exception_is_reported_with_its_traceback():
    [v] = checks.replay_matches_eager(
        BATCH, Outcome(None, "Traceback: boom"), Outcome(result(GOOD)), SPEC
    )
    assert v.detail.startswith("graph_raised") and "boom" in v.detail


def test_eager_exception_is_reported_too():
    [v] = checks.replay_matches_eager(BATCH, Outcome(result(GOOD)), Outcome(None, "bang"), SPEC)
    assert v.detail.startswith("eager_raised")


def test_writes_to_valid_and_null_slots_are_confined():
    after = kv(s6=1.0, s2=1.0, s0=9.0, s1=9.0)
    assert kv_checks.kv_writes_confined(BATCH, kv(), after, SPEC) == []


def test_a_write_to_a_live_slot_outside_the_step_names_slot_block_and_owner():
    [v] = kv_checks.kv_writes_confined(BATCH, kv(), kv(s6=1.0, s2=1.0, s4=1.0), SPEC)
    assert v.slot == 4 and "block 2, owned by req 7" in v.detail


def test_nan_that_stays_nan_is_not_a_write():
    before = kv(s5=float("nan"))
    assert kv_checks.kv_writes_confined(BATCH, before, dict(before), SPEC) == []


def test_states_that_agree_match():
    assert kv_checks.states_match(BATCH, kv(s6=1.0), kv(s6=1.0 + 1e-7), SPEC) == []


def test_state_difference_outside_the_null_block_fails():
    [v] = kv_checks.states_match(BATCH, kv(s6=1.5), kv(s6=1.0), SPEC)
    assert v.slot == 6 and v.check == "states_match"


def test_a_bfloat16_slot_is_judged_at_its_own_scale_not_element_by_element():
    # Layer-1 keys of a model whose graph path rounds its attention otherwise: an element near
    # zero carries the rounding of the slot's larger values.
    eager = {"kv": torch.zeros(SPEC.num_slots, 3, dtype=torch.bfloat16)}
    eager["kv"][6] = torch.tensor([3.0, -2.0, 0.0])
    near, far = eager["kv"].clone(), eager["kv"].clone()
    near[6, 2], far[6, 2] = 0.1, 0.15  # within 4e-2 of the slot's scale 3, and beyond
    assert kv_checks.states_match(BATCH, {"kv": near}, eager, SPEC) == []
    [v] = kv_checks.states_match(BATCH, {"kv": far}, eager, SPEC)
    assert v.slot == 6


def test_null_block_is_not_compared_between_twins():
    assert kv_checks.states_match(BATCH, kv(s1=float("nan")), kv(), SPEC) == []


def test_a_state_that_is_not_slot_major_is_compared_whole_and_says_so():
    # Rows per block, not per slot (a [num_blocks, 2, block_size, ...] cache handed out whole):
    # the null block is not set apart, and the message names the shape it did not recognise.
    blocks = torch.zeros(SPEC.num_blocks, 2)
    changed = blocks.clone()
    changed[0, 1] = 1.0
    [v] = kv_checks.states_match(BATCH, {"kv": changed}, {"kv": blocks}, SPEC)
    assert "index (0, 1)" in v.detail and "not slot-major" in v.detail
    assert f"{SPEC.num_blocks} rows are not the spec's {SPEC.num_slots} slots" in v.detail


def test_bit_identical_poisoned_and_clean_runs_are_inert():
    outcome = Outcome(result(GOOD))
    assert checks.padding_inert(BATCH, outcome, outcome, kv(), kv(), SPEC) == []


def test_a_last_bit_difference_in_a_valid_row_breaks_padding_inertness():
    nudged = [
        [4.0, 0.0, 0.0, 0.0],
        [0.0, float(torch.nextafter(torch.tensor(3.0), torch.tensor(4.0))), 0.0, 0.0],
    ]
    [v] = checks.padding_inert(
        BATCH, Outcome(result(nudged)), Outcome(result(GOOD)), kv(), kv(), SPEC
    )
    assert v.row == 1 and v.req_id == 8


def test_a_valid_kv_slot_changed_by_poison_breaks_padding_inertness():
    outcome = Outcome(result(GOOD))
    [v] = checks.padding_inert(BATCH, outcome, outcome, kv(s2=2.0), kv(s2=1.0), SPEC)
    assert v.slot == 2 and v.req_id == 8


def test_state_written_less_often_than_once_a_token_may_keep_the_mark_on_both_marked_twins():
    # Slot 2 is request 8's to write; a scale per block, say, leaves it unwritten: the marked
    # twins (poisoned graph, eager) keep the mark, the clean twin, never marked, holds its 0.
    outcome = Outcome(result(GOOD))
    kept = kv(s2=MARK)
    assert checks.padding_inert(BATCH, outcome, outcome, kept, kv(), SPEC, eager_after=kept) == []


def test_the_mark_kept_by_the_poisoned_twin_alone_still_breaks_padding_inertness():
    outcome = Outcome(result(GOOD))
    [v] = checks.padding_inert(
        BATCH, outcome, outcome, kv(s2=MARK), kv(), SPEC, eager_after=kv(s2=1.0)
    )
    assert v.slot == 2 and v.req_id == 8


def test_poison_changing_the_dispatch_breaks_padding_inertness():
    eager = Outcome(result(GOOD, path="eager", key=None))
    [v] = checks.padding_inert(BATCH, eager, Outcome(result(GOOD)), kv(), kv(), SPEC)
    assert "dispatch" in v.detail


def test_a_kept_result_that_changed_fails():
    kept = result(GOOD)
    snapshot = (kept.logits.clone(), kept.next_tokens.clone())
    kept.logits[1, 2] = 7.0
    [v] = checks.results_stay_valid(kept, snapshot, kept_step=3)
    assert v.row == 1 and "step 3" in v.detail


def test_an_unchanged_kept_result_passes():
    kept = result(GOOD)
    assert checks.results_stay_valid(kept, (kept.logits.clone(), kept.next_tokens.clone()), 0) == []


@pytest.mark.parametrize(
    ("graph_error", "shown"),
    [
        ("Traceback\n  table[pos]\nIndexError: index 23 is out of bounds", ["eager"]),
        ("Traceback\n  graph.replay()\nRuntimeError: capture invalidated", ["eager", "graph"]),
    ],
)
def test_both_twins_raising_shows_the_graph_twins_error_where_it_differs(graph_error, shown):
    eager_error = "Traceback\n  cos[pos]\nIndexError: index 23 is out of bounds"
    [v] = checks.replay_matches_eager(
        BATCH, Outcome(None, graph_error), Outcome(None, eager_error), SPEC
    )
    assert v.detail.startswith("both twins raised")
    assert ("cos[pos]" in v.detail, "graph.replay()" in v.detail) == (
        "eager" in shown,
        "graph" in shown,
    )


def test_company_batch_holds_sampled_requests_reversed():
    two = Batch((*BATCH.requests, Request(9, (3,), 0, (0,), seed=1)))
    assert [r.req_id for r in sampling_check.company_batch(two).requests] == [9, 8]
    assert sampling_check.company_batch(Batch(BATCH.requests[:1])) is None


def test_greedy_company_batch_runs_about_half_of_the_greedy_requests_the_same_ones_every_step():
    greedy = [Request(i, (1,), 0, (1,)) for i in range(40)]
    sampled = Request(99, (1,), 0, (2,), seed=3)
    joined = []
    for example_seed in (0, 1):
        subs = [
            sampling_check.greedy_company_batch(Batch((*greedy[:n], sampled)), example_seed)
            for n in (10, 40)
        ]
        ids = [[r.req_id for r in sub.requests] if sub else [] for sub in subs]
        assert ids[0] == [i for i in ids[1] if i < 10]  # a request joins for the whole example
        assert 10 <= len(ids[1]) <= 30 and ids[1] == sorted(ids[1], reverse=True)
        joined.append(set(ids[1]))
    assert joined[0] != joined[1]  # another example, other greedy company
    # the company twin's own sub-batch is unchanged: the sampled requests alone
    assert [r.req_id for r in sampling_check.company_batch(Batch((*greedy, sampled))).requests] == [
        99
    ]


def test_a_greedy_request_whose_logits_move_with_its_company_fails():
    # a greedy row's per-row state followed another request (a swapped mask): -inf where eager has
    # a value
    sub = sampling_check.greedy_company_batch(Batch(BATCH.requests[:1]), _joining_seed(7))
    assert [r.req_id for r in sub.requests] == [7]
    masked = [[4.0, float("-inf"), 0.0, 0.0]]
    [v] = sampling_check.sampling_independent(
        sub,
        Outcome(result(masked, tokens=(0,))),
        BATCH,
        Outcome(result(GOOD)),
        SPEC,
        twin=sampling_check.GREEDY_COMPANY,
        check=sampling_check.COMPANY_INDEPENDENT,
    )
    assert (v.check, v.req_id) == (sampling_check.COMPANY_INDEPENDENT, 7)
    assert v.detail.startswith("logits depend on batch company")
    same = Outcome(result([GOOD[0]], tokens=(0,)))
    assert sampling_check.sampling_independent(sub, same, BATCH, Outcome(result(GOOD)), SPEC) == []


def _joining_seed(req_id: int) -> int:
    return next(s for s in range(100) if sampling_check.greedy_joins(s, req_id))


def test_company_batch_of_a_batch_dependent_runner_is_the_whole_batch_in_order_renamed():
    # Its logits may depend on the company and order, so only the KV placement may differ; and it
    # runs every step, greedy ones too, so the greedy requests' caches are there when one samples.
    renaming = sampling_check.BlockRenaming((0, 2, 3, 1))
    sub = sampling_check.company_batch(BATCH, renaming, batch_invariant=False)
    assert [(r.req_id, r.block_ids) for r in sub.requests] == [(7, (3, 1)), (8, (2,))]
    greedy = Batch(BATCH.requests[:1])
    assert sampling_check.company_batch(greedy, batch_invariant=False) == greedy


@pytest.mark.parametrize(
    ("logits", "flagged"), [(GOOD, True), ([[1.0, 1.0, 0.0, 0.0], GOOD[1]], False)]
)
def test_a_greedy_request_on_the_company_twin_is_judged_by_its_argmax(logits, flagged):
    # Row 0 is greedy: a clear argmax must not move with the KV placement; a tie decides nothing.
    whole = sampling_check.company_batch(BATCH, batch_invariant=False)
    company = Outcome(result(logits, tokens=(3, 1)))
    eager = Outcome(result(logits))
    found = sampling_check.sampling_independent(whole, company, BATCH, eager, SPEC)
    assert [(v.req_id, v.expected, v.actual) for v in found] == ([(7, "0", "3")] if flagged else [])
    assert all(v.detail.startswith("greedy token depends") for v in found)


def test_block_renaming_is_a_permutation_that_keeps_the_null_block():
    spec = dataclasses.replace(SPEC, num_blocks=9, null_block=4)
    renamings = [sampling_check.BlockRenaming.drawn(spec, seed) for seed in range(5)]
    for renaming in renamings:
        assert sorted(renaming.new_name) == list(range(9))
        assert renaming.new_name[4] == 4
    assert len({r.new_name for r in renamings}) > 1  # other examples, other placements
    assert renamings[0] == sampling_check.BlockRenaming.drawn(spec, 0)  # replays alike


def test_company_batch_renames_blocks_consistently():
    renaming = sampling_check.BlockRenaming((0, 3, 1, 2))
    shared = Batch(
        (
            Request(1, (5,), 5, (1, 2), seed=1),
            Request(2, (6,), 2, (1,), seed=2, temperature=0.5),
        )
    )
    sub = sampling_check.company_batch(shared, renaming)
    assert [(r.req_id, r.block_ids) for r in sub.requests] == [(2, (3,)), (1, (3, 1))]
    assert sub.requests[0].temperature == 0.5 and sub.requests[0].seed == 2


def test_sampled_token_that_depends_on_company_fails():
    sub = sampling_check.company_batch(BATCH)
    company = Outcome(result([GOOD[1]], tokens=(2,)))
    [v] = sampling_check.sampling_independent(sub, company, BATCH, Outcome(result(GOOD)), SPEC)
    assert (v.req_id, v.expected, v.actual) == (8, "1", "2")


def test_company_twin_with_the_same_masked_logits_passes_and_its_token_is_judged():
    sub = sampling_check.company_batch(BATCH)
    eager = Outcome(result(MASKED))
    same = Outcome(result([MASKED[1]], tokens=(1,)))
    assert sampling_check.sampling_independent(sub, same, BATCH, eager, SPEC) == []
    [v] = sampling_check.sampling_independent(
        sub, Outcome(result([MASKED[1]], tokens=(2,))), BATCH, eager, SPEC
    )
    assert (v.req_id, v.expected, v.actual) == (8, "1", "2")


def test_sampled_token_that_ignores_company_passes():
    sub = sampling_check.company_batch(BATCH)
    company = Outcome(result([GOOD[1]], tokens=(1,)))
    assert (
        sampling_check.sampling_independent(sub, company, BATCH, Outcome(result(GOOD)), SPEC) == []
    )


def view(key, base, size, offset=0):
    return AddressView(key, base, size, "pool", offset)


def test_views_of_different_graphs_must_not_overlap():
    assert addresses.address_views_disjoint([view(1, 0, 100), view(2, 100, 50)]) == []
    [v] = addresses.address_views_disjoint([view(1, 0, 100), view(2, 99, 50)])
    assert "1" in v.detail and "2" in v.detail


def test_views_of_one_graph_may_overlap():
    assert addresses.address_views_disjoint([view(1, 0, 100), view(1, 50, 100)]) == []


def test_a_shared_pool_within_the_largest_graph_plus_granularity_passes():
    views = [view(1, 0, 3000), view(2, 5000, 4000, offset=96)]
    assert addresses.pool_within_bound(views, granularity=100) == []


def test_a_pool_growing_with_every_graph_fails():
    views = [view(1, 0, 3000), view(2, 5000, 4000, offset=3000)]
    [v] = addresses.pool_within_bound(views, granularity=100)
    assert v.actual == "7000 bytes"


def test_a_stray_write_reports_the_first_changed_element_not_the_whole_row():
    before = {"kv": torch.zeros(SPEC.num_slots, 2, 3)}
    after = {"kv": before["kv"].clone()}
    after["kv"][4, 1, 2] = float("nan")
    [v] = kv_checks.kv_writes_confined(BATCH, before, after, SPEC)
    assert v.expected == "element (1, 2) = 0.0"
    assert v.actual == "element (1, 2) = nan (1 of 6 elements differ)"


def test_differences_of_equal_rows_say_so_instead_of_picking_an_element() -> None:
    row = torch.arange(48.0)
    texts = differences(row, row.clone())
    assert texts == {"expected": "all 48 elements equal", "actual": "all 48 elements equal"}


def test_differences_name_the_first_differing_element_and_the_count() -> None:
    expected = torch.zeros(2, 3)
    actual = expected.clone()
    actual[1, 2] = 5.0
    texts = differences(expected, actual)
    assert texts["expected"] == "element (1, 2) = 0.0"
    assert texts["actual"] == "element (1, 2) = 5.0 (1 of 6 elements differ)"


def _marked_where(slots: list[int], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for tensor in state.values():
        tensor[slots] = MARK
    return state


def test_every_slot_of_the_step_written_lands() -> None:
    assert kv_checks.kv_writes_land(BATCH, {"graph": kv(s6=1.0, s2=-1.0)}, SPEC) == []


def test_a_slot_of_the_step_left_marked_names_request_position_and_block() -> None:
    after = _marked_where([6], kv(s2=1.0))
    [v] = kv_checks.kv_writes_land(BATCH, {"graph": after}, SPEC)
    assert (v.check, v.slot, v.req_id) == ("kv_writes_land", 6, 7)
    assert "never wrote slot 6 (block 3), where req 7's position 2 belongs" in v.detail


def test_a_slot_another_floating_tensor_wrote_has_landed() -> None:
    # A per-slot tensor the runner writes less often than every token keeps its mark: the write
    # of the keys elsewhere in the state is what counts.
    after = {**_marked_where([6], kv()), "scale": _marked_where([6], {"s": torch.zeros(8)})["s"]}
    after["kv"][6, 0] = 2.0
    assert kv_checks.kv_writes_land(BATCH, {"graph": after}, SPEC) == []


def test_state_without_floating_slot_major_tensors_gives_nothing_to_judge() -> None:
    ids = {"ids": torch.zeros(SPEC.num_slots, dtype=torch.int64)}
    assert kv_checks.kv_writes_land(BATCH, {"graph": ids}, SPEC) == []


# Logits a half-precision model computed: the values a bfloat16 row holds, one of them in each row
# a bfloat16 step (about 0.4%) away from the next one. Different kernels for different batch sizes
# move such a model's logits by a bfloat16 step; float32 arithmetic would not.
HALF_ROW = [0.6953125, -0.69140625, 1.2578125, 0.0234375]
HALF_NEXT = [0.69140625, -0.69140625, 1.2578125, 0.0234375]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_half_precision_models_rounding_passes_as_bfloat16_or_upcast(dtype):
    # Handed out as bfloat16, or upcast to float32 as engines do: the tolerance is bfloat16's.
    eager = StepResult(
        torch.tensor([HALF_ROW, HALF_ROW], dtype=dtype), torch.tensor([2, 2]), "eager", None
    )
    graph = StepResult(
        torch.tensor([HALF_NEXT, HALF_ROW], dtype=dtype), torch.tensor([2, 2]), "full", 2
    )
    assert checks.replay_matches_eager(BATCH, Outcome(graph), Outcome(eager), SPEC) == []
    sub = sampling_check.company_batch(BATCH)
    company = Outcome(
        StepResult(torch.tensor([HALF_NEXT], dtype=dtype), torch.tensor([2]), "eager", None)
    )
    assert sampling_check.sampling_independent(sub, company, BATCH, Outcome(eager), SPEC) == []


def test_the_same_step_in_float32_logits_fails():
    # The same difference between logits float32 arithmetic made (their low bits set) is one.
    row = [v + 1e-6 for v in HALF_ROW]
    eager = StepResult(torch.tensor([row, row]), torch.tensor([2, 2]), "eager", None)
    moved = [HALF_NEXT[0] + 1e-6, *row[1:]]
    graph = StepResult(torch.tensor([moved, row]), torch.tensor([2, 2]), "full", 2)
    [v] = checks.replay_matches_eager(BATCH, Outcome(graph), Outcome(eager), SPEC)
    assert (v.check, v.row) == ("replay_matches_eager", 0)


def test_tf32_matmuls_on_cuda_judge_float32_logits_at_a_half_types_tolerance():
    # A float32 model whose GEMMs round to TF32 moves by 1e-3 of a row's scale with another
    # kernel: float32's tolerance fails it, the precision TF32 leaves passes it, on cuda only.
    row = [v + 1e-6 for v in HALF_ROW]
    moved = [row[0] * (1 + 1e-3), *row[1:]]
    eager = StepResult(torch.tensor([row, row]), torch.tensor([2, 2]), "eager", None)
    graph = StepResult(torch.tensor([moved, row]), torch.tensor([2, 2]), "full", 2)
    assert checks.replay_matches_eager(BATCH, Outcome(graph), Outcome(eager), SPEC) != []
    before = torch.backends.cuda.matmul.allow_tf32  # process-wide, as engines set it
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert tolerance.matmul_precision("cuda") is None
        torch.backends.cuda.matmul.allow_tf32 = True
        assert tolerance.matmul_precision("sim") is None
        tf32 = tolerance.matmul_precision("cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert tf32 == torch.float16
    assert checks.replay_matches_eager(BATCH, Outcome(graph), Outcome(eager), SPEC, tf32) == []


def test_a_quantized_caches_codes_pass_within_one_unit_or_the_runners_precision():
    # int8 codes round(x / scale): two paths whose x differ by rounding land on neighbours.
    slots = SPEC.num_slots
    codes = torch.full((slots, 3), 120, dtype=torch.int8)
    one, five, six = codes.clone(), codes.clone(), codes.clone()
    one[6, 0], five[6, 0], six[6, 0] = 119, 115, 114
    assert kv_checks.states_match(BATCH, {"codes": one}, {"codes": codes}, SPEC) == []
    [v] = kv_checks.states_match(BATCH, {"codes": five}, {"codes": codes}, SPEC)
    assert v.slot == 6
    # A bfloat16 model: 4e-2 of the slot's largest code, 120, is 4.8 codes.
    bf16 = torch.bfloat16
    assert kv_checks.states_match(BATCH, {"codes": five}, {"codes": codes}, SPEC, bf16) != []
    four = codes.clone()
    four[6, 0] = 116
    assert kv_checks.states_match(BATCH, {"codes": four}, {"codes": codes}, SPEC, bf16) == []
    [v] = kv_checks.states_match(BATCH, {"codes": six}, {"codes": codes}, SPEC, bf16)
    assert v.slot == 6


def test_wider_integer_state_is_still_compared_exactly():
    ids = torch.arange(SPEC.num_slots)
    off = ids.clone()
    off[6] += 1
    [v] = kv_checks.states_match(BATCH, {"ids": off}, {"ids": ids}, SPEC, torch.bfloat16)
    assert v.slot == 6


def test_float32_scales_beside_int8_codes_get_the_precision_the_logits_show():
    # The codes show no floating precision; the bfloat16 model's logits do.
    slots = SPEC.num_slots
    scales = torch.full((slots,), 0.0352)
    near = scales.clone()
    near[6] = 0.03494  # 0.6% off: the amax of bfloat16 values on another path
    eager = {"codes": torch.zeros(slots, 3, dtype=torch.int8), "scales": scales}
    graph = {"codes": eager["codes"], "scales": near}
    [v] = kv_checks.states_match(BATCH, graph, eager, SPEC)
    assert v.slot == 6
    assert kv_checks.states_match(BATCH, graph, eager, SPEC, torch.bfloat16) == []
    assert tolerance.coarser_precision(torch.float32, torch.bfloat16, None) == torch.bfloat16
    assert tolerance.coarser_precision(None, None) is None


class _RaisesWithANote:
    """A runner whose step raises as the sim does for an operation queued earlier."""

    def __init__(self, note: str | None) -> None:
        self.note = note

    def step(self, batch: Any) -> Any:
        error = IndexError("index 99 is out of bounds for dimension 0 with size 8")
        if self.note:
            error.add_note(self.note)
        raise error


def test_a_step_error_with_notes_leads_with_the_error_and_its_notes():
    note = "in a graph replay: its recorded operation 1 of 2, aten.index_select.default"
    error = step_outcome(cast(Any, _RaisesWithANote(note)), BATCH).error
    assert error is not None
    assert error.splitlines()[:3] == [
        "IndexError: index 99 is out of bounds for dimension 0 with size 8",
        note,
        "Traceback (most recent call last):",
    ]
    plain = step_outcome(cast(Any, _RaisesWithANote(None)), BATCH).error
    assert plain is not None and plain.startswith("Traceback (most recent call last):")
