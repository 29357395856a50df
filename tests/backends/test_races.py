"""The sim's happens-before race checker: what it orders, what it reports, and where.

Every racy case is also run with the missing synchronization added, and must then report nothing:
a checker that reported everything, or nothing, fails one of each pair.
"""

import pytest
import torch

from pytest_graphmode.runtime.backends import Race
from pytest_graphmode.runtime.backends.footprint import issuing

HERE = "test_races.py:"


def _only_race(sim) -> Race:
    races = sim.take_races()
    assert len(races) == 1, [r.describe() for r in races]
    return races[0]


def _side_stream_writes(sim, x: torch.Tensor, *, join: bool):
    side = sim.Stream()
    side.wait_stream(sim.current_stream())  # the side stream sees x as created
    with sim.stream(side):
        x.add_(1)
    if join:
        sim.current_stream().wait_stream(side)
    return x * 2


@pytest.mark.parametrize("seed", range(5))
def test_a_missing_wait_stream_is_reported_whatever_the_scheduler_seed(sim, seed):
    sim.set_scheduler_seed(seed)
    x = torch.zeros(8, device=sim.device)
    sim.take_races()
    _side_stream_writes(sim, x, join=False)
    race = _only_race(sim)
    assert (race.earlier.op, race.earlier.access) == ("aten.add_.Tensor", "write")
    assert (race.later.op, race.later.access) == ("aten.mul.Tensor", "read")
    assert race.earlier.stream.startswith("stream #")
    assert race.later.stream == "the default stream"
    assert HERE in race.earlier.line and HERE in race.later.line
    assert race.tensor == "tensor [8] float32" and race.byte_range == (0, 32)


def test_wait_stream_orders_the_accesses(sim):
    x = torch.zeros(8, device=sim.device)
    sim.take_races()
    _side_stream_writes(sim, x, join=True)
    assert sim.take_races() == []


@pytest.mark.parametrize("recorded_after_the_write", [True, False])
def test_an_event_orders_what_was_issued_before_its_record(sim, recorded_after_the_write):
    x, side, done = torch.zeros(8, device=sim.device), sim.Stream(), sim.Event()
    side.wait_stream(sim.current_stream())
    sim.take_races()
    with sim.stream(side):
        if not recorded_after_the_write:
            done.record()
        x.add_(1)
        if recorded_after_the_write:
            done.record()
    sim.current_stream().wait_event(done)
    x.sum()
    assert len(sim.take_races()) == (0 if recorded_after_the_write else 1)


@pytest.mark.parametrize("sync", [None, "stream", "event", "device"])
def test_the_host_reads_a_pinned_download_only_after_a_synchronization(sim, sync):
    x, side, done = torch.arange(4.0, device=sim.device), sim.Stream(), sim.Event()
    host = sim.empty_pinned(4)
    side.wait_stream(sim.current_stream())
    sim.take_races()
    with sim.stream(side):
        host.copy_(x, non_blocking=True)
        done.record()
    if sync == "stream":
        side.synchronize()
    elif sync == "event":
        done.synchronize()
    elif sync == "device":
        sim.synchronize()
    host.tolist()
    races = sim.take_races()
    if sync is not None:
        assert races == []
        return
    [race] = races
    assert race.earlier.op == "aten.copy_" and race.earlier.access == "write"
    assert (race.later.op, race.later.stream) == ("Tensor.tolist()", "the host")


@pytest.mark.parametrize(
    ("side_view", "default_view", "races"),
    [
        (slice(0, None, 2), slice(1, None, 2), 0),  # interleaved columns: no shared byte
        (slice(0, None, 2), slice(2, None, 4), 1),  # every other column of the same ones
        (slice(0, 4), slice(4, 8), 0),  # adjacent halves
        (slice(0, 5), slice(4, 8), 1),  # one shared column
    ],
)
def test_views_of_one_buffer_race_only_where_they_share_bytes(sim, side_view, default_view, races):
    buf, side = torch.zeros(4, 8, device=sim.device), sim.Stream()
    side.wait_stream(sim.current_stream())
    sim.take_races()
    with sim.stream(side):
        buf[:, side_view].add_(1)
    buf[:, default_view].add_(1)
    assert len(sim.take_races()) == races


