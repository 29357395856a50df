"""The campaigns a run skipped, and why, for the summary: pytest's own tally ("1 failed, 1 passed,
4 skipped") does not say that the skips are campaigns, nor that they were skipped on purpose (a
pinned seed the run's seed already names, the campaigns after the first failure)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

SKIPPED_CAMPAIGN_PROPERTY = "graphmode_skipped_campaign"
"""`user_properties` key of the report of a skipped test that would have run campaigns (one that
asks for the `graphmode_fuzz` fixture): the reason, which an xdist worker sends to the
controller with the report."""


def mark_if_skipped_campaign(item: pytest.Item, report: pytest.TestReport) -> None:
    """Tag `report` where it is a campaign test's skip."""
    if report.skipped and "graphmode_fuzz" in getattr(item, "fixturenames", ()):
        report.user_properties.append((SKIPPED_CAMPAIGN_PROPERTY, _reason(report)))


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


class SkippedCampaigns:
    """Collects the tagged reports this process sees: its own, or on the xdist controller every
    worker's."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}  # test id -> why it was skipped

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for key, reason in report.user_properties:
            if key == SKIPPED_CAMPAIGN_PROPERTY:
                self.reasons[report.nodeid] = str(reason)


def skipped_lines(reasons: Mapping[str, str]) -> list[str]:
    """The summary's lines on skipped campaigns: how many, then the tests of each reason."""
    if not reasons:
        return []
    by_reason: dict[str, list[str]] = {}
    for nodeid, reason in reasons.items():
        by_reason.setdefault(reason, []).append(nodeid.rpartition("::")[2])
    lines = [f"campaigns skipped: {len(reasons)} (pytest counts each as a skipped test)"]
    lines += [f"  {', '.join(tests)}: {reason}" for reason, tests in by_reason.items()]
    return lines
