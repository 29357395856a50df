"""Asynchronous copies and replays: pinned memory is read and written when the device gets there.

Each race is made deterministic on CUDA by holding the stream (`busy`) before the racing copy or
replay, so the host always wins; on sim the scheduler seed picks the order (`racy`).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.conformance.case import busy, case, racy, value


def _staging_graph(be: Any) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A graph that uploads a pinned buffer and doubles it: (graph, pinned input, output, and the
    device buffer the graph uploads into, which the caller keeps alive)."""
    pinned = be.empty_pinned(4)
    pinned.fill_(1.0)
    static = torch.zeros(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        static.copy_(pinned, non_blocking=True)
        out = static * 2
    return g, pinned, out, static


@case("value=[6.0, 6.0, 6.0, 6.0]")
def captured_pinned_upload_reads_the_buffer_at_replay(be: Any) -> str:
    g, pinned, out, _static = _staging_graph(be)
    pinned.fill_(3.0)
    g.replay()
    return value(be, out)


@case(
    "new value",
)
def pinned_input_overwritten_after_replay_before_sync(be: Any) -> str:
    g, pinned, out, _static = _staging_graph(be)

    def trial() -> str:
        pinned.fill_(1.0)
        be.synchronize()
        busy(be)
        g.replay()
        pinned.fill_(2.0)  # the host prepares the next step while the graph is queued
        be.synchronize()
        return "new value" if bool((out == 4.0).all()) else "old value"

    return racy(be, trial, shows="new value")


@case("old value")
def pinned_input_overwritten_after_an_event_wait(be: Any) -> str:
    g, pinned, out, _static = _staging_graph(be)

    def trial() -> str:
        pinned.fill_(1.0)
        be.synchronize()
        busy(be)
        g.replay()
        done = be.Event()
        done.record()
        done.synchronize()
        pinned.fill_(2.0)
        be.synchronize()
        return "new value" if bool((out == 4.0).all()) else "old value"

    return racy(be, trial, shows="new value")


def _download_graph(be: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A graph that downloads 3 x into a pinned buffer: (graph, pinned output, and the device input
    the graph reads, which the caller keeps alive)."""
    x = torch.ones(4, device=be.device)
    pinned = be.empty_pinned(4)
    g = be.Graph()
    with be.graph(g):
        pinned.copy_(x * 3, non_blocking=True)
    return g, pinned, x


@case(
    "stale",
)
def captured_download_read_before_sync(be: Any) -> str:
    g, pinned, _x = _download_graph(be)

    def trial() -> str:
        pinned.fill_(-1.0)
        be.synchronize()
        busy(be)
        g.replay()
        seen = pinned.clone()  # a host read: nothing waits for the device
        return "stale" if bool((seen == -1.0).all()) else "fresh"

    return racy(be, trial, shows="stale")


@case("value=[3.0, 3.0, 3.0, 3.0]")
def captured_download_read_after_sync(be: Any) -> str:
    g, pinned, _x = _download_graph(be)
    pinned.fill_(-1.0)
    g.replay()
    be.synchronize()
    return value(be, pinned.clone())


@case("new value")
def non_blocking_upload_then_overwrite(be: Any) -> str:
    pinned = be.empty_pinned(4)
    device_buf = torch.zeros(4, device=be.device)

    def trial() -> str:
        pinned.fill_(1.0)
        be.synchronize()
        busy(be)
        device_buf.copy_(pinned, non_blocking=True)
        pinned.fill_(2.0)
        be.synchronize()
        return "new value" if bool((device_buf == 2.0).all()) else "old value"

    return racy(be, trial, shows="new value")


@case("old value")
def non_blocking_upload_then_event_wait_then_overwrite(be: Any) -> str:
    pinned = be.empty_pinned(4)
    device_buf = torch.zeros(4, device=be.device)

    def trial() -> str:
        pinned.fill_(1.0)
        be.synchronize()
        busy(be)
        device_buf.copy_(pinned, non_blocking=True)
        copied = be.Event()
        copied.record()
        copied.synchronize()
        pinned.fill_(2.0)
        be.synchronize()
        return "new value" if bool((device_buf == 2.0).all()) else "old value"

    return racy(be, trial, shows="new value")


@case("stale")
def non_blocking_download_read_before_sync(be: Any) -> str:
    x = torch.full((4,), 3.0, device=be.device)
    pinned = be.empty_pinned(4)

    def trial() -> str:
        pinned.fill_(-1.0)
        be.synchronize()
        busy(be)
        pinned.copy_(x, non_blocking=True)
        seen = pinned.clone()
        return "stale" if bool((seen == -1.0).all()) else "fresh"

    return racy(be, trial, shows="stale")


def _replay_after_a_copy_stream(be: Any, wait: bool) -> str:
    static = torch.zeros(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        out = static * 10
    pinned = be.empty_pinned(4)
    pinned.copy_(torch.arange(4.0))

    def trial() -> str:
        static.zero_()
        be.synchronize()
        copy_stream = be.Stream()
        with be.stream(copy_stream):
            busy(be)
            static.copy_(pinned, non_blocking=True)
        if wait:
            be.current_stream().wait_stream(copy_stream)
        g.replay()
        be.synchronize()
        return "fresh" if bool((out == torch.arange(4.0, device=be.device) * 10).all()) else "stale"

    return racy(be, trial, shows="stale")


@case("stale")
def replay_not_waiting_for_a_copy_stream(be: Any) -> str:
    return _replay_after_a_copy_stream(be, wait=False)


@case("fresh")
def replay_waiting_for_a_copy_stream(be: Any) -> str:
    return _replay_after_a_copy_stream(be, wait=True)
