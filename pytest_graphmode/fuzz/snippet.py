"""The replay snippet of a failure: Python source that re-runs its shrunk schedule."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pytest_graphmode.contract import Batch
from pytest_graphmode.strategies.plans import Stress


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
    body = ["events = [", *(f"    {event!r}," for event in events), "]"]
    source = "\n".join(body)
    # Only the names the events' reprs use: an unused import is noise in a program people read
    # and a lint error where they paste it.
    contract = [name for name in ("Batch", "Request") if f"{name}(" in source]
    header = []
    if contract:
        header.append(f"from pytest_graphmode.contract import {', '.join(contract)}")
    header.append("from pytest_graphmode.fuzz import replay")
    if "Stress(" in source:
        header.append("from pytest_graphmode.strategies.plans import Stress")
    if import_line:
        header.append(import_line)
    call = f"replay(events, backend={backend!r}, seed={seed}, factory={factory_expr})"
    return "\n".join([*header, "", *body, call])
