"""Side streams forked inside a capture: the sim judges the graph's branches as CUDA runs them,
side by side. A race between two branches is reported at capture, and each replay runs the
branches in an order its scheduler seed picks.

Every racy graph is also captured with the missing join added, and must then report nothing and
replay one value under every seed."""

import contextlib
import random

import pytest
import torch

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.runtime.backends.sim import capture_order
from pytest_graphmode.runtime.backends.sim.capture_order import Branches
from tests.runners.from_docs import shared_expert_stream_inplace

HERE = "test_capture_branches.py:"


def _overwrite_while_a_branch_reads(sim, x: torch.Tensor, *, join: str):
    """The side branch reads `x`; the origin then overwrites it in place. `join`: how the origin
    waits for the side branch before the write ("none", "stream" or "event")."""
    g = sim.Graph()
    with sim.graph(g):
        origin = sim.current_stream()
        side = sim.Stream()
        side.wait_stream(origin)
        with sim.stream(side):
            y = x * 2
            read = sim.Event()
            read.record()
        if join == "stream":
            origin.wait_stream(side)
        elif join == "event":
            origin.wait_event(read)
        x.fill_(100.0)
        origin.wait_stream(side)
    return g, y


def _values_over_seeds(sim, g, x: torch.Tensor, out: torch.Tensor) -> set[tuple[float, ...]]:
    seen = set()
    for seed in range(12):
        sim.set_scheduler_seed(seed)
        x.fill_(1.0)
        g.replay()
        sim.synchronize()
        seen.add(tuple(out.tolist()))
    return seen


def test_a_race_between_two_branches_of_a_capture_is_reported_when_it_is_captured(sim):
    x = torch.zeros(4, device=sim.device)
    sim.take_races()
    g, y = _overwrite_while_a_branch_reads(sim, x, join="none")
    races = sim.take_races()
    assert len(races) == 1, [r.describe() for r in races]
    race = races[0]
    assert (race.earlier.op, race.earlier.access) == ("aten.mul.Tensor", "read")
    assert (race.later.op, race.later.access) == ("aten.fill_.Scalar", "write")
    assert race.earlier.stream != race.later.stream
    assert HERE in race.earlier.line and HERE in race.later.line
    assert "one captured graph" in race.describe()
    assert _values_over_seeds(sim, g, x, y) == {(2.0,) * 4, (200.0,) * 4}


@pytest.mark.parametrize("join", ["stream", "event"])
def test_a_join_inside_the_capture_orders_its_branches(sim, join):
    x = torch.zeros(4, device=sim.device)
    sim.take_races()
    g, y = _overwrite_while_a_branch_reads(sim, x, join=join)
    assert sim.take_races() == []
    assert _values_over_seeds(sim, g, x, y) == {(2.0,) * 4}


def test_an_event_recorded_before_the_branch_read_does_not_order_it(sim):
    x = torch.zeros(4, device=sim.device)
    sim.take_races()
    g = sim.Graph()
    with sim.graph(g):
        origin, side, early = sim.current_stream(), sim.Stream(), sim.Event()
        side.wait_stream(origin)
        with sim.stream(side):
            early.record()
            x * 2
        origin.wait_event(early)
        x.fill_(100.0)
        origin.wait_stream(side)
    assert len(sim.take_races()) == 1


def test_a_block_a_branch_freed_serves_that_branch_only(sim):
    """As in CUDA's caching allocator, a pool's blocks serve the stream that first allocated
    them: a side branch's temporary, dead inside the capture, is handed to the side branch's next
    output, never to the origin's, whose work it would otherwise order after the branch's."""
    x = torch.ones(256, device=sim.device)
    sim.take_races()
    g = sim.Graph()
    with sim.graph(g):
        origin, side = sim.current_stream(), sim.Stream()
        side.wait_stream(origin)
        with sim.stream(side):
            tmp = x * 3
            block = tmp.data_ptr()
            y = tmp + 1
            del tmp
        z = x * 5
        with sim.stream(side):
            w = y * 2
        origin.wait_stream(side)
    assert z.data_ptr() != block and w.data_ptr() == block
    assert sim.take_races() == []
    assert _values_over_seeds(sim, g, x, w) == {(8.0,) * 256}


def _free_under_a_branch(sim, x: torch.Tensor, *, kept_by: str):
    """The origin frees a block the side branch reads, then allocates one of its size. `kept_by`:
    what keeps the block for the branch ("nothing", "record_stream", or an "event" the origin
    waits on after the branch's read)."""
    g = sim.Graph()
    with sim.graph(g):
        origin, side = sim.current_stream(), sim.Stream()
        first = x * 2
        block = first.data_ptr()
        side.wait_stream(origin)
        with sim.stream(side):
            seen = first + 1
            read = sim.Event()
            read.record()
        if kept_by == "record_stream":
            first.record_stream(side)
        elif kept_by == "event":
            origin.wait_event(read)
        del first
        second = x * 50
        origin.wait_stream(side)
    return g, seen, second.data_ptr() == block


