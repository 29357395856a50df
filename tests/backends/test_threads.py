"""Threads a runner starts on the sim (sim/threads.py): they see the sim, keep a current stream of
their own, race the device as the main thread does, and share its bookkeeping safely."""

import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from pytest_graphmode.runtime.backends.sim import drop_in
from pytest_graphmode.runtime.backends.sim.device import SimDeviceTensor


def _in_a_thread(work: Callable[[], Any]) -> Any:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result()


def test_a_worker_thread_makes_and_computes_device_tensors():
    with drop_in():
        x = torch.ones(3, device="cuda")
        made, doubled = _in_a_thread(lambda: (torch.zeros(3, device="cuda"), x * 2))
        assert isinstance(made, SimDeviceTensor) and made.device == torch.device("cuda", 0)
        assert isinstance(doubled, SimDeviceTensor)
        assert doubled.tolist() == [2.0, 2.0, 2.0]


def test_each_thread_has_its_own_current_stream():
    with drop_in():
        side, worker_side = torch.cuda.Stream(), torch.cuda.Stream()

        def worker() -> tuple[bool, bool]:
            starts_on_default = torch.cuda.current_stream() == torch.cuda.default_stream()
            torch.cuda.set_stream(worker_side)
            return starts_on_default, torch.cuda.current_stream() == worker_side

        with torch.cuda.stream(side):
            assert _in_a_thread(worker) == (True, True)
            assert torch.cuda.current_stream() == side
        assert torch.cuda.current_stream() == torch.cuda.default_stream()


@pytest.mark.parametrize("sync", [False, True])
def test_a_worker_reading_a_queued_download_is_a_race(sim, sync):
    x, side = torch.arange(4.0, device=sim.device), sim.Stream()
    host = sim.empty_pinned(4)
    side.wait_stream(sim.current_stream())
    sim.take_races()
    with sim.stream(side):
        host.copy_(x, non_blocking=True)
    if sync:
        side.synchronize()
    _in_a_thread(host.tolist)
    races = sim.take_races()
    if sync:
        assert races == []
        return
    [race] = races
    assert (race.later.op, race.later.stream) == ("Tensor.tolist()", "the host")


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    # Threads switch every few bytecodes instead of every 5 ms: two threads' steps inside the sim
    # interleave unless something keeps them apart.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_threads_working_at_once_keep_the_sims_bookkeeping_whole(frequent_thread_switches):
    with drop_in() as backend:

        def work(seed: int) -> list[float]:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                x = torch.full((16,), float(seed), device="cuda")
                for _ in range(150):
                    x = (x + 1) * 1
                done = torch.cuda.Event()
                done.record()
            done.synchronize()
            return x[:2].tolist()

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(work, range(8)))
        backend.synchronize()
        assert results == [[seed + 150.0] * 2 for seed in range(8)]
        assert backend.take_races() == []


def test_a_pool_worker_outliving_the_block_passes_through():
    pool = ThreadPoolExecutor(1)
    try:
        with drop_in():
            assert isinstance(
                pool.submit(lambda: torch.ones(1, device="cuda")).result(), SimDeviceTensor
            )
        host = pool.submit(lambda: torch.ones(2) * 2).result()
        assert type(host) is torch.Tensor and host.tolist() == [2.0, 2.0]
    finally:
        pool.shutdown()


def test_thread_start_is_torchs_own_again_after_the_last_block():
    start = threading.Thread.start
    with drop_in():
        with drop_in():
            assert threading.Thread.start is not start
        assert threading.Thread.start is not start
    assert threading.Thread.start is start
