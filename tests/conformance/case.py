"""A conformance case: one CUDA-graph semantic, what it shows on a backend, and what CUDA shows.

A case is a function of a backend that returns an outcome string ("value=[2.0, 2.0]", "stale",
"captured", ...) naming what a program can observe. An exception escaping the case is its outcome
too ("raises CaptureError"). The same function runs on every backend; the case declares CUDA's
outcome beside it, and, where sim differs on purpose, sim's outcome and the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

# About 20 ms of device time at H200 clocks: long enough that the host side of a race always
# runs first, short enough that a case stays well under a second.
_BUSY_CYCLES = 40_000_000


@dataclass(frozen=True)
class Case:
    name: str
    topic: str
    run: Callable[[Any], str]
    cuda: str  # the outcome on a GPU
    sim: str | None = None  # sim's documented outcome where it differs from CUDA on purpose
    why: str = ""  # why sim differs on purpose
    pending: str = ""  # what the sim device must change before sim shows CUDA's outcome

    @property
    def deliberate(self) -> bool:
        return self.sim is not None

    def expected(self, backend: str) -> str:
        if backend == "sim" and self.sim is not None:
            return self.sim
        return self.cuda

    @property
    def note(self) -> str:
        if self.deliberate:
            return f"deliberate: {self.why}"
        return self.pending


CASES: list[Case] = []


def case(
    cuda: str, *, sim: str | None = None, why: str = "", pending: str = ""
) -> Callable[[Callable[[Any], str]], Callable[[Any], str]]:
    """Register a case function with CUDA's outcome (and sim's, where it differs on purpose)."""
    if (sim is None) != (not why):
        raise ValueError("a deliberate difference needs both the sim outcome and why")
    if pending and not pending.startswith("sim device: "):
        raise ValueError("pending reasons start with 'sim device: '")

    def register(fn: Callable[[Any], str]) -> Callable[[Any], str]:
        topic = fn.__module__.rsplit(".", 1)[-1].removeprefix("cases_")
        if any(c.name == fn.__name__ for c in CASES):
            raise ValueError(f"two conformance cases are named {fn.__name__}")
        CASES.append(Case(fn.__name__, topic, fn, cuda, sim, why, pending))
        return fn

    return register


@dataclass(frozen=True)
class Result:
    outcome: str
    detail: str  # the exception message, for a person reading a disagreement


def outcome_of(be: Any, c: Case) -> Result:
    """Run one case on `be` and leave the backend as it found it, whatever the case did."""
    try:
        outcome = c.run(be)
        # Queued work that fails (an asynchronous replay reading freed memory) fails this case.
        be.synchronize()
        return Result(outcome, "")
    except Exception as exc:
        return Result(f"raises {_error_name(be, exc)}", str(exc).strip().splitlines()[0][:200])
    finally:
        settle(be)


def _error_name(be: Any, exc: Exception) -> str:
    # The facade's classes first: on cuda they wrap torch's RuntimeError.
    for cls in (be.UseAfterFreeError, be.CaptureError):
        if isinstance(exc, cls):
            return cls.__name__
    return type(exc).__name__


def settle(be: Any) -> None:
    """Back to a quiet device: no queued work, the default stream current, a fresh seed."""
    if be.name == "cuda":
        # A failed capture may leave its side stream current; later eager work must not run there.
        torch.cuda.set_stream(torch.cuda.default_stream())
        torch.cuda.synchronize()
        _repair_default_generator()  # before emptying the cache: its draw allocates
        torch.cuda.empty_cache()
    else:
        # A failed case may leave more queued work that fails the same way: each failing item
        # leaves the queue as it raises, so this ends; the case's outcome is already recorded.
        for _ in range(1000):
            try:
                be.synchronize()
                break
            except Exception:
                continue
    be.set_scheduler_seed(0)
    torch.manual_seed(0)


def _repair_default_generator() -> None:
    """A capture that drew random numbers and then failed leaves the default generator counting
    an offset inside a graph that never ended: torch then refuses every draw outside a capture
    ("Offset increment outside graph capture encountered unexpectedly") for the rest of the
    process, so every later case that draws would show that instead of its own outcome. A fresh
    generator state puts it back."""
    try:
        torch.rand(1, device="cuda")
    except RuntimeError as error:
        if "outside graph capture" not in str(error):
            raise
        fresh = torch.Generator(device="cuda")
        default = torch.cuda.default_generators[torch.cuda.current_device()]
        default.graphsafe_set_state(fresh.graphsafe_get_state())


def busy(be: Any) -> None:
    """Hold the current stream for a while (cuda), so host work issued next runs before the
    device reaches what is queued after this. Sim has no kernel time: its scheduler decides, per
    seed, how far queued work has run (see `racy`)."""
    if be.name == "cuda":
        torch.cuda._sleep(_BUSY_CYCLES)


def another_stream(be: Any) -> Any:
    """A new stream that is not the current one. On cuda `Stream()` hands out a fixed pool of
    streams in turn, so a new one may be the very stream that is capturing: work "on another
    stream" would then be part of the capture (an unjoined fork not refused, an outside
    allocation taken by the graph's pool), depending on how many streams the process made
    before."""
    current = be.current_stream()
    for _ in range(64):
        stream = be.Stream()
        if stream != current:
            return stream
    raise RuntimeError("every new stream is the current stream")


def racy(be: Any, trial: Callable[[], str], shows: str, seeds: Iterable[int] = range(12)) -> str:
    """`shows` if some schedule makes `trial` show it, else what every schedule showed.

    On cuda `busy` makes the schedule deterministic and the seed is ignored; on sim the seed picks
    the schedule, so a race is seen when any of a few seeds exposes it."""
    seen = ""
    for seed in seeds:
        be.set_scheduler_seed(seed)
        seen = trial()
        be.synchronize()
        if seen == shows:
            return seen
    return seen


def index_copy_of_too_many_dims(be: Any) -> Callable[[], object]:
    """An `index_copy_` whose rows have one dimension more than the table's: torch checks the
    arguments on the host, before it queues a kernel."""
    table = torch.zeros(6, 4, device=be.device)
    index = torch.tensor([1, 2], device=be.device)
    rows = torch.ones(2, 4, 1, device=be.device)
    return lambda: table.index_copy_(0, index, rows)


def _meta_checks_index_copy() -> bool:
    """Whether this torch's meta kernel checks the rows' dimensions of `index_copy_` (2.13's
    does, 2.11's does not)."""
    try:
        index_copy_of_too_many_dims(SimpleNamespace(device="meta"))()
    except (IndexError, RuntimeError):
        return True
    return False


# The sim checks a queued or recorded operation's arguments on the meta device, so it raises at
# the call only where torch's meta kernel checks what the CPU kernel does.
UNCHECKED_INDEX_COPY = (
    ""
    if _meta_checks_index_copy()
    else (
        "sim device: this torch's meta kernel for index_copy_ does not check the rows' "
        "dimensions, so the sim finds the mistake when the queue runs (torch 2.13's does)"
    )
)


def value(be: Any, t: torch.Tensor) -> str:
    """A tensor's contents as an outcome, read once the device is idle."""
    be.synchronize()
    return f"value={[round(v, 4) for v in t.flatten().tolist()]}"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b))
