"""The session summary, its lines, the JSON report and the live progress line."""

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pytest_graphmode.campaign_stats import CampaignStats, SessionSummary
from pytest_graphmode.failure import Failure
from pytest_graphmode.report import ProgressLine, summary_lines, write_report


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


def test_summary_lines_show_paths_buckets_reasons_checks_and_failures() -> None:
    summary = SessionSummary()
    summary.add_campaign(campaign(buckets_hit=Counter({16: 1, 2: 3}), failures=[FAILURE]))
    assert summary_lines(summary) == [
        "campaigns: 1  examples: 3  steps: 20  time: 1.5 s",
        "paths: full 15  piecewise 0  eager 5",
        "buckets hit: 2: 3, 16: 1",
        "fallback reasons: prefill: 5",
        "checks run: replay_matches_eager: 20",
        "failures: 1",
        "  FAILED kv_writes_confined at step 2 (seed 9): slot 17 changed",
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
    line = ProgressLine(shown.append, lambda: shown.append("\n"), "campaign", 1.0, lambda: now[0])
    line.update(1, 5, 0)
    now[0] = 0.5
    line.update(2, 9, 0)
    line.finish()
    assert shown == [
        "\n",
        "graphmode campaign: 1 examples, 5 steps, 0 failures so far",
        "graphmode campaign: 2 examples, 9 steps, 0 failures so far",
        "\n",
    ]


def test_progress_line_drops_updates_inside_the_interval() -> None:
    shown: list[str] = []
    now = [0.0]
    line = ProgressLine(shown.append, lambda: shown.append("\n"), "campaign", 1.0, lambda: now[0])
    for examples in range(1, 5):
        now[0] = examples * 0.4
        line.update(examples, examples, 0)
    assert shown == [
        "\n",
        "graphmode campaign: 1 examples, 1 steps, 0 failures so far",
        "graphmode campaign: 4 examples, 4 steps, 0 failures so far",
    ]
