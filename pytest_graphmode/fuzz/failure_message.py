"""The text of a campaign's failure: the check and where it failed, what the check saw, the steps
involved (a pipelined pair's two) with how the graph twin ran each, and the snippet that replays
the schedule."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import NamedTuple

from pytest_graphmode.contract import Batch, StepResult
from pytest_graphmode.fuzz.violation import Violation


class Ran(NamedTuple):
    """How the graph twin ran a step, kept for a failure's message (its result's tensors not)."""

    path: str
    graph_key: Hashable | None
    reason: str | None


def how_it_ran(result: StepResult | Ran | None) -> str:
    """The graph twin's path and graph for a step, as a failure's message adds it to the step's
    line; its result's `reason` too where it ran off a whole graph."""
    if result is None:
        return "; graph twin: raised"
    ran = f"; graph twin: path {result.path}"
    if result.graph_key is not None:
        ran += f", graph key {result.graph_key!r}"
    if result.path != "full" and result.reason:
        ran += f" ({result.reason})"
    return ran


def failure_message(
    violation: Violation,
    step: int,
    batch: Batch | None,
    pair: tuple[Batch, Batch] | None,
    where: str,
    ran: Mapping[int, Ran | None],
    snippet: str,
) -> str:
    """The message of `violation` at `step` (`batch` None: an example without steps), `where` the
    seed and example it was found in; `pair`: the batches of the pipelined pair `step` belongs to
    (`step` its first or second), both described; `ran`: how the graph twin ran each step."""
    steps = [] if batch is None else [(step, batch)]
    pipelined = []
    failed_at = f"step {step}"
    if pair is not None:
        start = step if batch is pair[0] else step - 1
        steps = [(start, pair[0]), (start + 1, pair[1])]
        failed_at += f", in the pipelined pair of steps {start} and {start + 1}"
        pipelined = [
            f"steps {start} and {start + 1} ran as a pipelined pair: step {start + 1} was "
            f"submitted to the graph twin before anything of step {start} was read (whether "
            "the pairing matters: the snippet with `pipelined=False` in that `Stress` runs "
            "them one after the other)"
        ]
    return "\n".join(
        [
            f"graphmode check {violation.check!r} failed at {failed_at} ({where})",
            violation.describe(),
            *(
                f"step {at}: {shown.num_reqs} requests, {shown.num_tokens} tokens, phase "
                f"{shown.phase}, query lengths {shown.query_lens}"
                + (how_it_ran(ran[at]) if at in ran else "")
                for at, shown in steps
            ),
            *pipelined,
            "replay the minimal schedule with:",
            snippet,
        ]
    )