@pytest.mark.parametrize("join", [True, False])
def test_a_replay_counts_as_the_accesses_its_capture_recorded(sim, join):
    x = torch.ones(8, device=sim.device)
    g = sim.Graph()
    with sim.graph(g):
        y = x * 3
    side = sim.Stream()
    side.wait_stream(sim.current_stream())
    sim.take_races()
    with sim.stream(side):
        x.fill_(2.0)
    if join:
        sim.current_stream().wait_stream(side)
    g.replay()
    sim.synchronize()
    races = sim.take_races()
    assert torch.equal(y, torch.full((8,), 6.0, device=sim.device)) or not join
    if join:
        assert races == []
        return
    [race] = races
    assert (race.earlier.op, race.later.op) == ("aten.fill_.Scalar", "graph replay")
    assert race.later.access == "read" and HERE in race.later.line


@pytest.mark.parametrize("waits", [True, False])
def test_a_pinned_source_rewritten_by_a_torch_op_before_its_copy_ran(sim, waits):
    staging, dst, copied = sim.empty_pinned(4), torch.zeros(4, device=sim.device), sim.Event()
    staging.fill_(1.0)
    sim.take_races()
    dst.copy_(staging, non_blocking=True)
    copied.record()
    if waits:
        copied.synchronize()
    staging.fill_(2.0)
    races = sim.take_races()
    if waits:
        assert races == []
        return
    [race] = races
    assert (race.earlier.op, race.earlier.access) == ("aten.copy_", "read")
    assert (race.later.op, race.later.stream) == ("aten.fill_.Scalar", "the host")


def test_each_side_of_a_race_names_the_step_the_harness_was_issuing(sim):
    # A race across two steps (a pipelined pair, a copy queued a step before) says which step
    # each side came from; outside a step a line is the line alone.
    staging, dst = sim.empty_pinned(4), torch.zeros(4, device=sim.device)
    staging.fill_(1.0)
    sim.take_races()
    with issuing("step 4"):
        dst.copy_(staging, non_blocking=True)
    with issuing("step 5"):
        with issuing("the harness's read"):
            pass
        staging.fill_(2.0)  # the outer step again once the inner one is left
    race = _only_race(sim)
    assert race.earlier.line.endswith(", in step 4") and HERE in race.earlier.line
    assert race.later.line.endswith(", in step 5") and HERE in race.later.line
    assert "in step 4" in race.describe() and "in step 5" in race.describe()
    dst.copy_(staging, non_blocking=True)
    staging.fill_(3.0)
    assert ", in " not in _only_race(sim).later.line


@pytest.mark.parametrize("waits", [True, False])
def test_a_pinned_source_rewritten_through_numpy_before_its_copy_ran(sim, waits):
    pytest.importorskip("numpy")
    staging, dst, copied = sim.empty_pinned(4), torch.zeros(4, device=sim.device), sim.Event()
    view = staging.numpy()
    view[:] = 1.0
    sim.take_races()
    dst.copy_(staging, non_blocking=True)
    copied.record()
    if waits:
        copied.synchronize()
    view[:] = 2.0  # invisible to torch: only the changed bytes tell
    sim.synchronize()
    races = sim.take_races()
    if waits:
        assert races == []
        return
    [race] = races
    assert race.earlier.op == "aten.copy_" and HERE in race.earlier.line
    assert "numpy" in race.later.op and race.later.stream == "the host"


