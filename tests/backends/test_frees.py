"""The sim's free tracker: memory freed while another stream's queued work still uses it.

Each reported case is also run with what makes it correct (record_stream, a wait, a synchronize,
the tensor kept alive): a tracker that reported every free, or none, fails one of each pair.
"""

import math

import pytest
import torch

HERE = "test_frees.py:"


def _copy_then_free(sim, protect: str = "", keep: list | None = None) -> torch.Tensor:
    """Stage on the default stream, read on a copy stream, drop the staging, allocate again on the
    default stream. Returns the copy's destination (read after a synchronize)."""
    dst = torch.zeros(16, device=sim.device)
    copy_stream = sim.Stream()
    staged = torch.full((16,), 7.0, device=sim.device)
    copy_stream.wait_stream(sim.current_stream())
    sim.take_races()
    with sim.stream(copy_stream):
        dst.copy_(staged)
    if protect == "record_stream":
        staged.record_stream(copy_stream)
    elif protect == "wait_stream":
        sim.current_stream().wait_stream(copy_stream)
    elif protect == "synchronize":
        sim.synchronize()
    if keep is not None:
        keep.append(staged)
    del staged
    torch.empty(16, device=sim.device)  # the default stream's next allocation
    return dst


@pytest.mark.parametrize("seed", range(4))
def test_a_free_without_record_stream_is_reported_at_the_next_allocation(sim, seed):
    sim.set_scheduler_seed(seed)
    _copy_then_free(sim)
    (race,) = sim.take_races()
    assert (race.earlier.op, race.earlier.access) == ("aten.copy_.default", "read")
    assert race.earlier.stream.startswith("stream #")
    assert race.later.op.startswith("aten.empty.memory_format (an allocation")
    assert race.later.stream == "the default stream"
    assert HERE in race.earlier.line and HERE in race.later.line
    assert race.tensor == "tensor [16] float32" and race.byte_range == (0, 64)
    assert "record_stream(stream #" in race.describe()


def test_the_freed_block_is_overwritten_before_a_copy_still_queued_reads_it(sim):
    clobbered = 0
    for seed in range(8):  # the seed decides whether the copy ran before the allocation
        sim.set_scheduler_seed(seed)
        dst = _copy_then_free(sim)
        sim.synchronize()
        values = dst.tolist()
        assert all(v == 7.0 for v in values) or all(math.isnan(v) for v in values), values
        clobbered += math.isnan(values[0])
    assert clobbered > 0


@pytest.mark.parametrize("protect", ["record_stream", "wait_stream", "synchronize"])
def test_a_free_the_program_ordered_is_not_reported(sim, protect):
    dst = _copy_then_free(sim, protect=protect)
    assert sim.take_races() == []
    sim.synchronize()
    assert dst.tolist() == [7.0] * 16


def test_memory_still_held_by_the_program_is_not_freed(sim):
    kept: list[torch.Tensor] = []
    dst = _copy_then_free(sim, keep=kept)
    assert sim.take_races() == []
    sim.synchronize()
    assert dst.tolist() == [7.0] * 16


def test_a_view_keeps_the_memory(sim):
    dst = torch.zeros(8, device=sim.device)
    copy_stream = sim.Stream()
    staged = torch.full((16,), 7.0, device=sim.device)
    copy_stream.wait_stream(sim.current_stream())
    with sim.stream(copy_stream):
        dst.copy_(staged[:8])
    head = staged[8:]
    del staged
    torch.empty(16, device=sim.device)
    assert sim.take_races() == []
    sim.synchronize()
    assert dst.tolist() == [7.0] * 8 and head.tolist() == [7.0] * 8


def test_only_an_allocation_on_the_freeing_stream_may_take_the_block(sim):
    dst = torch.zeros(16, device=sim.device)
    copy_stream, other = sim.Stream(), sim.Stream()
    staged = torch.full((16,), 7.0, device=sim.device)
    copy_stream.wait_stream(sim.current_stream())
    sim.take_races()
    with sim.stream(copy_stream):
        dst.copy_(staged)
    del staged
    with sim.stream(other):
        torch.empty(16, device=sim.device)  # another stream's pool: not handed the block
    assert sim.take_races() == []
    torch.empty(16, device=sim.device)
    assert len(sim.take_races()) == 1


def test_memory_of_a_side_stream_read_on_the_default_stream_then_freed(sim):
    side = sim.Stream()
    with sim.stream(side):
        made = torch.full((16,), 3.0, device=sim.device)  # allocated on the side stream
    sim.current_stream().wait_stream(side)
    total = made.sum()  # read on the default stream
    sim.take_races()
    del made
    with sim.stream(side):
        torch.empty(16, device=sim.device)
    (race,) = sim.take_races()
    assert race.earlier.stream == "the default stream"
    assert race.later.stream.startswith("stream #")
    sim.synchronize()
    assert total.item() == 48.0


def test_a_replay_on_a_side_stream_reading_freed_input(sim):
    x = torch.ones(16, device=sim.device)
    g = sim.Graph()
    with sim.graph(g):
        x * 2
    side = sim.Stream()
    side.wait_stream(sim.current_stream())
    with sim.stream(side):
        g.replay()
    sim.take_races()
    del x  # a graph keeps addresses, not tensors
    torch.empty(16, device=sim.device)
    (race,) = sim.take_races()
    assert (race.earlier.op, race.earlier.access) == ("graph replay", "read")
