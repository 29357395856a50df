"""The replay snippet of a failure: Python source that re-runs its shrunk schedule (one list of
events, or one per rank in a data-parallel campaign)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pytest_graphmode.contract import Batch
from pytest_graphmode.strategies.plans import Reset, Stress
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
    events: Sequence[Batch | Stress | Reset],
    *,
    factory: Callable[..., Any],
    backend: str,
    seed: int,
) -> str:
    """Python source that re-runs `events` with every check (runnable as is)."""
    import_line, factory_expr = factory_reference(factory)
    body = ["events = [", *_numbered(events), "]"]
    header = _imports("\n".join(body), "from pytest_graphmode.fuzz import replay", import_line)
    call = f"replay(events, backend={backend!r}, seed={seed}, factory={factory_expr})"
    return "\n".join([*header, "", *body, call])


def _numbered(events: Sequence[Batch | Stress | Reset]) -> list[str]:
    """One line per event; each batch says its step, as the failure message counts them: from 0,
    and from 0 again after every `Reset` (each example on kept twins starts at step 0)."""
    lines = []
    step = 0
    for event in events:
        if isinstance(event, Batch):
            lines.append(f"    {event!r},  # step {step}")
            step += 1
        else:
            lines.append(f"    {event!r},")
            if isinstance(event, Reset):
                step = 0
    return lines


def _imports(source: str, runner: str, factory_import: str) -> list[str]:
    """The import lines `source` needs: only the names its reprs use, since an unused import is
    noise in a program people read and a lint error where they paste it."""
    contract = [name for name in ("Batch", "Request") if f"{name}(" in source]
    lines = [f"from pytest_graphmode.contract import {', '.join(contract)}"] if contract else []
    lines.append(runner)
    plans = [name for name in ("Reset", "Stress") if f"{name}(" in source]
    if plans:
        lines.append(f"from pytest_graphmode.strategies.plans import {', '.join(plans)}")
    if "RankFault(" in source:
        lines.append("from pytest_graphmode.strategies.rank_schedules import RankFault")
    if factory_import:
        lines.append(factory_import)
    return lines


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
    body = ["events = ["]
    for rank, mine in enumerate(events):
        body += [f"    [  # rank {rank}", *(f"        {event!r}," for event in mine), "    ],"]
    body.append("]")
    runner = "from pytest_graphmode.fuzz.ranks import replay_ranks"
    header = _imports("\n".join(body), runner, import_line)
    call = f"replay_ranks(events, backend={backend!r}, seed={seed}, factory={factory_expr})"
    return "\n".join([*header, "", *body, call])
