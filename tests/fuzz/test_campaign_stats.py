"""CampaignStats and Failure: merging (xdist workers) and their one JSON form."""

from __future__ import annotations

import json
import pickle
from collections import Counter

from pytest_graphmode.fuzz import CampaignStats, Failure, GraphmodeFailure

FAILURE = Failure("padding_inert", 2, "row 0 changed", 7, "replay([...])")


def stats(examples: int, bucket: int, failures: list[Failure]) -> CampaignStats:
    return CampaignStats(
        examples=examples,
        steps=examples * 2,
        buckets_hit=Counter({bucket: 2}),
        paths=Counter({"full": 1, "eager": 1}),
        fallback_reasons=Counter({"prefill": 1}),
        checks_run=Counter({"states_match": 2}),
        failures=failures,
        seconds=1.5,
    )


def test_merge_adds_every_counter_and_keeps_both_failure_lists():
    merged = stats(1, 4, []).merge(stats(2, 8, [FAILURE]))
    assert (merged.examples, merged.steps, merged.seconds) == (3, 6, 3.0)
    assert merged.buckets_hit == Counter({4: 2, 8: 2})
    assert merged.paths == Counter({"full": 2, "eager": 2})
    assert merged.checks_run["states_match"] == 4
    assert merged.failures == [FAILURE]


def test_merge_leaves_its_inputs_unchanged():
    left = stats(1, 4, [])
    left.merge(stats(1, 4, [FAILURE]))
    assert left.examples == 1 and left.failures == []


def test_to_json_is_plain_json_with_string_bucket_keys():
    data = stats(1, 4, [FAILURE]).to_json()
    assert json.loads(json.dumps(data)) == data
    assert data["buckets_hit"] == {"4": 2}
    assert data["failures"][0]["check"] == "padding_inert"


def test_stats_and_failures_survive_their_json_form():
    original = stats(2, 8, [FAILURE])
    copy = CampaignStats.from_json(json.loads(json.dumps(original.to_json())))
    assert copy == original
    assert Failure.from_json(FAILURE.to_json()) == FAILURE


def test_a_failure_survives_pickling_with_its_stats():
    raised = GraphmodeFailure(FAILURE, stats(1, 4, [FAILURE]))
    copy = pickle.loads(pickle.dumps(raised))
    assert copy.failure == FAILURE and copy.stats.examples == 1 and str(copy) == FAILURE.message


def failed_stats(first_example: int, check: str, campaign: str = "campaign") -> CampaignStats:
    return CampaignStats(
        examples=first_example + 3,
        shrink_examples=3,
        first_failure_seconds=2.5,
        first_failure_example=first_example,
        first_failure_check=check,
        first_failure_campaign=campaign,
        shrink_seconds=4.0,
        shrink_budget_seconds=20.0,
        shrink_stopped_by_budget=True,
        planned_examples=50,
    )


def test_merge_keeps_the_first_campaigns_first_failure_and_adds_the_rest():
    merged = CampaignStats(planned_examples=10).merge(failed_stats(4, "padding_inert"))
    merged = merged.merge(failed_stats(9, "states_match", "pinned seed 0"))
    assert (merged.first_failure_example, merged.first_failure_check) == (4, "padding_inert")
    assert merged.first_failure_campaign == "campaign"
    assert (merged.shrink_seconds, merged.planned_examples) == (8.0, 110)
    assert merged.shrink_examples == 6
    assert merged.shrink_stopped_by_budget and merged.shrink_budget_seconds == 20.0


def test_first_failure_fields_survive_the_json_form():
    original = failed_stats(4, "padding_inert")
    assert CampaignStats.from_json(json.loads(json.dumps(original.to_json()))) == original


def test_a_report_written_before_the_first_failure_fields_still_reads():
    old = stats(2, 8, [FAILURE]).to_json()
    for key in (
        "first_failure_check",
        "first_failure_campaign",
        "shrink_seconds",
        "shrink_examples",
    ):
        del old[key]
    assert CampaignStats.from_json(old) == stats(2, 8, [FAILURE])


def test_update_from_takes_every_count():
    held = CampaignStats()
    held.update_from(failed_stats(4, "padding_inert"))
    assert held == failed_stats(4, "padding_inert")
