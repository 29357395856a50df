"""Multi-stream capture, and (sim) the asynchronous stream model and its races."""

import pytest
import torch

from tests.conformance.case import another_stream


def _fork_join_capture(be, x, join: bool):
    g = be.Graph()
    with be.graph(g):
        origin = be.current_stream()
        side = another_stream(be)
        k0 = x + 1
        side.wait_stream(origin)
        k1 = k0 * 2
        with be.stream(side):
            k2 = k0 * 3
        if join:
            origin.wait_stream(side)
        k3 = k1 + k2
    return g, k3


def test_fork_join_capture_replays_correctly(be):
    x = torch.ones(8, device=be.device)
    g, k3 = _fork_join_capture(be, x, join=True)
    x.copy_(torch.arange(8.0, device=be.device))
    g.replay()
    be.synchronize()
    k0 = torch.arange(8.0, device=be.device) + 1
    assert torch.equal(k3, k0 * 2 + k0 * 3)


def test_side_stream_not_joined_before_capture_end_raises(be):
    x = torch.ones(8, device=be.device)
    with pytest.raises(be.CaptureError):
        _fork_join_capture(be, x, join=False)
    g, k3 = _fork_join_capture(be, x, join=True)
    g.replay()
    be.synchronize()
    assert torch.equal(k3, torch.full((8,), 10.0, device=be.device))


def _stage_and_consume(sim, seed: int, wait_for_copy: bool) -> float:
    """Stage 1.0 through a pinned buffer with an async copy, then reuse the buffer for 2.0."""
    sim.set_scheduler_seed(seed)
    pinned = sim.empty_pinned(4, dtype=torch.float32)
    device_buf = torch.zeros(4, device=sim.device)
    pinned.fill_(1.0)
    device_buf.copy_(pinned, non_blocking=True)
    copied = sim.Event()
    copied.record()
    if wait_for_copy:
        copied.synchronize()
    pinned.fill_(2.0)  # the host moves on to the next step's inputs
    result = (device_buf * 1).sum().item() / 4
    sim.synchronize()
    return result


def test_sim_reused_pinned_buffer_races_for_some_seeds(sim):
    results = [_stage_and_consume(sim, seed, wait_for_copy=False) for seed in range(50)]
    assert 1.0 in results and 2.0 in results


def test_sim_race_is_reproducible_per_seed(sim):
    first = [_stage_and_consume(sim, seed, wait_for_copy=False) for seed in range(20)]
    second = [_stage_and_consume(sim, seed, wait_for_copy=False) for seed in range(20)]
    assert first == second


def test_sim_event_wait_before_reuse_is_right_for_every_seed(sim):
    assert all(_stage_and_consume(sim, s, wait_for_copy=True) == 1.0 for s in range(50))


def _replay_after_side_copy(sim, seed: int, wait: bool) -> torch.Tensor:
    sim.set_scheduler_seed(seed)
    static_in = torch.zeros(4, device=sim.device)
    g = sim.Graph()
    with sim.graph(g):
        out = static_in * 10
    copy_stream = sim.Stream()
    pinned = sim.empty_pinned(4)
    pinned.copy_(torch.arange(4.0))
    with sim.stream(copy_stream):
        static_in.copy_(pinned, non_blocking=True)
    if wait:
        sim.current_stream().wait_stream(copy_stream)
    g.replay()
    result = out.clone()
    sim.synchronize()
    return result


def test_sim_replay_not_waiting_for_copy_stream_races(sim):
    expected = torch.arange(4.0, device=sim.device) * 10
    right = [torch.equal(_replay_after_side_copy(sim, s, wait=False), expected) for s in range(50)]
    assert not all(right)


def test_sim_replay_waiting_for_copy_stream_is_always_right(sim):
    expected = torch.arange(4.0, device=sim.device) * 10
    assert all(torch.equal(_replay_after_side_copy(sim, s, wait=True), expected) for s in range(50))


def test_sim_work_on_a_stream_outside_the_capture_is_missing_from_replay(sim):
    x = torch.ones(4, device=sim.device)
    side_result = torch.zeros(4, device=sim.device)
    outsider = sim.Stream()
    g = sim.Graph()
    with sim.graph(g):
        y = x * 2
        with sim.stream(outsider):  # never forked into the capture: runs, is not recorded
            side_result.copy_(x).mul_(7)
    outsider.synchronize()  # eager work on its stream, in its order: waited for like any other
    assert torch.equal(side_result, torch.full((4,), 7.0, device=sim.device))
    side_result.zero_()
    x.fill_(2.0)
    g.replay()
    assert torch.equal(y, torch.full((4,), 4.0, device=sim.device))
    assert torch.equal(side_result, torch.zeros(4, device=sim.device))


@pytest.mark.parametrize("seed", range(5))
def test_sim_work_outside_a_capture_runs_in_its_streams_order(sim, seed):
    # Issued on a stream the capture never joined while the capture runs (as another thread's
    # eager work is): after the work queued on that stream before it, as on CUDA.
    sim.set_scheduler_seed(seed)
    x, z = torch.zeros(4, device=sim.device), torch.ones(4, device=sim.device)
    ones = sim.empty_pinned(4)
    ones.fill_(1.0)
    outsider = sim.Stream()
    outsider.wait_stream(sim.current_stream())
    g = sim.Graph()
    with sim.graph(g):
        z * 2
        with sim.stream(outsider):
            x.copy_(ones, non_blocking=True)  # queued
            x.mul_(3)
    outsider.synchronize()
    assert torch.equal(x, torch.full((4,), 3.0, device=sim.device))


