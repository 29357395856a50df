"""Whose code raised an exception that escaped the harness's work around a step: the runner's or
the harness's own.

A twin's `step` is caught where it runs (`lockstep.step_outcome`): what it raises is a finding. The
runner's other methods run inside the harness's work around the step (`update_weights` before it,
`state()` and `static_buffers()` for the snapshots, marks and poisoning), and what they raise
escapes that work: a finding too, of the same check, once this module has found the runner's
frame on the way. An exception with no runner code between the harness and where it was raised is
the harness's own (`HarnessError`): a bug in pytest-graphmode, or something the runner handed it
that no check names. Reporting that as a failed check would blame the runner for it.

Runner code is any module but the harness's and the libraries': the shipped runtime and its
backends are runner code (the sim raises there for the runner's operations, some of them deferred
until the harness synchronizes), and so is whatever the target's factory imports.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType, TracebackType

HARNESS = "pytest_graphmode"
# The shipped runner, the backends it runs on, and the Hugging Face target: runner code.
RUNNER_SIDE = ("pytest_graphmode.runtime", "pytest_graphmode.hf")
LIBRARIES = frozenset(
    {"torch", "functorch", "triton", "numpy", "hypothesis", "_pytest", "pytest", "pluggy"}
) | frozenset(sys.stdlib_module_names)


class HarnessError(Exception):
    """The harness's own code raised, with no runner code on the way: not a finding about the
    runner. The message says where, at which step, and how to replay it; the exception raised is
    its `__cause__`."""


def is_runner_module(module: str) -> bool:
    """Whether code of `module` (a frame's `__name__`) is the runner's, not the harness's or a
    library's."""
    top = module.partition(".")[0]
    if top == HARNESS:
        return module.startswith(RUNNER_SIDE)
    return top not in LIBRARIES


@dataclass(frozen=True)
class RunnerCall:
    """Where the harness called into the runner, in an exception's traceback."""

    twin: str | None  # which twin's method raised (None: no frame's `self` is a twin)
    method: str  # the function the harness called
    caller: str  # the harness's function that called it, with file and line


def runner_call(error: BaseException, twins: Mapping[str, object]) -> RunnerCall | None:
    """Where the harness called the runner code `error` was raised in (None: it was raised in no
    runner code). `twins`: name -> target, to say whose method it was."""
    frames = _frames(error.__traceback__)
    for index, (frame, _) in enumerate(frames):
        if not is_runner_module(frame.f_globals.get("__name__", "")):
            continue
        caller, line = frames[index - 1] if index else frames[index]
        where = f"{caller.f_code.co_name} at {caller.f_code.co_filename}:{line}"
        twin = _twin([f for f, _ in frames[: index + 1]], twins)
        return RunnerCall(twin, frame.f_code.co_name, where)
    return None


def harness_error(error: BaseException, when: str, snippet: str) -> HarnessError:
    """The `HarnessError` of `error`, raised by the harness's own code `when` ("at step 3 (seed
    7)"); `snippet` replays the example."""
    raised = traceback.extract_tb(error.__traceback__)
    where = f"{raised[-1].filename}:{raised[-1].lineno} ({raised[-1].name})" if raised else "?"
    return HarnessError(
        f"pytest-graphmode's own code raised {type(error).__name__}: {error}\n"
        f"{when}, at {where}, with no runner code between the harness and the raise.\n"
        "This is a bug in pytest-graphmode, or something the runner handed the harness that the "
        "contract forbids and no check names (a state() tensor of the wrong device or shape, for "
        "example); it is not reported as a failed check of the runner. Replay it with:\n"
        f"{snippet}"
    )


def _frames(tb: TracebackType | None) -> list[tuple[FrameType, int]]:
    """A traceback's frames, outermost first, each with the line it was at."""
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def _twin(frames: list[FrameType], twins: Mapping[str, object]) -> str | None:
    """The twin whose method the outermost of `frames` that has a twin as `self` runs."""
    by_id = {id(target): name for name, target in twins.items()}
    for frame in frames:
        name = by_id.get(id(frame.f_locals.get("self")))
        if name is not None:
            return name
    return None
