"""The session summary, its lines, the JSON report and the live progress line."""

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pytest_graphmode.campaign_stats import CampaignStats, SessionSummary
from pytest_graphmode.failure import MADE_TWINS, Failure
from pytest_graphmode.report import (
    ProgressLine,
    campaign_line,
    check_glossary,
    summary_lines,
    write_report,
)
from pytest_graphmode.skipped import skipped_lines


def campaign(**overrides: Any) -> CampaignStats:
    stats: dict[str, Any] = {
        "examples": 3,
        "steps": 20,
        "seconds": 1.5,
        "buckets_hit": Counter({1: 4, 8: 2}),
        "paths": Counter({"full": 15, "eager": 5}),
        "fallback_reasons": Counter({"prefill": 5}),
        "checks_run": Counter({"replay_matches_eager": 20}),
        "failures": [],
    }
    stats.update(overrides)
    return CampaignStats(**stats)


FAILURE = Failure(
    check="kv_writes_confined",
    step=2,
    message="slot 17 changed\nmore detail",
    seed=9,
    replay_snippet="replay([...])",
)


def test_campaigns_add_up() -> None:
    summary = SessionSummary()
    summary.add_campaign(campaign())
    summary.add_campaign(campaign(buckets_hit=Counter({8: 1}), failures=[FAILURE]))
    assert (summary.campaigns, summary.stats.examples, summary.stats.steps) == (2, 6, 40)
    assert summary.stats.buckets_hit == {1: 4, 8: 3}
    assert summary.stats.failures == [FAILURE]


def test_summary_json_missing_a_key_is_rejected_with_the_keys_it_has() -> None:
    data = SessionSummary(1, campaign()).to_json()
    del data["paths"]
    with pytest.raises(ValueError, match=r"lacks keys \['paths'\]"):
        SessionSummary.from_json(data)


def test_worker_summaries_merge_through_json() -> None:
    controller, worker = SessionSummary(), SessionSummary()
    controller.add_campaign(campaign())
    worker.add_campaign(campaign(failures=[FAILURE]))
    controller.merge(SessionSummary.from_json(json.loads(json.dumps(worker.to_json()))))
    assert (controller.campaigns, controller.stats.steps) == (2, 40)
    assert controller.stats.paths == {"full": 30, "eager": 10}
    assert controller.stats.buckets_hit == {1: 8, 8: 4}
    assert controller.stats.failures == [FAILURE]


def test_pipelined_steps_survive_json_and_add_up_across_campaigns() -> None:
    summary = SessionSummary()
    summary.add_campaign(campaign(pipelined_steps=4))
    summary.merge(
        SessionSummary.from_json(SessionSummary(1, campaign(pipelined_steps=6)).to_json())
    )
    assert summary.stats.pipelined_steps == 10


def test_summary_lines_show_paths_buckets_reasons_checks_and_failures() -> None:
    summary = SessionSummary()
    keys = Counter({"('decode', 1)": 4, "('decode', 2)": 11})
    summary.add_campaign(
        campaign(
            buckets_hit=Counter({16: 1, 2: 3}),
            pipelined_steps=6,
            graph_keys=keys,
            failures=[FAILURE],
        )
    )
    assert summary_lines(summary, base_seed=3121328572) == [
        "campaigns: 1  examples: 3  steps: 20  time: 1.5 s",
        "paths: full 15  piecewise 0  eager 5",
        "pipelined: 6 of 20 steps (in pairs, the second submitted before the first was read)",
        "token buckets hit (steps per capture size their tokens pad to, whichever path or graph "
        "ran them; 0: more tokens than the largest, any phase): 2: 3, 16: 1",
        "fallback reasons: prefill: 5",
        "checks run: replay_matches_eager: 20",
        "graph keys replayed (steps per key): ('decode', 2): 11, ('decode', 1): 4",
        "failures: 1",
        "  FAILED kv_writes_confined at step 2 (replay seed 9): slot 17 changed",
        "  (run a failure's replay snippet to reproduce it alone, or --graphmode-seed=3121328572 "
        "to rerun every campaign; the replay seed is the one its snippet passes to `replay`)",
    ]


def test_a_failure_in_the_twins_construction_is_summarised_as_before_step_0() -> None:
    made = Failure("states_match", MADE_TWINS, "state 'kv' differs", 4, "replay(...)")
    summary = SessionSummary(1, campaign(failures=[made]))
    line = next(line for line in summary_lines(summary) if "FAILED" in line)
    assert line == (
        "  FAILED states_match before step 0 (when the twins were made) (replay seed 4): "
        "state 'kv' differs"
    )
    assert Failure.from_json(made.to_json()) == made


