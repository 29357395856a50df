"""Threads a runner starts: a worker computes, captures and replays on the device, starts on the
default stream (the current stream is per thread), and races the device as the main thread does.
On sim each case runs in the drop-in, as a runner's code does."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pytest_graphmode.runtime import backends
from tests.conformance.case import busy, case, racy, value

T = TypeVar("T")


def _in_a_thread(work: Callable[[], T]) -> T:
    """`work()` run in a new thread, its result or its exception brought back."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except Exception as exc:  # raised again below, in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@case("cuda:0 value=[2.0, 2.0]")
def worker_thread_computes_on_device_tensors(be: Any) -> str:
    with backends.target_scope(be.name):
        x = torch.ones(2, device=be.device)
        doubled = _in_a_thread(lambda: x * 2 + torch.zeros(2, device="cuda"))
        return f"{doubled.device} {value(be, doubled)}"


@case("worker on default, main on side")
def worker_thread_starts_on_the_default_stream(be: Any) -> str:
    with backends.target_scope(be.name):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            worker = _in_a_thread(
                lambda: torch.cuda.current_stream() == torch.cuda.default_stream()
            )
            main = torch.cuda.current_stream() == side
        return (
            f"worker on {'default' if worker else 'other'}, main on {'side' if main else 'other'}"
        )


@case("value=[6.0, 6.0]")
def worker_thread_captures_and_replays(be: Any) -> str:
    with backends.target_scope(be.name):
        x = torch.ones(2, device=be.device)

        def capture_and_replay() -> torch.Tensor:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                out = x * 2
            x.fill_(3.0)
            g.replay()
            return out

        out = _in_a_thread(capture_and_replay)
        return value(be, out)


@case("stale")
def download_read_by_a_worker_before_it_lands(be: Any) -> str:
    # The main thread queues a download of the step's tokens; a worker that reads the pinned
    # buffer without waiting for the copy reads what was there before.
    with backends.target_scope(be.name):
        tokens = torch.full((4,), 7.0, device=be.device)
        pinned = torch.zeros(4).pin_memory()

        def trial() -> str:
            pinned.zero_()
            be.synchronize()
            busy(be)
            pinned.copy_(tokens, non_blocking=True)
            seen = _in_a_thread(lambda: pinned.tolist())
            be.synchronize()
            return "landed" if seen == [7.0] * 4 else "stale"

        return racy(be, trial, shows="stale")


@case("landed")
def download_read_by_a_worker_after_an_event(be: Any) -> str:
    with backends.target_scope(be.name):
        tokens = torch.full((4,), 7.0, device=be.device)
        pinned = torch.zeros(4).pin_memory()

        def trial() -> str:
            pinned.zero_()
            be.synchronize()
            busy(be)
            pinned.copy_(tokens, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()

            def read() -> list[float]:
                copied.synchronize()
                return pinned.tolist()

            seen = _in_a_thread(read)
            be.synchronize()
            return "landed" if seen == [7.0] * 4 else "stale"

        return racy(be, trial, shows="stale")


def _capture_while_main(be: Any, mode: str, work: Callable[[Any], object], did: str) -> str:
    """A worker captures in `mode` and waits inside the capture while the main thread does
    `work(stream)` (`stream`: one of its own, made before the capture's, so never the capturing
    one); then the graph replays."""
    with backends.target_scope(be.name):
        x = torch.ones(2, device=be.device)
        mains = torch.cuda.Stream()
        side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        inside, done = threading.Event(), threading.Event()

        def capture() -> torch.Tensor:
            try:
                with torch.cuda.graph(graph, stream=side, capture_error_mode=mode):
                    doubled = x * 2
                    inside.set()
                    done.wait(10)
                    return doubled + 1
            finally:
                inside.set()

        worker: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: worker.update(out=_guarded(capture)))
        thread.start()
        inside.wait(10)
        try:
            work(mains)
            main = did
        except RuntimeError as exc:
            main = f"main raises {type(exc).__name__}"
        finally:
            done.set()
            thread.join()
        out = worker["out"]
        if isinstance(out, Exception):
            return f"{main}; capture raises {type(out).__name__}"
        graph.replay()
        return f"{main}; {value(be, out)}"


def _guarded(work: Callable[[], T]) -> T | Exception:
    try:
        return work()
    except Exception as exc:  # the outcome names it
        return exc


@case("allocated; value=[3.0, 3.0]")
def another_thread_allocates_during_a_thread_local_capture(be: Any) -> str:
    # CUDA refuses an unsafe call (a cudaMalloc) only from the capturing thread in this mode. 64
    # MiB: a fresh allocation on CUDA, not a cached block.
    return _capture_while_main(
        be, "thread_local", lambda stream: torch.empty(16 << 20, device=be.device), "allocated"
    )


@case("waited; value=[3.0, 3.0]")
def another_thread_waits_for_an_event_during_a_thread_local_capture(be: Any) -> str:
    # Waiting for an event is unsafe during a capture (cudaEventSynchronize), refused in this
    # mode only from the capturing thread: PyTorch's NCCL watchdog queries events from its own
    # thread while a thread-local capture runs (pytorch PRs 104555, 105182).
    return _capture_while_main(
        be, "thread_local", lambda stream: stream.record_event().synchronize(), "waited"
    )
