"""Races a GPU shows whatever the values: the host touching pinned memory whose non-blocking copy
is still in flight, found by the cuda delays (runtime/backends/cuda_races.py).

Each race here writes the bytes the copy already holds, or reads bytes the download does not
change: no value shows it, only that the copy had not run when the host touched them.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.backends import Backend
from pytest_graphmode.runtime.backends.cuda_races import InflightCopies
from pytest_graphmode.strategies.stream_delays import delayed_compute, delayed_streams

pytestmark = pytest.mark.graphmode_cuda

CYCLES = 50_000_000  # about 25 ms at 2 GHz: the copy is still queued when the host goes on
WORDS = 1 << 12


def _staged(be: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    staging = be.empty_pinned(WORDS)
    staging.fill_(1.0)
    device = torch.zeros(WORDS, device=be.device)
    be.synchronize()
    return staging, device


def _upload_then(be: Backend, write: bool) -> list[backends.Race]:
    """Upload a staging buffer and write its same values again, waiting for the upload first or
    not; the races the delays found."""
    staging, device = _staged(be)
    inflight = InflightCopies()
    with delayed_streams(CYCLES, inflight=inflight):
        device.copy_(staging, non_blocking=True)
        copied = be.Event()
        copied.record()
        if write:
            copied.synchronize()
        staging.fill_(1.0)  # the values the copy holds already
    be.synchronize()
    assert device.unique().tolist() == [1.0]  # no value shows the race
    return inflight.take()


@pytest.mark.graphmode_gpu_alone
def test_a_host_write_of_the_same_values_into_an_upload_in_flight_is_a_race(be):
    (race,) = _upload_then(be, write=False)
    assert race.earlier.access == "read" and race.later.access == "write"
    assert race.earlier.op == "aten.copy_ (non-blocking, host to device)"
    assert race.later.stream == "the host"
    # both sides name this file's lines, not the delays' or torch's
    assert race.earlier.line.startswith("tests/fuzz/test_inflight_copies_cuda.py:")
    assert race.later.line.startswith("tests/fuzz/test_inflight_copies_cuda.py:")
    assert race.later.line != race.earlier.line
    assert race.byte_range == (0, WORDS * 4)


@pytest.mark.graphmode_gpu_alone
def test_a_host_write_after_waiting_for_the_uploads_event_is_no_race(be):
    assert _upload_then(be, write=True) == []


@pytest.mark.graphmode_gpu_alone
def test_a_host_write_to_bytes_the_upload_does_not_read_is_no_race(be):
    staging, device = _staged(be)
    inflight = InflightCopies()
    half = WORDS // 2
    with delayed_streams(CYCLES, inflight=inflight):
        device[:half].copy_(staging[:half], non_blocking=True)
        staging[half:].fill_(2.0)
        staging[: half - 1].sum()  # a read of what the upload reads too
    be.synchronize()
    assert inflight.take() == []


@pytest.mark.graphmode_gpu_alone
def test_a_write_into_the_next_steps_buffer_in_a_later_scope_races_the_upload_still_in_flight(be):
    staging, device = _staged(be)
    inflight = InflightCopies()
    with delayed_streams(CYCLES, inflight=inflight):
        device.copy_(staging, non_blocking=True)
    with delayed_streams(CYCLES, inflight=inflight):
        staging[3:5].copy_(torch.ones(2))
    be.synchronize()
    (race,) = inflight.take()
    assert race.byte_range == (12, 20)


@pytest.mark.graphmode_gpu_alone
def test_a_host_read_of_a_download_in_flight_is_a_race_and_after_its_stream_is_none(be):
    staging, device = _staged(be)
    device.fill_(1.0)  # the download brings what the host buffer holds already
    inflight = InflightCopies()
    with delayed_streams(CYCLES, inflight=inflight):
        staging.copy_(device, non_blocking=True)
        early = staging[0].item()
        be.current_stream().synchronize()
        late = staging[1].item()
    assert early == late == 1.0
    (race,) = inflight.take()
    assert race.earlier.access == "write" and race.later.access == "read"
    assert race.earlier.op == "aten.copy_ (non-blocking, device to host)"
    assert race.byte_range == (0, 4)


@pytest.mark.graphmode_gpu_alone
def test_an_upload_queued_behind_late_computation_is_in_flight_too(be):
    staging, device = _staged(be)
    inflight = InflightCopies()
    with delayed_compute(CYCLES, inflight=inflight):
        device.copy_(staging, non_blocking=True)  # not delayed itself: behind the entry's sleep
        staging.fill_(1.0)
    be.synchronize()
    (race,) = inflight.take()
    assert race.earlier.op == "aten.copy_ (non-blocking, host to device)"


@pytest.mark.graphmode_gpu_alone
def test_pageable_host_memory_is_not_noted(be):
    pageable = torch.ones(WORDS)
    device = torch.zeros(WORDS, device=be.device)
    inflight = InflightCopies()
    with delayed_streams(CYCLES, inflight=inflight):
        device.copy_(pageable, non_blocking=True)  # CUDA is done with pageable memory on return
        pageable.fill_(1.0)
    be.synchronize()
    assert not inflight.pending
    assert inflight.take() == []


@pytest.mark.graphmode_gpu_alone
def test_the_backend_hands_over_what_a_stressed_steps_delays_found(be):
    from pytest_graphmode.strategies.plans import Stress
    from pytest_graphmode.strategies.stressors import delayed_step

    be.take_races()  # found before this test: not its races
    staging, device = _staged(be)
    with delayed_step(be, Stress(delay_cycles=CYCLES), CYCLES):
        device.copy_(staging, non_blocking=True)
        staging.fill_(1.0)
    be.synchronize()
    (race,) = be.take_races()
    assert "is not ordered before" in race.describe()
    assert be.take_races() == []


@pytest.mark.graphmode_gpu_alone
@pytest.mark.parametrize("waits", [False, True])
def test_a_numpy_write_into_an_upload_in_flight_is_found_by_its_bytes(be, waits):
    # Engines fill pinned staging through its numpy view: no ATen operation shows the write.
    staging, device = _staged(be)
    inflight = InflightCopies()
    with delayed_streams(CYCLES, inflight=inflight):
        device[:8].copy_(staging[:8], non_blocking=True)
        copied = be.Event()
        copied.record()
        if waits:
            copied.synchronize()
        staging.numpy()[3] = 2.0
        device[8:16].copy_(staging[8:16], non_blocking=True)  # the next field's upload
    be.synchronize()
    races = inflight.take()
    if waits:
        assert races == [] and device[3].item() == 1.0
        return
    (race,) = races
    assert race.later.op == "a numpy view or another path torch does not see"
    assert "changed bytes were found at tests/fuzz/test_inflight_copies_cuda.py:" in (
        race.later.line
    )
    assert race.byte_range == (12, 16)  # the bytes that changed
    assert device[3].item() == 2.0  # the late copy moved the host's next bytes


@pytest.mark.graphmode_gpu_alone
@pytest.mark.parametrize("waits", [False, True])
def test_an_upload_a_runners_thread_queues_is_delayed_and_noted(be, waits):
    # An overlap scheduler's worker: started while the backend is active, as a campaign's twins
    # are, before the step; the step's scope sees what the worker queues (cuda_threads.py).
    staging, device = _staged(be)
    inflight = InflightCopies()
    work, queued = threading.Event(), threading.Event()

    def upload() -> None:
        work.wait(5)
        device.copy_(staging, non_blocking=True)
        copied = be.Event()
        copied.record()
        if waits:
            copied.synchronize()
        queued.set()

    with be.active():
        worker = threading.Thread(target=upload)
        worker.start()
    with delayed_streams(CYCLES, inflight=inflight):
        work.set()
        assert queued.wait(5)
        staging.fill_(1.0)  # the values the copy holds already
    worker.join()
    be.synchronize()
    races = inflight.take()
    if waits:
        assert races == []
        return
    (race,) = races
    assert race.earlier.op == "aten.copy_ (non-blocking, host to device)"
    assert race.later.access == "write" and race.later.stream == "the host"


@pytest.mark.graphmode_gpu_alone
@pytest.mark.parametrize("stream", ["another stream", "the upload's stream"])
def test_a_blocking_download_into_an_upload_in_flight_races_it_from_another_stream(be, stream):
    staging, device = _staged(be)
    copy_stream = be.Stream()
    inflight = InflightCopies()
    with delayed_streams(CYCLES, inflight=inflight):
        with be.stream(copy_stream):
            device.copy_(staging, non_blocking=True)
        results = torch.ones(4, device=be.device)
        with be.stream(copy_stream if stream == "the upload's stream" else be.current_stream()):
            staging[:4].copy_(results)  # blocking: the host waits for this stream alone
    be.synchronize()
    races = inflight.take()
    if stream == "the upload's stream":
        assert races == []  # after the upload in its stream's order
        return
    (race,) = races
    assert race.later.op.startswith("aten.copy_ (blocking, device to host, on ")
    assert race.byte_range == (0, 16)


@pytest.mark.graphmode_gpu_alone
@pytest.mark.parametrize("waits", [False, True])
def test_a_host_write_into_staging_a_replay_still_reads_is_a_race(be, waits):
    # The graph captured its own upload: every replay reads the staging when it runs.
    staging, device = _staged(be)
    graph = be.Graph()
    with be.active(), be.graph(graph):  # active, as a campaign's twins: captures are watched
        device.copy_(staging, non_blocking=True)
    inflight = InflightCopies()
    with delayed_compute(CYCLES, inflight=inflight):
        graph.replay()
        replayed = be.Event()
        replayed.record()
        if waits:
            replayed.synchronize()
        staging.fill_(1.0)  # the values the replay's copy holds already
    be.synchronize()
    races = inflight.take()
    if waits:
        assert races == []
        return
    (race,) = races
    assert race.earlier.op.startswith("aten.copy_ (host to device, captured at ")
    assert race.earlier.op.endswith(", replayed)")
    assert race.later.op == "aten.fill_" and race.later.access == "write"
    assert race.byte_range == (0, WORDS * 4)