def test_fallback_reasons_are_grouped_by_cause_with_the_top_few_shown() -> None:
    reasons = Counter(
        {
            **{f"batch of {n} tokens exceeds the largest capture size 8": 2 for n in range(9, 40)},
            **{
                f"non-uniform query lengths (mixed batch), piecewise not enabled {n}": 1
                for n in range(50)
            },
            "no capture sizes configured (full graphs disabled)": 3,
            "query length 3 exceeds max_query_len=2 of the full graphs": 1,
            "adapter 4 not captured": 1,
        }
    )
    line = summary_lines(SessionSummary(1, campaign(fallback_reasons=reasons)))[4]
    # numbers that differ from batch to batch become N; one every reason of a cause shares (the
    # largest size, 8) and those of a cause seen once stay
    assert line == (
        "fallback reasons: batch of N tokens exceeds the largest capture size 8: 62, "
        "non-uniform query lengths (mixed batch): 50, "
        "no capture sizes configured (full graphs disabled): 3, "
        "query length 3 exceeds max_query_len=2 of the full graphs: 1 (+1 more in the JSON report)"
    )


def test_checks_that_judged_nothing_are_named_not_applicable() -> None:
    summary = SessionSummary(1, campaign())
    lines = summary_lines(
        summary, checks=("replay_matches_eager", "address_views_disjoint", "pool_within_bound")
    )
    assert "checks run: replay_matches_eager: 20" in lines
    assert (
        "not applicable (nothing to judge in this run): address_views_disjoint, pool_within_bound"
        in lines
    )


def test_glossary_explains_failed_checks_and_every_check_with_verbose() -> None:
    summary = SessionSummary(1, campaign(failures=[FAILURE]))
    descriptions = {"kv_writes_confined": "only valid slots change", "states_match": "same state"}
    assert check_glossary(summary, descriptions, verbose=False) == [
        "what the checks prove:",
        "  kv_writes_confined: only valid slots change",
        "(-v explains every check)",
    ]
    assert check_glossary(summary, descriptions, verbose=True) == [
        "what the checks prove:",
        "  kv_writes_confined: only valid slots change",
        "  states_match: same state",
    ]


def test_report_file_holds_run_facts_and_results(tmp_path: Path) -> None:
    summary = SessionSummary()
    summary.add_campaign(campaign(failures=[FAILURE]))
    path = tmp_path / "out" / "report.json"
    write_report(path, summary, {"backend": "sim", "seed": 3})
    document = json.loads(path.read_text())
    assert document["version"] == 1
    assert document["run"] == {"backend": "sim", "seed": 3}
    assert (document["campaigns"], document["steps"]) == (1, 20)
    assert document["failures"] == [FAILURE.to_json()]


def test_progress_line_is_throttled_and_the_last_update_is_shown() -> None:
    shown: list[str] = []
    now = [0.0]
    line = ProgressLine(
        shown.append, lambda: shown.append("\n"), "campaign", 1.0, lambda: now[0], planned=50
    )
    line.update(campaign(examples=1, steps=5))
    now[0] = 0.5
    line.update(campaign(examples=2, steps=9))
    line.finish()
    assert shown == [
        "\n",
        "graphmode campaign: example 1 of 50, 5 steps, 0 failures",
        "graphmode campaign: example 2 of 50, 9 steps, 0 failures",
        "\n",
    ]


def test_progress_line_drops_updates_inside_the_interval() -> None:
    shown: list[str] = []
    now = [0.0]
    line = ProgressLine(shown.append, lambda: shown.append("\n"), "campaign", 1.0, lambda: now[0])
    for examples in range(1, 5):
        now[0] = examples * 0.4
        line.update(campaign(examples=examples, steps=examples))
    assert shown == [
        "\n",
        "graphmode campaign: example 1, 1 steps, 0 failures",
        "graphmode campaign: example 4, 4 steps, 0 failures",
    ]


def test_progress_line_prefers_the_engines_planned_examples() -> None:
    shown: list[str] = []
    line = ProgressLine(shown.append, lambda: None, "campaign", planned=10)
    stats = campaign(examples=3)
    stats.planned_examples = 12  # type: ignore[attr-defined]
    line.update(stats)
    assert shown == ["graphmode campaign: example 3 of 12, 20 steps, 0 failures"]


def test_progress_line_names_a_time_budget_instead_of_an_example_count() -> None:
    shown: list[str] = []
    line = ProgressLine(shown.append, lambda: None, "campaign")
    stats = campaign(examples=3)
    stats.time_budget_seconds = 20.0
    line.update(stats)
    assert shown == ["graphmode campaign: example 3 in a 20 s budget, 20 steps, 0 failures"]


def test_progress_line_says_a_failure_was_found_while_shrinking() -> None:
    shown: list[str] = []
    line = ProgressLine(shown.append, lambda: None, "campaign", 0.0, planned=50)
    stats = campaign(examples=7)
    fields = {
        "first_failure_example": 7,
        "first_failure_check": "kv_writes_confined",
        "first_failure_seconds": 4.25,
        "shrinking": True,
        "shrink_seconds": 12.0,
        "shrink_budget_seconds": 60.0,
    }
    for name, value in fields.items():
        setattr(stats, name, value)
    line.update(stats)
    stats.shrinking = False  # type: ignore[attr-defined]
    line.update(stats)
    assert shown == [
        "graphmode campaign: FAILURE found by kv_writes_confined at example 7 after 4.2 s; "
        "shrinking it to a minimal schedule (12 s of 60 s)",
        "graphmode campaign: example 7 of 50, 20 steps, 0 failures; FAILURE found by "
        "kv_writes_confined at example 7 after 4.2 s",
    ]


