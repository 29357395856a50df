"""Item 7: fuzz throughput (examples/s, steps/s) of `run_campaign` on the default target."""

from __future__ import annotations

from typing import Any

from graph_workloads import Suite

from pytest_graphmode.fuzz import CampaignStats, run_campaign
from pytest_graphmode.runtime.target import make_target


def test_fuzz_campaign_throughput(benchmark: Any, graphmode_backend: Any, suite: Suite) -> None:
    def campaign() -> CampaignStats:
        return run_campaign(
            make_target,
            backend=graphmode_backend.name,
            max_examples=suite.fuzz_examples,
            max_steps=suite.fuzz_steps,
            seed=0,
        )

    stats = benchmark.pedantic(campaign, rounds=1)
    assert not stats.failures, stats.failures
    benchmark.group = "7 fuzz throughput"
    benchmark.extra_info.update(
        examples=stats.examples,
        steps=stats.steps,
        seconds=stats.seconds,
        examples_per_s=stats.examples / stats.seconds,
        steps_per_s=stats.steps / stats.seconds,
    )
