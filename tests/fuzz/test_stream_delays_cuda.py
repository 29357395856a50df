"""The cuda stream delays on a GPU: host-staging races show, correct waits stay correct.

Every race here is run with a sleep of tens of milliseconds, so the host always wins it: the
outcome with the delays is deterministic, where without them the copy usually wins and the bug
stays hidden.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from pytest_graphmode.strategies.stream_delays import (
    delayed_compute,
    delayed_streams,
    landed_copies,
    sleep_cycles_per_second,
)
from tests.conformance.case import another_stream

pytestmark = pytest.mark.graphmode_cuda

CYCLES = 50_000_000  # about 25 ms at 2 GHz
WORDS = 1 << 16


def _staged(be, value):
    """A pinned staging buffer filled with `value` and a zeroed device buffer of the same size,
    zeroed before the test's copy: a copy on another stream does not wait for the zeroing, which
    on a busy GPU (other test processes) could otherwise land after it."""
    staging = be.empty_pinned(WORDS)
    staging.fill_(value)
    device = torch.zeros(WORDS, device=be.device)
    be.synchronize()
    return staging, device


@pytest.mark.graphmode_gpu_alone
def test_a_staging_buffer_rewritten_before_its_upload_on_a_copy_stream_ran_is_read_late(be):
    copy_stream = be.Stream()
    staging, device = _staged(be, 1.0)
    with delayed_streams(CYCLES):
        with be.stream(copy_stream):
            device.copy_(staging, non_blocking=True)
        staging.fill_(2.0)  # the bug: the host reuses the buffer without waiting for the copy
    be.current_stream().wait_stream(copy_stream)
    assert device.unique().tolist() == [2.0]


@pytest.mark.graphmode_gpu_alone
def test_a_staging_buffer_rewritten_after_waiting_for_the_copy_event_stays_correct(be):
    copy_stream = be.Stream()
    staging, device = _staged(be, 1.0)
    with delayed_streams(CYCLES):
        with be.stream(copy_stream):
            device.copy_(staging, non_blocking=True)
            copied = be.Event()
            copied.record()
        copied.synchronize()  # before the host writes the buffer again
        staging.fill_(2.0)
        be.current_stream().wait_event(copied)  # before the compute stream reads the copy
        doubled = device * 2
    assert doubled.unique().tolist() == [2.0]


@pytest.mark.graphmode_gpu_alone
def test_a_replay_not_waiting_for_the_copy_stream_reads_the_old_contents(be):
    copy_stream = be.Stream()
    staging, device = _staged(be, 5.0)
    with delayed_streams(CYCLES):
        with be.stream(copy_stream):
            device.copy_(staging, non_blocking=True)
        early = device * 1  # the bug: no wait on the copy stream
        copy_stream.synchronize()
    assert early.unique().tolist() == [0.0]
    assert device.unique().tolist() == [5.0]


@pytest.mark.graphmode_gpu_alone
def test_a_download_read_on_the_host_before_waiting_is_stale(be):
    source = torch.full((WORDS,), 3.0, device=be.device)
    host = be.empty_pinned(WORDS)
    host.zero_()
    with delayed_streams(CYCLES):
        host.copy_(source, non_blocking=True)
        seen = host.clone()  # the bug: read without synchronizing
    be.synchronize()
    assert seen.unique().tolist() == [0.0]
    assert host.unique().tolist() == [3.0]


@pytest.mark.graphmode_gpu_alone
def test_an_event_recorded_on_an_idle_side_stream_completes_late(be):
    side = be.Stream()
    with delayed_streams(CYCLES):
        event = side.record_event()
        done_at_once = event.query()
    event.synchronize()
    assert not done_at_once


def test_nothing_sleeps_inside_a_capture(any_be, monkeypatch):
    # (cycles, whether the stream it sleeps on captures): torch's capture_begin queues an operation
    # on the capture stream before the capture begins, and a stream entered sleeps before its
    # first operation; that sleep is no part of the graph.
    sleeps: list[tuple[int, bool]] = []
    sleep = torch.cuda._sleep

    def noted(cycles: int) -> None:
        sleeps.append((cycles, torch.cuda.is_current_stream_capturing()))
        sleep(cycles)

    monkeypatch.setattr(torch.cuda, "_sleep", noted)
    staging = any_be.empty_pinned(WORDS)
    device = torch.zeros(WORDS, device=any_be.device)
    graph = any_be.Graph()
    with delayed_streams(CYCLES), any_be.graph(graph):
        device.copy_(staging, non_blocking=True)
        doubled = device * 2
    # a sleep in the capture would be replayed with the graph, every time
    assert [captured for _, captured in sleeps if captured] == []
    staging.fill_(4.0)
    graph.replay()
    assert doubled.unique().tolist() == [8.0]


@pytest.mark.parametrize("on_a_copy_stream", [False, True], ids=["current", "copy stream"])
def test_staging_rewritten_after_its_upload_was_queued_is_not_uploaded_when_the_host_is_late(
    any_be, on_a_copy_stream
):
    copy_stream = any_be.Stream() if on_a_copy_stream else any_be.current_stream()
    staging, device = _staged(any_be, 1.0)
    with landed_copies():
        with any_be.stream(copy_stream):
            device.copy_(staging, non_blocking=True)
        staging.fill_(2.0)  # the bug: the padding written after the upload was queued
    any_be.current_stream().wait_stream(copy_stream)
    assert device.unique().tolist() == [1.0]


def test_staging_written_before_its_upload_is_uploaded_when_the_host_is_late(any_be):
    staging, device = _staged(any_be, 1.0)
    with landed_copies():
        staging.fill_(2.0)
        device.copy_(staging, non_blocking=True)
        doubled = device * 2
    assert doubled.unique().tolist() == [4.0]


def test_a_download_has_landed_when_the_host_is_late(any_be):
    source = torch.full((WORDS,), 3.0, device=any_be.device)
    host = any_be.empty_pinned(WORDS)
    host.zero_()
    with landed_copies():
        torch.cuda._sleep(CYCLES)  # the download waits for the work before it
        host.copy_(source, non_blocking=True)
        seen = host.clone()  # read without synchronizing: the copy is there all the same
    assert seen.unique().tolist() == [3.0]


def test_nothing_is_waited_for_inside_a_capture(any_be):
    # a synchronization of the capturing stream would end the capture with an error
    staging = any_be.empty_pinned(WORDS)
    staging.fill_(1.0)
    device = torch.zeros(WORDS, device=any_be.device)
    graph = any_be.Graph()
    with landed_copies(), any_be.graph(graph):
        device.copy_(staging, non_blocking=True)
        doubled = device * 2
    staging.fill_(4.0)
    graph.replay()
    assert doubled.unique().tolist() == [8.0]


@pytest.mark.parametrize("scope", ["unstressed", "landed copies", "held streams"])
def test_an_upload_on_a_side_stream_during_a_capture_leaves_the_capture_whole(any_be, scope):
    # torch captures in the global mode: while it captures, waiting for any stream or asking any
    # event, even on a stream that is not capturing, ends the capture with an error.
    staging, uploaded = _staged(any_be, 1.0)
    static = torch.zeros(WORDS, device=any_be.device)
    graph = any_be.Graph()
    stressed = {
        "unstressed": contextlib.nullcontext,
        "landed copies": landed_copies,
        "held streams": lambda: delayed_streams(1000, hold_cycles=1_000_000),
    }[scope]
    with stressed(), any_be.graph(graph):
        doubled = static * 2
        # not the capturing one, which torch's stream pool may hand out
        side = another_stream(any_be)
        with any_be.stream(side):
            uploaded.copy_(staging, non_blocking=True)  # outside the graph: side does not capture
            uploaded.add_(1.0)  # a kernel there runs outside the graph too
        tripled = doubled + static
    any_be.synchronize()
    static.fill_(2.0)
    graph.replay()
    any_be.synchronize()
    assert tripled.unique().tolist() == [6.0] and uploaded.unique().tolist() == [2.0]


def _doubling_graph(be):
    """A graph that doubles a static input buffer (zeros), and that buffer and output."""
    static = torch.zeros(WORDS, device=be.device)
    graph = be.Graph()
    with be.graph(graph):
        out = static * 2
    be.synchronize()
    return graph, static, out


@pytest.mark.graphmode_gpu_alone
@pytest.mark.parametrize("work", ["replay", "eager"])
@pytest.mark.parametrize("waits", [False, True], ids=["the-bug", "waiting"])
def test_an_upload_not_waiting_for_the_work_before_it_overwrites_that_works_inputs(be, work, waits):
    # The step before reads `static`: a replay, or an eager fallback sharing the graph's buffers.
    graph, static, out = _doubling_graph(be)
    staging, _ = _staged(be, 3.0)
    copy_stream = be.Stream()
    with delayed_compute(CYCLES):
        if work == "replay":
            graph.replay()
        else:
            out = static * 2
        if waits:
            copy_stream.wait_stream(be.current_stream())
        with be.stream(copy_stream):
            static.copy_(staging, non_blocking=True)  # the next step's upload
    be.synchronize()
    assert out.unique().tolist() == ([0.0] if waits else [6.0])


@pytest.mark.graphmode_gpu_alone
@pytest.mark.parametrize("joined", [False, True], ids=["the-bug", "joined"])
def test_a_side_stream_read_not_joined_before_an_in_place_write_sees_the_write(be, joined):
    # Without a sleep on the side stream both become ready when the fork's event record, delayed
    # on the current stream, is passed, and the read, queued first, usually wins.
    side = be.Stream()
    x = torch.ones(WORDS, device=be.device)
    be.synchronize()
    with delayed_streams(CYCLES):
        current = be.current_stream()
        side.wait_stream(current)
        with be.stream(side):
            seen = x * 2
        if joined:
            current.wait_stream(side)
        x.fill_(5.0)  # the bug: in place on the current stream, the side stream's read pending
        current.wait_stream(side)
    assert seen.unique().tolist() == ([2.0] if joined else [10.0])


def test_the_sleep_clock_is_timed_at_a_plausible_rate(any_be):
    assert 1e8 < sleep_cycles_per_second(torch.cuda.current_device()) < 1e10


@pytest.mark.graphmode_gpu_alone
@pytest.mark.parametrize("hold", [True, False], ids=["held", "not held"])
def test_a_hold_keeps_an_upload_queued_while_the_host_works_past_the_delay(be, hold):
    """The host works 5 ms after the upload (an eager forward's launches) before it rewrites the
    staging: a hold of 30 ms keeps the upload queued, so the rewrite shows. Without a hold the
    short delay ends on its own and the upload reads the old values; the host waits for that
    without synchronizing, up to 2 s, because on a GPU shared with other test processes 5 ms may
    not be enough for the upload to start."""
    staging, device = _staged(be, 1.0)
    per_second = sleep_cycles_per_second(torch.cuda.current_device())
    hold_cycles = int(0.03 * per_second) if hold else 0
    with delayed_streams(1000, hold_cycles=hold_cycles):
        device.copy_(staging, non_blocking=True)
        landed = be.Event()
        landed.record()
        time.sleep(0.005)
        if not hold:
            deadline = time.perf_counter() + 2.0
            while not landed.query() and time.perf_counter() < deadline:
                time.sleep(0.001)
        staging.fill_(2.0)
    be.synchronize()
    assert device.unique().tolist() == ([2.0] if hold else [1.0])


@pytest.mark.graphmode_gpu_alone
@pytest.mark.parametrize("held_stream", [1, 2], ids=["output stream", "copy stream"])
def test_a_download_read_after_waiting_for_another_stream_is_stale_only_when_its_stream_is_held(
    be, held_stream
):
    """A download on an output stream, read once the host has waited for a copy stream's upload
    (one event for both, re-recorded by the upload). With only the output stream held back the
    download has not landed when the host reads; with only the copy stream held back the host's
    wait outlasts it."""
    per_second = sleep_cycles_per_second(torch.cuda.current_device())
    out, copy = be.Stream(), be.Stream()
    result = torch.full((WORDS,), 2.0, device=be.device)
    host, staging = be.empty_pinned(WORDS), be.empty_pinned(WORDS)
    host.fill_(1.0)
    staging.fill_(3.0)
    upload = torch.zeros(WORDS, device=be.device)
    copies_done = be.Event()
    with delayed_streams(1000, hold_cycles=int(0.02 * per_second), held_stream=held_stream):
        out.wait_stream(be.current_stream())  # the step's stream 0: the current stream
        with be.stream(out):  # stream 1
            host.copy_(result, non_blocking=True)
            copies_done.record()
        copy.wait_stream(be.current_stream())
        with be.stream(copy):  # stream 2
            upload.copy_(staging, non_blocking=True)
            copies_done.record()
        copies_done.synchronize()
        seen = host.unique().tolist()
    be.synchronize()
    assert seen == ([1.0] if held_stream == 1 else [2.0])
