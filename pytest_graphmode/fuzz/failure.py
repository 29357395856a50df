"""Failures: what a broken check reports, and the snippet that replays it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_graphmode.contract import Batch
from pytest_graphmode.strategies.plans import Stress

if TYPE_CHECKING:
    from pytest_graphmode.campaign_stats import CampaignStats


@dataclass(frozen=True)
class Failure:
    check: str
    step: int
    message: str
    seed: int | None
    replay_snippet: str


class GraphmodeFailure(AssertionError):
    """A check failed; `failure` says which and how to replay it, `stats` what ran until then."""

    def __init__(self, failure: Failure, stats: CampaignStats | None = None) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.stats = stats

    def __reduce__(self) -> tuple[type[GraphmodeFailure], tuple[Failure, CampaignStats | None]]:
        return (GraphmodeFailure, (self.failure, self.stats))  # crosses xdist worker boundaries


def factory_reference(factory: Callable[..., Any]) -> tuple[str, str]:
    """(header line, expression) naming `factory` in a snippet: an import where `factory` is
    importable by name, else a comment asking the reader to supply it."""
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", "")
    if module and qualname and "<" not in qualname and "." not in qualname:
        return f"from {module} import {qualname}", qualname
    return (
        "# make_target: your TargetFactory, (mode, *, seed, backend) -> GraphTarget",
        "make_target",
    )


def replay_snippet(
    events: Sequence[Batch | Stress], *, factory: Callable[..., Any], backend: str, seed: int
) -> str:
    """Python source that re-runs `events` with every check (runnable as is)."""
    import_line, factory_expr = factory_reference(factory)
    header = [
        "from pytest_graphmode.contract import Batch, Request",
        "from pytest_graphmode.fuzz import replay",
        "from pytest_graphmode.strategies.plans import Stress",
    ]
    if import_line:
        header.append(import_line)
    body = ["events = [", *(f"    {event!r}," for event in events), "]"]
    call = f"replay(events, backend={backend!r}, seed={seed}, factory={factory_expr})"
    return "\n".join([*header, "", *body, call])
