"""The replay snippet of a failure: Python source that re-runs its shrunk schedule (one list of
events, or one per rank in a data-parallel campaign)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pytest_graphmode.contract import Batch
from pytest_graphmode.strategies.plans import Stress
from pytest_graphmode.strategies.rank_schedules import RankEvent, RankFault


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
        import_line,
    ]
    body = ["events = [", *(f"    {event!r}," for event in events), "]"]
    call = f"replay(events, backend={backend!r}, seed={seed}, factory={factory_expr})"
    return "\n".join([*header, "", *body, call])


def replay_ranks_snippet(
    events: Sequence[Sequence[RankEvent | RankFault]],
    *,
    factory: Callable[..., Any],
    backend: str,
    seed: int,
) -> str:
    """Python source that re-runs every rank's `events` (one list per rank) with every check,
    rank checks included (runnable as is)."""
    import_line, factory_expr = factory_reference(factory)
    header = [
        "from pytest_graphmode.contract import Batch, Request",
        "from pytest_graphmode.fuzz.ranks import replay_ranks",
        "from pytest_graphmode.strategies.plans import Stress",
        "from pytest_graphmode.strategies.rank_schedules import RankFault",
        import_line,
    ]
    body = ["events = ["]
    for rank, mine in enumerate(events):
        body += [f"    [  # rank {rank}", *(f"        {event!r}," for event in mine), "    ],"]
    body.append("]")
    call = f"replay_ranks(events, backend={backend!r}, seed={seed}, factory={factory_expr})"
    return "\n".join([*header, "", *body, call])