def test_a_block_freed_while_another_branch_reads_it_races_with_its_next_owner(sim):
    """In a capture CUDA's caching allocator hands a freed block at once to the next allocation
    of its stream: the branch that still reads it runs side by side with the new owner at every
    replay. The sim reports it at capture and replays either order."""
    x = torch.ones(256, device=sim.device)
    sim.take_races()
    g, seen, reused = _free_under_a_branch(sim, x, kept_by="nothing")
    assert reused
    races = sim.take_races()
    assert len(races) == 1, [r.describe() for r in races]
    race = races[0]
    assert (race.earlier.op, race.earlier.access) == ("aten.add.Tensor", "read")
    assert race.later.op == "aten.mul.Tensor (an allocation handed the freed block)"
    assert race.earlier.stream != race.later.stream
    assert HERE in race.later.line
    assert "record_stream" in race.cause and "freed a block" in race.cause
    assert _values_over_seeds(sim, g, x, seen) == {(3.0,) * 256, (51.0,) * 256}


@pytest.mark.parametrize("kept_by", ["record_stream", "event"])
def test_a_block_kept_for_the_branch_that_reads_it_is_no_race(sim, kept_by):
    """`record_stream` keeps the block from every allocation until the capture ends; an event
    wait orders its next owner after the branch's read."""
    x = torch.ones(256, device=sim.device)
    sim.take_races()
    g, seen, reused = _free_under_a_branch(sim, x, kept_by=kept_by)
    assert reused == (kept_by == "event")
    assert sim.take_races() == []
    assert _values_over_seeds(sim, g, x, seen) == {(3.0,) * 256}


class _RecordingPool:
    """A runner's own capture pool that notes the blocks given back to it."""

    def __init__(self) -> None:
        self._memory = torch.empty(1 << 16, dtype=torch.uint8)
        self._next = 0
        self.given_back: list[int] = []

    def allocate(self, nbytes: int) -> torch.Tensor:
        block = self._memory[self._next : self._next + nbytes]
        self._next += (nbytes + 511) // 512 * 512
        return block

    def release(self, block: torch.Tensor) -> None:
        self.given_back.append(block.data_ptr())


@pytest.mark.parametrize("ends", ["ends", "fails"])
def test_a_block_recorded_on_another_stream_comes_back_when_its_capture_ends(sim, ends):
    x = torch.ones(256, device=sim.device)
    pool = _RecordingPool()
    g = sim.Graph()
    failure = pytest.raises(ValueError) if ends == "fails" else contextlib.nullcontext()
    with failure, sim.graph(g, pool=pool):
        origin, side = sim.current_stream(), sim.Stream()
        kept, dropped = x * 2, x * 3
        kept_at, dropped_at = kept.data_ptr(), dropped.data_ptr()
        side.wait_stream(origin)
        with sim.stream(side):
            read = kept + 1
        kept.record_stream(side)
        dropped.record_stream(origin)  # its own stream: no reason to keep it
        del kept, dropped
        assert pool.given_back == [dropped_at]
        origin.wait_stream(side)
        if ends == "fails":
            raise ValueError("the runner's own error inside the capture")
    assert pool.given_back == [dropped_at, kept_at]
    assert read.data_ptr() not in pool.given_back  # alive: its block stays out


class _StackPool:
    """A runner's own capture pool (`SimCapturePool`) that knows no streams: the last block
    freed is the next one handed out, whichever stream asks."""

    def __init__(self) -> None:
        self._memory = torch.empty(1 << 16, dtype=torch.uint8)
        self._next = 0
        self._freed: list[torch.Tensor] = []

    def allocate(self, nbytes: int) -> torch.Tensor:
        for i in range(len(self._freed) - 1, -1, -1):
            if self._freed[i].numel() >= nbytes:
                return self._freed.pop(i)[:nbytes]
        size = (nbytes + 511) // 512 * 512
        block = self._memory[self._next : self._next + size]
        self._next += size
        return block[:nbytes]

    def release(self, block: torch.Tensor) -> None:
        self._freed.append(block)


@pytest.mark.parametrize("kept", ["every access", "two accesses a storage"])
def test_a_block_a_pool_hands_from_a_branch_to_the_origin_follows_its_last_use(
    sim, monkeypatch, kept
):
    """A pool of the runner's own hands the side branch's dead temporary to the origin: the
    origin's write follows the branch's last use of the block, so it is no race and never lands
    before that use. Also when the capture's race checker had to forget accesses for want of
    room: the order keeps its own record of a block's users."""
    if kept != "every access":
        monkeypatch.setattr(capture_order, "_PER_STORAGE", 2)
    x = torch.ones(256, device=sim.device)
    sim.take_races()
    g = sim.Graph()
    with sim.graph(g, pool=_StackPool()):
        origin, side = sim.current_stream(), sim.Stream()
        side.wait_stream(origin)
        with sim.stream(side):
            tmp = x * 3
            block = tmp.data_ptr()
            y = tmp + 1
            del tmp
        z = x * 5
        assert z.data_ptr() == block, "the pool did not hand the freed block out again"
        origin.wait_stream(side)
    assert sim.take_races() == []
    assert _values_over_seeds(sim, g, x, y) == {(4.0,) * 256}
    assert bool((z == 5.0).all())


