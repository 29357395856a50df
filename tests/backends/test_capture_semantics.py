"""Capture records and replay computes: the semantics every backend shares with CUDA graphs."""

import gc

import pytest
import torch


def test_capture_region_python_runs_once(be):
    x = torch.ones(4, device=be.device)
    runs = []
    g = be.Graph()
    with be.graph(g):
        runs.append(1)
        y = x * 2
    for _ in range(3):
        g.replay()
    be.synchronize()
    assert runs == [1]
    assert torch.equal(y, torch.full((4,), 2.0, device=be.device))


def test_capture_does_not_compute_in_place_updates(be):
    buf = torch.zeros(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        buf.add_(1)
    be.synchronize()
    assert torch.equal(buf, torch.zeros(4, device=be.device))
    g.replay()
    g.replay()
    be.synchronize()
    assert torch.equal(buf, torch.full((4,), 2.0, device=be.device))


def test_sim_outputs_are_poisoned_until_first_replay(sim):
    x = torch.ones(3, dtype=torch.float32, device=sim.device)
    ids = torch.arange(3, device=sim.device)
    g = sim.Graph()
    with sim.graph(g):
        y = x + 1
        k = ids * 2
    assert torch.isnan(y).all()
    assert (k != torch.arange(3, device=sim.device) * 2).all()
    g.replay()
    assert torch.equal(y, torch.full((3,), 2.0, device=sim.device))
    assert torch.equal(k, torch.arange(3, device=sim.device) * 2)


def test_captured_outputs_take_their_dtype_from_the_scalar_type(be):
    # 1 and 1.0 are equal (and hash alike) in Python, but make int64 and float32 tensors.
    g = be.Graph()
    with be.graph(g):
        ints = torch.full((4,), 1, device=be.device)
        floats = torch.full((4,), 1.0, device=be.device)
    g.replay()
    be.synchronize()
    assert (ints.dtype, floats.dtype) == (torch.int64, torch.float32)
    assert torch.equal(floats, torch.ones(4, device=be.device))


def test_replay_reads_current_contents_copy_changes_rebinding_does_not(be):
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 3
    x.copy_(torch.arange(4.0, device=be.device))
    g.replay()
    be.synchronize()
    assert torch.equal(y, torch.arange(4.0, device=be.device) * 3)
    captured = x  # keep the captured memory alive: the graph holds its address, not the name
    x = torch.full((4,), 100.0, device=be.device)
    g.replay()
    be.synchronize()
    assert torch.equal(y, captured * 3)
    assert not torch.equal(y, x * 3)


def test_shapes_are_frozen_at_capture(be):
    static = torch.arange(8.0, device=be.device)
    rows = 4
    g = be.Graph()
    with be.graph(g):
        out = static[:rows] * 2
    rows = 8
    static.copy_(torch.arange(8.0, device=be.device) + 10)
    g.replay()
    be.synchronize()
    assert out.shape == (4,)
    assert torch.equal(out, (torch.arange(4.0, device=be.device) + 10) * 2)
    assert rows == 8


def test_two_captures_share_a_pool(be):
    x = torch.ones(64, device=be.device)
    g1, g2 = be.Graph(), be.Graph()
    with be.graph(g1):
        a = (x * 2).sum(0, keepdim=True)
    with be.graph(g2, pool=g1.pool()):
        b = (x * 5).sum(0, keepdim=True)
    x.fill_(3.0)
    g1.replay()
    g2.replay()
    be.synchronize()
    assert a.item() == 64 * 6.0
    assert b.item() == 64 * 15.0


def test_temporaries_are_reused_inside_one_capture(be):
    x = torch.ones(1024, device=be.device)
    g = be.Graph()
    with be.graph(g):
        first = x * 2
        first_ptr = first.data_ptr()
        del first
        second = x * 3
    g.replay()
    be.synchronize()
    assert second.data_ptr() == first_ptr
    assert torch.equal(second, torch.full((1024,), 3.0, device=be.device))


def test_sim_an_empty_temporary_of_a_capture_goes_back_to_the_pool(sim):
    # `q[:0]` where a batch has no decode rows: a 0-byte block, which reports no data pointer.
    x = torch.ones(4, 3, device=sim.device)
    pool = sim.graph_pool_handle()
    g = sim.Graph()
    with sim.graph(g, pool=pool):
        empty = x[:0] * 2
        y = (empty + 1).sum(0) + x.sum(0)
    block = pool.allocate(0)
    pool.release(block)  # raised "block does not belong to this pool"
    g.replay()
    sim.synchronize()
    assert torch.equal(y, torch.full((3,), 4.0, device=sim.device))
    free_before = [list(ranges) for ranges in pool._free]
    del empty
    gc.collect()
    assert pool._free != free_before  # its alignment unit is free again


def test_sim_shared_pool_reuses_freed_blocks_across_captures(sim):
    x = torch.ones(4096, device=sim.device)
    pool = sim.graph_pool_handle()
    g1, g2 = sim.Graph(), sim.Graph()
    with sim.graph(g1, pool=pool):
        out1 = (x * 2 + 1).sum()
    after_first = pool.reserved_bytes
    with sim.graph(g2, pool=pool):
        out2 = (x * 3 + 1).sum()
    assert pool.reserved_bytes == after_first
    g1.replay()
    g2.replay()
    assert out1.item() == 4096 * 3 and out2.item() == 4096 * 4


def test_random_ops_advance_per_replay(be):
    g = be.Graph()
    with be.graph(g):
        noise = torch.rand(16, device=be.device)
    g.replay()
    first = noise.clone()
    g.replay()
    be.synchronize()
    assert torch.isfinite(noise).all() and ((noise >= 0) & (noise < 1)).all()
    assert not torch.equal(first, noise)


def test_replay_without_capture_is_an_error(be):
    g = be.Graph()
    with pytest.raises(RuntimeError):
        g.replay()


@pytest.mark.parametrize("kept", [True, False], ids=["torch-2.11-on", "before-2.11"])
def test_sim_keeps_a_pinned_block_made_in_the_capture_as_the_torch_it_runs_on_does(
    sim, monkeypatch, kept
):
    from pytest_graphmode.runtime.backends.sim import capturing as sim_capturing

    monkeypatch.setattr(sim_capturing, "KEEPS_CAPTURED_PINNED_BLOCKS", kept)
    static = torch.zeros(4, device=sim.device)
    before = sim.empty_pinned(4)
    before.fill_(2.0)
    g = sim.Graph()
    with sim.graph(g):
        made = sim.empty_pinned(4)
        made.fill_(1.0)
        static.copy_(made, non_blocking=True)
    second = sim.Graph()
    with sim.graph(second):
        static.copy_(before, non_blocking=True)
    del made, before
    static.zero_()
    if kept:
        g.replay()
        sim.synchronize()
        assert static.tolist() == [1.0] * 4
    else:
        with pytest.raises(sim.UseAfterFreeError, match="freed after capture"):
            g.replay()
    # a block made before its capture is never kept
    with pytest.raises(sim.UseAfterFreeError, match="freed after capture"):
        second.replay()
