"""Streams and events: forking side streams into a capture, joining them, and what stays outside."""

from __future__ import annotations

from typing import Any

import torch

from pytest_graphmode.runtime import backends
from tests.conformance.case import (
    UNCHECKED_INDEX_COPY,
    another_stream,
    busy,
    case,
    index_copy_of_too_many_dims,
    racy,
    value,
)


def _fork_join(be: Any, x: torch.Tensor, join: str) -> tuple[Any, torch.Tensor]:
    """k3 = 2 (x + 1) + 3 (x + 1), the two products on two streams; `join` picks how (or whether)
    the side stream is joined back."""
    g = be.Graph()
    with be.graph(g):
        origin = be.current_stream()
        side = another_stream(be)
        k0 = x + 1
        if join == "events":
            forked = be.Event()
            forked.record(origin)
            side.wait_event(forked)
        else:
            side.wait_stream(origin)
        k1 = k0 * 2
        with be.stream(side):
            k2 = k0 * 3
        if join == "events":
            done = be.Event()
            done.record(side)
            origin.wait_event(done)
        elif join == "wait_stream":
            origin.wait_stream(side)
        k3 = k1 + k2
    return g, k3


@case("value=[5.0, 10.0, 15.0]")
def fork_and_join_with_wait_stream(be: Any) -> str:
    x = torch.zeros(3, device=be.device)
    g, out = _fork_join(be, x, "wait_stream")
    x.copy_(torch.arange(3.0, device=be.device))
    g.replay()
    return value(be, out)


@case("value=[5.0, 10.0, 15.0]")
def fork_and_join_with_events(be: Any) -> str:
    x = torch.zeros(3, device=be.device)
    g, out = _fork_join(be, x, "events")
    x.copy_(torch.arange(3.0, device=be.device))
    g.replay()
    return value(be, out)


@case("raises CaptureError")
def side_stream_not_joined_before_capture_end(be: Any) -> str:
    _fork_join(be, torch.zeros(3, device=be.device), "none")
    return "captured"