def test_campaign_line_sums_up_a_finished_test_for_the_xdist_controller() -> None:
    data = {"campaigns": 1, "examples": 50, "steps": 412, "failures": 0, "seconds": 12.34}
    assert campaign_line("suite.py::test_campaign", data) == (
        "graphmode suite.py::test_campaign: 1 campaign(s), 50 examples, 412 steps, 0 failures, "
        "12.3 s"
    )


def test_a_fallback_cause_keeps_a_graph_key_whole() -> None:
    reasons = Counter(
        {
            f"captured the graph keyed ({n}, 32, 256): the capture step ran eagerly": 1
            for n in (16, 32)
        }
    )
    line = summary_lines(SessionSummary(1, campaign(fallback_reasons=reasons)))[4]
    assert (
        line
        == "fallback reasons: captured the graph keyed (N, 32, 256): the capture step ran eagerly: 2"
    )


def test_every_check_has_a_description_in_the_glossary() -> None:
    from pytest_graphmode.fuzz.registry import CHECKS
    from pytest_graphmode.plugin import _check_descriptions

    descriptions = _check_descriptions()
    assert list(descriptions) == list(CHECKS)
    assert [name for name, text in descriptions.items() if text == "(no description)"] == []


def test_a_number_that_is_part_of_a_causes_text_is_kept() -> None:
    reasons = Counter({f"query longer than 1 + {k} tokens": k for k in (2, 3, 4)})
    line = summary_lines(SessionSummary(1, campaign(fallback_reasons=reasons)))[4]
    assert line == "fallback reasons: query longer than 1 + N tokens: 9"


def test_summary_says_how_many_examples_shrank_a_failure() -> None:
    summary = SessionSummary()
    summary.add_campaign(campaign(examples=40, shrink_examples=31, failures=[FAILURE]))
    assert summary_lines(summary)[0] == (
        "campaigns: 1  examples: 40 (31 of them shrinking a failure)  steps: 20  time: 1.5 s"
    )


def test_summary_shows_the_most_replayed_graph_keys_and_how_many_more() -> None:
    keys = Counter({f"('decode', {n})": n for n in range(1, 15)})
    lines = summary_lines(SessionSummary(1, campaign(graph_keys=keys)))
    line = next(line for line in lines if line.startswith("graph keys replayed"))
    assert line.startswith("graph keys replayed (steps per key): ('decode', 14): 14, ")
    assert line.endswith("('decode', 7): 7 (and 6 more)")


def test_graph_keys_survive_json_and_add_up() -> None:
    one = campaign(graph_keys=Counter({"('decode', 4)": 3}))
    summary = SessionSummary(1, one)
    summary.merge(SessionSummary.from_json(SessionSummary(1, one).to_json()))
    assert summary.stats.graph_keys == {"('decode', 4)": 6}


@pytest.mark.parametrize(
    ("found", "said"),
    [
        (
            {"first_failure_leading": "first_partial_bucket"},
            "not shrunk: it is the leading example first_partial_bucket",
        ),
        (
            {"shrink_stopped_by_budget": True, "shrink_budget_seconds": 5.0, "shrink_seconds": 5.2},
            "shrinking stopped at its 5 s budget after 5.2 s",
        ),
        ({"shrink_seconds": 1.25}, "shrinking finished after 1.2 s"),
    ],
)
def test_the_first_failure_line_says_whether_and_how_long_it_was_shrunk(
    found: dict[str, Any], said: str
) -> None:
    stats = campaign(
        first_failure_check="replay_matches_eager",
        first_failure_example=3,
        first_failure_seconds=1.0,
        **found,
    )
    line = next(line for line in summary_lines(SessionSummary(1, stats)) if "first fail" in line)
    assert line == f"first failure: replay_matches_eager at example 3 after 1.0 s; {said}"


def test_skipped_campaigns_are_counted_and_grouped_by_reason() -> None:
    reasons = {
        "suite.py::test_campaign_pinned_scheduler_seed[0]": "not run twice",
        "suite.py::test_campaign_pinned_scheduler_seed[1]": "an earlier campaign failed",
        "suite.py::test_other_campaign": "an earlier campaign failed",
    }
    assert skipped_lines(reasons) == [
        "campaigns skipped: 3 (pytest counts each as a skipped test)",
        "  test_campaign_pinned_scheduler_seed[0]: not run twice",
        "  test_campaign_pinned_scheduler_seed[1], test_other_campaign: an earlier campaign failed",
    ]
    assert skipped_lines({}) == []