def test_a_block_handed_from_a_branch_to_the_origin_orders_nothing_else(sim):
    """Reusing a block orders the new owner after that block's users only: the origin's later
    write to a tensor the side branch read is still a race."""
    x = torch.ones(256, device=sim.device)
    sim.take_races()
    g = sim.Graph()
    with sim.graph(g, pool=_StackPool()):
        origin, side = sim.current_stream(), sim.Stream()
        h = x * 1
        side.wait_stream(origin)
        with sim.stream(side):
            tmp = h * 3
            block = tmp.data_ptr()
            tmp + 1
            del tmp
        z = x * 5
        assert z.data_ptr() == block, "the pool did not hand the freed block out again"
        h.copy_(z)
        origin.wait_stream(side)
    races = sim.take_races()
    assert [(r.earlier.op, r.later.op) for r in races] == [
        ("aten.mul.Tensor", "aten.copy_.default")
    ]


def test_a_runner_whose_graphs_fork_and_join_correctly_replays_eager_values_under_every_seed(sim):
    """A MoE runner's shared expert on a side stream in every captured graph: temporaries of
    both branches share the pool, a block of one branch is split between both later. Any order
    a replay draws gives the eager twin's logits."""
    batch = Batch(
        tuple(
            Request(req_id=i, tokens=(t,), context_len=0, block_ids=(b,))
            for i, (t, b) in enumerate([(29, 35), (55, 31), (4, 18)])
        )
    )
    eager = shared_expert_stream_inplace.make_target("eager", seed=0, backend="sim")
    expected = eager.step(batch).logits
    sim.take_races()
    graph = shared_expert_stream_inplace.make_target("graph", seed=0, backend="sim")
    assert sim.take_races() == []
    for seed in range(8):
        sim.set_scheduler_seed(seed)
        result = graph.step(batch)
        assert result.path == "full"
        torch.testing.assert_close(result.logits, expected)


def test_work_issued_before_the_first_fork_runs_first_under_every_seed(sim):
    """Views and values made before the fork, read by views and work of a branch after it."""
    x = torch.arange(8.0, device=sim.device)
    g = sim.Graph()
    with sim.graph(g):
        origin, side = sim.current_stream(), sim.Stream()
        head = x[:4]
        doubled = head * 2
        side.wait_stream(origin)
        with sim.stream(side):
            y = head[1:] + doubled[1:]
        origin.wait_stream(side)
    assert _values_over_seeds(sim, g, x, y) == {(3.0, 3.0, 3.0)}


def test_a_wait_on_an_event_a_stream_records_before_any_work_follows_what_it_waited_for(sim):
    x = torch.zeros(4, device=sim.device)
    sim.take_races()
    g = sim.Graph()
    with sim.graph(g):
        origin, relay, reader = sim.current_stream(), sim.Stream(), sim.Stream()
        relay.wait_stream(origin)
        x.fill_(5.0)
        relay.wait_stream(origin)  # relay now follows the fill, and issues nothing itself
        passed_on = relay.record_event()
        reader.wait_event(passed_on)
        with sim.stream(reader):
            y = x * 2
        origin.wait_stream(relay)
        origin.wait_stream(reader)
    assert sim.take_races() == []
    assert _values_over_seeds(sim, g, x, y) == {(10.0,) * 4}


def test_a_capture_of_one_stream_replays_in_recorded_order(sim):
    x = torch.ones(4, device=sim.device)
    g = sim.Graph()
    with sim.graph(g):
        y = (x + 1) * 2
    assert g._program.branches is None
    g.replay()
    sim.synchronize()
    assert y.tolist() == [4.0] * 4


def _respects(order: list[int], deps: list[tuple[int, ...]]) -> bool:
    at = {node: i for i, node in enumerate(order)}
    return sorted(order) == list(range(len(deps))) and all(
        at[d] < at[n] for n, before in enumerate(deps) for d in before
    )


def test_every_replay_order_keeps_the_dependencies_and_both_extremes_are_drawn():
    # two branches of three forked after node 0 and joined at node 7; node 8 is a view of node 7
    agents = [1, 1, 1, 1, 2, 2, 2, 1, None]
    deps = [(), (0,), (1,), (2,), (0,), (4,), (5,), (3, 6), ()]
    branches = Branches(agents, deps)
    rng = random.Random(0)
    orders = [branches.linear_extension(rng) for _ in range(64)]
    assert all(_respects(order, deps) for order in orders)
    firsts = {tuple(o.index(n) < o.index(4) for n in (1, 2, 3)) for o in orders}
    assert (True, True, True) in firsts and (False, False, False) in firsts