@pytest.mark.parametrize("ordered", [True, False])
def test_a_download_into_the_pinned_block_an_upload_read_is_no_host_write(sim, ordered):
    # Swap-in, then back-up (a KV offloader's round trip through one pinned block): the download
    # changes the bytes the upload was watched on. Issued after the upload on its own stream, it
    # is ordered after it; issued on another stream that did not wait, it races with it.
    pinned, dst = sim.empty_pinned(4), torch.ones(4, device=sim.device)
    side = sim.Stream()
    side.wait_stream(sim.current_stream())
    sim.take_races()
    with sim.stream(side):
        dst.copy_(pinned, non_blocking=True)
    writer = side if ordered else sim.Stream()
    with sim.stream(writer):
        pinned.copy_(torch.full((4,), 7.0, device=sim.device), non_blocking=True)
    sim.synchronize()
    races = sim.take_races()
    if ordered:
        assert races == []
        return
    assert [(r.earlier.op, r.earlier.access, r.later.access) for r in races] == [
        ("aten.copy_", "read", "write")
    ]
    assert "numpy" not in races[0].later.op  # the download, not an unseen host write


def test_a_copy_of_unchanged_pinned_bytes_is_no_race(sim):
    pytest.importorskip("numpy")
    staging, dst = sim.empty_pinned(4), torch.zeros(4, device=sim.device)
    view = staging.numpy()
    view[:] = 1.0
    sim.take_races()
    dst.copy_(staging, non_blocking=True)
    view[:] = 1.0  # the same bytes: the queued copy reads what it was issued on
    sim.synchronize()
    assert sim.take_races() == []


def test_races_are_handed_over_once(sim):
    _side_stream_writes(sim, torch.zeros(8, device=sim.device), join=False)
    assert len(sim.take_races()) == 1
    assert sim.take_races() == []


@pytest.mark.graphmode_cuda
def test_cuda_reports_no_race_where_no_delayed_step_saw_the_copy():
    # cuda has no checker of every access: only the harness's delayed steps tell it of copies
    # in flight (tests/fuzz/test_inflight_copies_cuda.py), so this race goes unreported.
    if not torch.cuda.is_available():
        pytest.skip("cuda backend: no CUDA GPU on this machine")
    from pytest_graphmode.runtime import backends

    cuda = backends.get("cuda")
    cuda.synchronize()
    cuda.take_races()
    staging = cuda.empty_pinned(1024)
    device = torch.zeros(1024, device=cuda.device)
    torch.cuda._sleep(50_000_000)
    device.copy_(staging, non_blocking=True)
    staging.fill_(1.0)
    cuda.synchronize()
    assert cuda.take_races() == []


@pytest.mark.parametrize("same_graph", [True, False])
def test_two_launches_of_one_graph_on_two_streams_are_ordered_two_graphs_are_not(sim, same_graph):
    # CUDA runs one launch of a graph at a time, whatever stream it is on; two graphs run side by
    # side. Both graphs write x, so only the ordering decides whether the second write races.
    x = torch.zeros(8, device=sim.device)
    graphs = [sim.Graph(), sim.Graph()]
    for g in graphs:
        with sim.graph(g):
            x.add_(1)
    first, second = sim.Stream(), sim.Stream()
    first.wait_stream(sim.current_stream())
    second.wait_stream(sim.current_stream())
    sim.take_races()
    with sim.stream(first):
        graphs[0].replay()
    with sim.stream(second):
        graphs[0 if same_graph else 1].replay()
    sim.synchronize()
    races = sim.take_races()
    if same_graph:
        assert races == [], [r.describe() for r in races]
        assert x.tolist() == [2.0] * 8
    else:
        assert [(r.earlier.op, r.later.op) for r in races] == [("graph replay", "graph replay")]


@pytest.mark.parametrize("external", [True, False])
def test_an_event_a_graph_records_may_be_waited_for_outside_only_when_external(sim, external):
    x = torch.zeros(8, device=sim.device)
    event = sim.Event(external=external)
    g = sim.Graph()
    with sim.graph(g):
        x.add_(1)
        event.record()
    g.replay()
    other = sim.Stream()
    if not external:
        with pytest.raises(RuntimeError, match="recorded inside a graph capture"):
            other.wait_event(event)
        return
    sim.take_races()
    other.wait_event(event)
    with sim.stream(other):
        y = x * 2
    other.synchronize()
    assert sim.take_races() == []
    assert y.tolist() == [2.0] * 8