@case(
    "raises CaptureError",
)
def wait_on_an_event_recorded_before_capture(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    earlier = be.Event()
    earlier.record()
    be.synchronize()
    g = be.Graph()
    with be.graph(g):
        be.current_stream().wait_event(earlier)
        x * 2
    return "captured"


@case("not replayed")
def in_place_work_on_an_outside_stream_is_not_recorded(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    side_result = torch.zeros(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        x * 2
        outsider = another_stream(be)
        with be.stream(outsider):  # never forked into the capture: runs now
            torch.mul(x, 7, out=side_result)
    be.synchronize()
    if not bool((side_result == 7).all()):
        return "did not run at capture"
    side_result.zero_()
    g.replay()
    be.synchronize()
    return "not replayed" if not side_result.any() else "replayed"


@case(
    "raises CaptureError",
)
def allocation_on_an_outside_stream_during_capture(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        x * 2
        outsider = another_stream(be)
        with be.stream(outsider):
            # 32 MiB: no cached block can serve it, so the allocator must ask the driver.
            torch.zeros(8 << 20, device=be.device)
    return "captured"


def _branch_reads_what_the_origin_overwrites(be: Any, join: bool) -> str:
    """A graph whose side branch reads `x` while the origin's branch overwrites it in place
    (`join`: the origin waits for the side branch first). On cuda the side branch starts late
    (`busy`, captured); on sim a replay's branches run in an order its seed picks."""
    x = torch.zeros(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        origin = be.current_stream()
        side = another_stream(be)
        side.wait_stream(origin)
        with be.stream(side):
            busy(be)
            y = x * 2
        if join:
            origin.wait_stream(side)
        x.fill_(100.0)
        origin.wait_stream(side)

    def trial() -> str:
        x.fill_(1.0)
        g.replay()
        be.synchronize()
        return "overwritten first" if bool((y == 200.0).all()) else "input"

    return racy(be, trial, shows="overwritten first")


@case("overwritten first")
def a_graph_branch_races_with_an_in_place_write_of_another_branch(be: Any) -> str:
    return _branch_reads_what_the_origin_overwrites(be, join=False)


@case("input")
def a_graph_branch_joined_before_the_in_place_write_reads_its_input(be: Any) -> str:
    return _branch_reads_what_the_origin_overwrites(be, join=True)


@case("stale")
def a_graph_branch_output_read_before_the_join(be: Any) -> str:
    out = torch.zeros(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        origin = be.current_stream()
        side = another_stream(be)
        side.wait_stream(origin)
        with be.stream(side):
            busy(be)
            out.fill_(7.0)
        seen = out * 1  # on the origin's branch, which has not waited for the side branch
        origin.wait_stream(side)

    def trial() -> str:
        out.fill_(1.0)
        g.replay()
        be.synchronize()
        return "stale" if bool((seen == 1.0).all()) else "fresh"

    return racy(be, trial, shows="stale")


def _replay_on_a_side_stream(be: Any, wait: bool) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 2
    g.replay()
    x.fill_(5.0)
    be.synchronize()

    def trial() -> str:
        y.fill_(2.0)
        be.synchronize()
        side = be.Stream()
        with be.stream(side):
            busy(be)
            g.replay()
        if wait:
            be.current_stream().wait_stream(side)
        seen = y.clone()  # on the default stream
        return "fresh" if bool((seen == 10.0).all()) else "stale"

    return racy(be, trial, shows="stale")


@case("stale")
def output_read_without_waiting_for_the_replay_stream(be: Any) -> str:
    return _replay_on_a_side_stream(be, wait=False)


@case("fresh")
def output_read_after_waiting_for_the_replay_stream(be: Any) -> str:
    return _replay_on_a_side_stream(be, wait=True)


@case("value=[4.0, 4.0]")
def replay_waits_for_an_event_from_a_copy_stream(be: Any) -> str:
    x = torch.zeros(2, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 2
    copy_stream = be.Stream()
    with be.stream(copy_stream):
        busy(be)
        x.fill_(2.0)
        copied = be.Event()
        copied.record()
    be.current_stream().wait_event(copied)
    g.replay()
    return value(be, y)


@case("value=[2.0, 2.0]")
def a_wait_is_bound_to_the_record_before_it(be: Any) -> str:
    """An event recorded again, on another stream, while a wait on its earlier record is still
    queued: the wait is for the earlier record (one event serving two purposes is a runner's
    race, never a hang of the backend). On sim over twelve schedules."""

    def trial() -> str:
        a, b = be.Stream(), be.Stream()
        x = torch.zeros(2, device=be.device)
        a.wait_stream(be.current_stream())
        ev = be.Event()
        with be.stream(a):
            busy(be)
            x.fill_(1.0)
            ev.record()
        b.wait_event(ev)
        with be.stream(b):
            x.mul_(2)
            ev.record()
        return value(be, x)

    outcomes = set()
    for seed in range(12):
        be.set_scheduler_seed(seed)
        outcomes.add(trial())
    return " / ".join(sorted(outcomes))


@case("value=[2.0, 2.0]")
def one_graph_launched_on_two_streams_runs_one_launch_at_a_time(be: Any) -> str:
    # CUDA orders a graph's launch behind its previous launch, whatever stream that ran on: the
    # second stream's replay waits for the first's, which waits for the work before it.
    x = torch.zeros(2, device=be.device)
    g = be.Graph()
    with be.graph(g):
        x.add_(1)
    first, second = be.Stream(), be.Stream()
    first.wait_stream(be.current_stream())
    second.wait_stream(be.current_stream())
    with be.stream(first):
        busy(be)
        g.replay()
    with be.stream(second):
        g.replay()
        seen = x.cpu()
    return f"value={seen.tolist()}"


def _recorded_in_a_graph(be: Any, event: Any) -> tuple[Any, torch.Tensor]:
    x = torch.ones(2, device=be.device)
    g = be.Graph()
    with be.graph(g):
        busy(be)
        x.add_(1)
        event.record()
    return g, x


def _used_outside_the_graph(be: Any, use: Any) -> str:
    """`use` of an event the graph records, after a replay: "refused" where it raises."""
    event = be.Event()
    g, _ = _recorded_in_a_graph(be, event)
    g.replay()
    try:
        use(event)
    except RuntimeError:
        return "refused"
    return "used"


@case("refused")
def event_recorded_in_a_capture_waited_for_outside_the_graph(be: Any) -> str:
    def wait(event: Any) -> None:
        be.Stream().wait_event(event)
        be.synchronize()

    return _used_outside_the_graph(be, wait)


@case("refused")
def event_recorded_in_a_capture_synchronized_outside_the_graph(be: Any) -> str:
    return _used_outside_the_graph(be, lambda event: event.synchronize())


def _doubled_after_waiting(be: Any, event: Any, x: torch.Tensor) -> str:
    """x * 2 read on another stream that waited for `event`."""
    other = be.Stream()
    other.wait_event(event)
    with be.stream(other):
        seen = (x * 2).cpu()
    return f"value={seen.tolist()}"


@case("value=[4.0, 4.0]")
def external_event_recorded_in_a_capture_is_waited_for_outside(be: Any) -> str:
    event = be.Event(external=True)
    g, x = _recorded_in_a_graph(be, event)
    g.replay()
    return _doubled_after_waiting(be, event, x)


@case("value=[4.0, 4.0]")
def event_recorded_again_after_the_replay_is_waited_for(be: Any) -> str:
    event = be.Event()
    g, x = _recorded_in_a_graph(be, event)
    g.replay()
    event.record()
    return _doubled_after_waiting(be, event, x)


@case("the stream inside, the default after; priorities 0 to below 0")
def stream_as_a_context_manager_and_its_priorities(be: Any) -> str:
    with backends.target_scope(be.name):
        default = torch.cuda.current_stream()
        with torch.cuda.Stream() as made:
            inside = torch.cuda.current_stream() == made
        after = torch.cuda.current_stream() == default
        least, greatest = torch.cuda.Stream.priority_range()
    where = f"the stream {'inside' if inside else 'not current'}, "
    where += f"the {'default' if after else 'other'} after"
    return f"{where}; priorities {least} to {'below 0' if greatest < 0 else greatest}"


@case("range 0 to -3; asked for -1, -3, -10 and 3: given -1, -3, -3 and 0")
def stream_priorities_clamp_to_torchs_range(be: Any) -> str:
    # torch keeps stream pools of four priorities, fewer than a Hopper GPU offers: a runner that
    # asks for the device's highest priority gets the highest of torch's.
    with backends.target_scope(be.name):
        least, greatest = torch.cuda.Stream.priority_range()
        given = [torch.cuda.Stream(priority=p).priority for p in (-1, -3, -10, 3)]
    return (
        f"range {least} to {greatest}; asked for -1, -3, -10 and 3: "
        f"given {given[0]}, {given[1]}, {given[2]} and {given[3]}"
    )


@case("raises ValueError")
def elapsed_time_of_events_made_without_timing(be: Any) -> str:
    with backends.target_scope(be.name):
        start, end = torch.cuda.Event(), torch.cuda.Event()
        start.record()
        end.record()
        end.synchronize()
        return f"{start.elapsed_time(end):.1f} ms"


@case("capturing, not on another stream, not after")
def is_current_stream_capturing_asks_the_current_stream(be: Any) -> str:
    # A forward that skips its profiling ranges while captured asks this of its own stream.
    with backends.target_scope(be.name):
        x = torch.ones(2, device=be.device)
        g = be.Graph()
        with be.graph(g):
            inside = torch.cuda.is_current_stream_capturing()
            with be.stream(another_stream(be)):
                elsewhere = torch.cuda.is_current_stream_capturing()
            x.mul_(2)
        after = torch.cuda.is_current_stream_capturing()
    return ", ".join(
        [
            "capturing" if inside else "not capturing",
            "on another stream too" if elsewhere else "not on another stream",
            "after too" if after else "not after",
        ]
    )


@case("raises IndexError at the call", pending=UNCHECKED_INDEX_COPY)
def argument_error_on_a_side_stream_raises_at_the_call(be: Any) -> str:
    copy = index_copy_of_too_many_dims(be)
    side = another_stream(be)
    side.wait_stream(be.current_stream())
    try:
        with be.stream(side):
            copy()
    except IndexError as exc:
        return f"raises {type(exc).__name__} at the call"
    be.synchronize()  # queued unchecked, the mistake would raise here, or in whatever came next
    return "returned"