def test_sim_rebound_and_freed_weight_makes_replay_raise_use_after_free(sim):
    class Layer:
        def __init__(self):
            self.weight = torch.ones(4, 4, device=sim.device)

    layer = Layer()
    x = torch.ones(1, 4, device=sim.device)
    g = sim.Graph()
    with sim.graph(g):
        y = x @ layer.weight
    g.replay()
    assert torch.equal(y, torch.full((1, 4), 4.0, device=sim.device))
    layer.weight = torch.zeros(4, 4, device=sim.device)  # rebinding frees the captured weight
    with pytest.raises(sim.UseAfterFreeError, match=r"\[4, 4\] float32.*aten\.(t|mm)"):
        g.replay()


def test_sim_resized_workspace_makes_replay_raise_use_after_free(sim):
    workspace = torch.zeros(16, device=sim.device)
    g = sim.Graph()
    with sim.graph(g):
        workspace.add_(1)
    workspace.resize_(1 << 16)  # grows: the storage moves to a new address
    with pytest.raises(sim.UseAfterFreeError, match="reallocated"):
        g.replay()


def test_sim_scheduler_keeps_no_queue_for_finished_captures(sim):
    """A queue per stream ever used would make every later operation slower: only streams with
    queued work may have one."""
    x = torch.ones(4, device=sim.device)
    counter = torch.zeros(4, device=sim.device)
    for _ in range(300):
        capture_stream = sim.Stream()
        g = sim.Graph()
        with sim.graph(g, stream=capture_stream):
            y = x * 2
        side = sim.Stream()
        side.wait_stream(sim.current_stream())
        with sim.stream(side):
            counter.add_(1)  # queued on a stream that is dropped afterwards
        g.replay()
        sim.current_stream().wait_stream(side)
        assert torch.equal(y, torch.full((4,), 2.0, device=sim.device))
        assert sim.scheduler.queue_count <= 2
    assert torch.equal(counter, torch.full((4,), 300.0, device=sim.device))
    sim.synchronize()
    assert sim.scheduler.queue_count == 0


def _replay_reading_pinned(sim, seed: int, overwrite_after_replay: bool) -> torch.Tensor:
    sim.set_scheduler_seed(seed)
    staging = sim.empty_pinned(4)
    staging.fill_(1.0)
    static_in = torch.zeros(4, device=sim.device)
    g = sim.Graph()
    with sim.graph(g):
        static_in.copy_(staging, non_blocking=True)
        out = static_in * 10
    g.replay()
    if overwrite_after_replay:
        staging.fill_(2.0)  # the host moves on before the replay has run
    sim.synchronize()
    return out.clone()


def test_sim_replay_is_asynchronous_so_a_pinned_source_overwritten_after_it_races(sim):
    results = {_replay_reading_pinned(sim, s, True)[0].item() for s in range(50)}
    assert results == {10.0, 20.0}


def test_sim_replay_sees_the_pinned_source_it_was_launched_with_after_a_sync(sim):
    assert all(_replay_reading_pinned(sim, s, False)[0].item() == 10.0 for s in range(50))


def test_sim_device_to_host_copy_of_a_replay_is_stale_before_a_sync(sim):
    results = set()
    for seed in range(50):
        sim.set_scheduler_seed(seed)
        static_in = torch.zeros(4, device=sim.device)
        readback = sim.empty_pinned(4)
        readback.zero_()
        g = sim.Graph()
        with sim.graph(g):
            readback.copy_(static_in + 5, non_blocking=True)
        g.replay()
        results.add(readback.tolist()[0])  # a host read of host memory: no sync
        sim.synchronize()
        assert readback.tolist()[0] == 5.0
    assert results == {0.0, 5.0}


def test_sim_an_error_of_a_replayed_operation_says_which_and_that_it_ran_late(sim):
    table = torch.randn(8, 4, device=sim.device)
    rows = torch.zeros(2, dtype=torch.long, device=sim.device)
    g = sim.Graph()
    with sim.graph(g):
        out = table.index_select(0, rows) * 2
    rows.copy_(torch.tensor([1, 99]))  # past the table: the replay's gather raises
    g.replay()
    with pytest.raises(IndexError) as raised:
        out.clone()  # the replay runs here, when its stream is needed
    notes = raised.value.__notes__
    assert notes[0] == (
        "in a graph replay: its recorded operation 1 of 2, aten.index_select.default, as captured"
    )
    assert notes[1].startswith(
        "raised by device work queued earlier on <sim stream default> (graph"
    )
    assert len(notes) == 2


def test_sim_an_error_of_an_operation_queued_on_a_stream_says_it_ran_late(sim):
    table = torch.randn(8, 4, device=sim.device)
    rows = torch.tensor([1, 99], device=sim.device)
    side = sim.Stream()
    side.wait_stream(sim.current_stream())
    with sim.stream(side):
        picked = torch.empty(2, 4, device=sim.device)
        torch.index_select(table, 0, rows, out=picked)  # queued: raises when it runs
    with pytest.raises(IndexError) as raised:
        sim.synchronize()
    notes = raised.value.__notes__
    assert len(notes) == 1 and notes[0].startswith("raised by device work queued earlier"), notes
    assert "(aten.index_select.out)" in notes[0]
