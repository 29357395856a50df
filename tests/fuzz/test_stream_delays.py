"""Which operations the cuda stream delays hold back, and that their scope leaves torch as it was.

These run without a GPU: the decision is a function of devices and flags, the sleep and the stream
lookup are replaced by recorders, and fake tensors stand in for cuda tensors. What the delays do
to real streams is in test_stream_delays_cuda.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.fuzz import replay
from pytest_graphmode.strategies import stream_delays, stressors
from pytest_graphmode.strategies.plans import Stress
from pytest_graphmode.strategies.stream_delays import (
    StreamsMet,
    async_copy_device,
    delayed_compute,
    delayed_streams,
    landed_copies,
)
from tests.fuzz.toy import ToyTarget

aten = torch.ops.aten
CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _on(device: torch.device) -> Any:
    return SimpleNamespace(device=device)  # all the decision reads of a tensor


def test_a_non_blocking_upload_is_delayed_on_its_cuda_device():
    assert async_copy_device(aten.copy_.default, (_on(CUDA), _on(CPU), True), {}) == CUDA


def test_a_non_blocking_download_is_delayed_on_its_cuda_device():
    assert async_copy_device(aten.copy_.default, (_on(CPU), _on(CUDA), True), {}) == CUDA


def test_non_blocking_given_by_keyword_counts_too():
    args = (_on(CUDA), _on(CPU))
    assert async_copy_device(aten.copy_.default, args, {"non_blocking": True}) == CUDA


def test_blocking_copies_are_not_delayed():
    assert async_copy_device(aten.copy_.default, (_on(CUDA), _on(CPU)), {}) is None
    assert async_copy_device(aten.copy_.default, (_on(CUDA), _on(CPU), False), {}) is None


def test_copies_that_stay_on_one_side_are_not_delayed():
    for ends in ((CPU, CPU), (CUDA, CUDA), (CUDA, torch.device("cuda", 1))):
        assert async_copy_device(aten.copy_.default, (*map(_on, ends), True), {}) is None


def test_to_another_side_is_delayed_and_a_dtype_change_is_not():
    upload = {"device": CUDA, "non_blocking": True}
    assert async_copy_device(aten._to_copy.default, (_on(CPU),), upload) == CUDA
    download = {"device": CPU, "non_blocking": True}
    assert async_copy_device(aten._to_copy.default, (_on(CUDA),), download) == CUDA
    cast = {"dtype": torch.float16, "non_blocking": True}
    assert async_copy_device(aten._to_copy.default, (_on(CUDA),), cast) is None


def test_other_operations_are_not_delayed():
    assert async_copy_device(aten.add_.Tensor, (_on(CUDA), _on(CPU)), {}) is None


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, int]]:
    """Every sleep the delays enqueue, as (stream, cycles); the stream of a copy on device d is
    ("current", d)."""
    made: list[tuple[Any, int]] = []
    monkeypatch.setattr(
        stream_delays, "_sleep_on", lambda stream, cycles: made.append((stream, cycles))
    )
    monkeypatch.setattr(stream_delays, "_current_stream", lambda device: ("current", device))
    monkeypatch.setattr(stream_delays, "_capturing", lambda stream: False)
    monkeypatch.setattr(stream_delays, "_resolved", lambda stream: stream or "current stream")
    return made


def test_copies_seen_inside_the_scope_sleep_on_their_stream_first(sleeps):
    with FakeTensorMode():
        device_tensor, host = torch.empty(4, device="cuda"), torch.empty(4)
        with delayed_streams(7):
            host.copy_(device_tensor, non_blocking=True)
            device_tensor.to("cpu", non_blocking=True)
            host.copy_(device_tensor)
            host.add_(1)
        host.copy_(device_tensor, non_blocking=True)  # after the scope
    assert sleeps == [(("current", CUDA), 7)] * 2


def test_an_event_record_sleeps_on_the_recording_stream_then_records(sleeps, monkeypatch):
    calls: list[tuple[str, Any, Any]] = []

    def record(event: Any, stream: Any = None) -> None:
        calls.append(("record", event, stream))

    monkeypatch.setattr(torch.cuda.Event, "record", record)
    with delayed_streams(9):
        torch.cuda.Event.record("event", "copy stream")
        torch.cuda.Event.record("event")
    assert sleeps == [("copy stream", 9), (None, 9)]  # None: the current stream, as record's
    assert calls == [("record", "event", "copy stream"), ("record", "event", None)]


def test_the_first_operation_on_a_stream_the_step_entered_sleeps_there_first(sleeps, monkeypatch):
    entered: list[Any] = []
    monkeypatch.setattr(torch.cuda.StreamContext, "__enter__", lambda c: entered.append(c.stream))
    current = ["current stream"]
    monkeypatch.setattr(stream_delays, "_resolved", lambda stream: stream or current[0])
    enter = vars(torch.cuda.StreamContext)["__enter__"]

    def into(stream: Any) -> None:
        torch.cuda.StreamContext.__enter__(SimpleNamespace(stream=stream))
        current[0] = stream or current[0]

    with delayed_streams(5):
        into("side")
        assert sleeps == []  # not yet: a capture stream is entered before its capture begins
        torch.ones(2).add_(1)
        torch.ones(2).add_(1)
        current[0] = "current stream"  # the context's exit: back to the step's own stream
        torch.ones(2).add_(1)
        into(None)  # torch's no-op
        into("side")
        into("side")  # current already
        torch.ones(2).add_(1)
    # once per entry, before its first operation; a second entry sleeps again: the work queued
    # there since the first may have run already
    assert sleeps == [("side", 5), ("side", 5)]
    assert entered == ["side", None, "side", "side"]
    assert vars(torch.cuda.StreamContext)["__enter__"] is enter


def test_the_scope_restores_torch_exactly():
    record, depth = vars(torch.cuda.Event)["record"], len(_get_current_dispatch_mode_stack())
    enter = vars(torch.cuda.StreamContext)["__enter__"]
    with delayed_streams(1):
        assert torch.cuda.Event.record is not record
        assert torch.cuda.StreamContext.__enter__ is not enter
        assert len(_get_current_dispatch_mode_stack()) == depth + 1
    assert vars(torch.cuda.Event)["record"] is record
    assert vars(torch.cuda.StreamContext)["__enter__"] is enter
    assert len(_get_current_dispatch_mode_stack()) == depth


def test_the_scope_restores_torch_exactly_when_the_step_raises():
    record, depth = vars(torch.cuda.Event)["record"], len(_get_current_dispatch_mode_stack())
    enter = vars(torch.cuda.StreamContext)["__enter__"]
    with pytest.raises(KeyError), delayed_streams(1):
        raise KeyError("the runner failed")
    assert vars(torch.cuda.Event)["record"] is record
    assert vars(torch.cuda.StreamContext)["__enter__"] is enter
    assert len(_get_current_dispatch_mode_stack()) == depth


def test_nested_scopes_unwind_in_order():
    record = vars(torch.cuda.Event)["record"]
    with delayed_streams(1):
        outer = torch.cuda.Event.record
        with delayed_streams(2):
            assert torch.cuda.Event.record is not outer
        assert torch.cuda.Event.record is outer
    assert vars(torch.cuda.Event)["record"] is record


def test_zero_cycles_is_refused():
    with pytest.raises(ValueError, match="cycles must be >= 1"), delayed_streams(0):
        pass


class _Capturing:
    def __init__(self, capturing: bool) -> None:
        self.capturing, self.streams, self.sleeps = capturing, [], []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        @contextmanager
        def stream(s: Any) -> Any:
            self.streams.append(s)
            yield

        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        monkeypatch.setattr(torch.cuda, "_sleep", self.sleeps.append)


def test_a_sleep_goes_to_the_given_stream_when_it_is_not_capturing(monkeypatch):
    fake = _Capturing(capturing=False)
    fake.install(monkeypatch)
    stream_delays._sleep_on("side stream", 11)
    assert fake.streams == ["side stream"] and fake.sleeps == [11]


def test_nothing_sleeps_on_a_capturing_stream(monkeypatch):
    fake = _Capturing(capturing=True)
    fake.install(monkeypatch)
    stream_delays._Sleeps("delayed_streams", 11, 0).on("capture stream")
    assert fake.sleeps == []  # a sleep there would be recorded into the graph


class _Backend:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.parametrize(
    ("backend", "cycles"), [("cuda", 0), ("sim", 0), ("sim", 1000)], ids=["cuda-0", "sim-0", "sim"]
)
def test_an_undelayed_step_enters_nothing(backend, cycles):
    scope = stressors.delayed_step(_Backend(backend), Stress(delay_cycles=cycles))
    assert isinstance(scope, nullcontext)


def test_a_delayed_cuda_step_delays_every_stream():
    record = vars(torch.cuda.Event)["record"]
    with stressors.delayed_step(_Backend("cuda"), Stress(delay_cycles=1000)):
        assert torch.cuda.Event.record is not record
    assert vars(torch.cuda.Event)["record"] is record


def test_a_cuda_step_delayed_late_compute_delays_its_kernels_and_not_its_copies(sleeps):
    record, replay = vars(torch.cuda.Event)["record"], vars(torch.cuda.CUDAGraph)["replay"]
    depth = len(_get_current_dispatch_mode_stack())
    stress = Stress(delay_cycles=1000, late="compute")
    with stressors.delayed_step(_Backend("cuda"), stress):
        assert sleeps == [(None, 1000)]  # the current stream: the eager kernels queue after it
        assert vars(torch.cuda.Event)["record"] is record
        assert len(_get_current_dispatch_mode_stack()) == depth  # no mode to delay copies
        assert torch.cuda.CUDAGraph.replay is not replay
    assert vars(torch.cuda.CUDAGraph)["replay"] is replay


def test_late_compute_sleeps_on_the_current_stream_on_entry_and_before_each_replay(
    sleeps, monkeypatch
):
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: calls.append(graph))
    with delayed_compute(13):
        assert sleeps == [(None, 13)]  # None: the current stream
        torch.cuda.CUDAGraph.replay("graph")
    torch.cuda.CUDAGraph.replay("after the scope")
    # The second on the stream the graph replays on, the current one, after any host wait
    assert sleeps == [(None, 13), (None, 13)]
    assert calls == ["graph", "after the scope"]


def test_the_compute_scope_restores_torch_exactly_when_the_step_raises(sleeps):
    replay = vars(torch.cuda.CUDAGraph)["replay"]
    with pytest.raises(KeyError), delayed_compute(1):
        assert torch.cuda.CUDAGraph.replay is not replay
        raise KeyError("the runner failed")
    assert vars(torch.cuda.CUDAGraph)["replay"] is replay


def test_zero_cycles_of_late_compute_is_refused(sleeps):
    with pytest.raises(ValueError, match="cycles must be >= 1"), delayed_compute(0):
        pass


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch, sleeps: list[tuple[Any, int]]) -> list[Any]:
    """Every stream the host waits for in a landed-copies scope (streams as in `sleeps`)."""
    made: list[Any] = []
    monkeypatch.setattr(stream_delays, "_wait_for", made.append)
    return made


class _IssuedCopies(TorchDispatchMode):
    """Notes "copy" in `log` as each `aten.copy_` is issued to the modes below it."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.copy_.default:
            self.log.append("copy")
        return func(*args, **(kwargs or {}))


def test_landed_copies_wait_for_each_non_blocking_copy_right_after_it(waits, sleeps, monkeypatch):
    order: list[str] = []
    issued: list[str] = []  # copies as the scope issues them, and its waits
    noted = stream_delays._wait_for  # the `waits` fixture's
    monkeypatch.setattr(
        stream_delays, "_wait_for", lambda stream: issued.append("wait") or noted(stream)
    )
    with FakeTensorMode(), _IssuedCopies(issued):
        device_tensor, host = torch.empty(4, device="cuda"), torch.empty(4)
        # An upload through the operator itself: torch's `Tensor.copy_` from host memory to a
        # cuda tensor wants a cuda build even on fake tensors.
        with landed_copies():
            aten.copy_.default(device_tensor, host, True)
            order.append(f"after the upload: {len(waits)} waited")
            aten.copy_.default(device_tensor, host, non_blocking=True)
            host.copy_(device_tensor, non_blocking=True)
            host.copy_(device_tensor)  # blocking: the host waits anyway
            host.add_(1)
        aten.copy_.default(device_tensor, host, True)  # after the scope
    assert waits == [("current", CUDA)] * 3
    assert order == ["after the upload: 1 waited"]
    assert sleeps == []  # nothing is delayed
    # each wait comes after its copy was issued, none for the blocking one or after the scope
    assert issued == ["copy", "wait", "copy", "wait", "copy", "wait", "copy", "copy"]


def test_landed_copies_wait_for_no_capturing_stream(waits, monkeypatch):
    monkeypatch.setattr(stream_delays, "_capturing", lambda stream: True)
    with FakeTensorMode():
        device_tensor, host = torch.empty(4, device="cuda"), torch.empty(4)
        with landed_copies():
            aten.copy_.default(device_tensor, host, True)  # recorded into the graph
    assert waits == []


def test_the_landed_copies_scope_restores_torch_exactly_when_the_step_raises():
    depth = len(_get_current_dispatch_mode_stack())
    with pytest.raises(KeyError), landed_copies():
        assert len(_get_current_dispatch_mode_stack()) == depth + 1
        raise KeyError("the runner failed")
    assert len(_get_current_dispatch_mode_stack()) == depth


def test_a_cuda_step_with_the_host_late_lands_its_copies_and_sleeps_nowhere(sleeps):
    record = vars(torch.cuda.Event)["record"]
    depth = len(_get_current_dispatch_mode_stack())
    stress = Stress(delay_cycles=1000, late="host", held_stream=1)
    assert not stressors.delays_on(_Backend("cuda"), stress)
    assert stressors.stressed_timing(_Backend("cuda"), stress)
    stressors.delay(_Backend("cuda"), stress)  # before the step: no sleep either
    with stressors.delayed_step(_Backend("cuda"), stress, hold_cycles=10**9):
        assert len(_get_current_dispatch_mode_stack()) == depth + 1
        assert vars(torch.cuda.Event)["record"] is record
    assert sleeps == []
    assert isinstance(stressors.delayed_step(_Backend("sim"), stress), nullcontext)


def test_a_stress_names_what_lands_late():
    with pytest.raises(ValueError, match=r"Stress\.late='kernels'; use one of"):
        Stress(delay_cycles=1, late="kernels")  # type: ignore[arg-type]


def _open_scopes(monkeypatch) -> list[Stress]:
    """The delay scopes open at each moment, innermost last; `stressors.delayed_step` records
    its stress there instead of delaying anything."""
    open_scopes: list[Stress] = []

    @contextmanager
    def scope(backend: Any, stress: Stress, hold_cycles: int = 0, met: Any = None) -> Any:
        open_scopes.append(stress)
        try:
            yield
        finally:
            open_scopes.pop()

    monkeypatch.setattr(stressors, "delayed_step", scope)
    return open_scopes


def _calls(monkeypatch, events) -> list[tuple[str, int, Stress | None]]:
    """(call, twin number, the delay scope open) for every `step`, `update_weights` and `state`
    call on a twin while `events` replay."""
    open_scopes = _open_scopes(monkeypatch)
    calls: list[tuple[str, int, Stress | None]] = []
    made: list[ToyTarget] = []

    class Witness(ToyTarget):
        def _note(self, what: str) -> None:
            calls.append((what, made.index(self), open_scopes[-1] if open_scopes else None))

        def step(self, batch: Batch) -> Any:
            self._note("step")
            return super().step(batch)

        def update_weights(self, seed: int) -> None:
            self._note("update")
            super().update_weights(seed)

        def state(self) -> Any:
            self._note("state")
            return super().state()

    def factory(mode: Any, *, seed: int, backend: str) -> ToyTarget:
        made.append(Witness(mode, seed=seed, backend=backend))
        return made[-1]

    replay(events, factory=factory, backend="sim")
    return calls


def _scopes_of_steps(monkeypatch, events) -> list[tuple[int, Stress | None]]:
    """(twin number, the delay scope open during its step) for every twin step `events` run."""
    return [(twin, scope) for what, twin, scope in _calls(monkeypatch, events) if what == "step"]


def test_only_the_graph_twins_step_runs_in_the_delay_scope(monkeypatch):
    stress = Stress(delay_cycles=1000)
    steps = _scopes_of_steps(monkeypatch, [stress, Batch((Request(0, (1, 2), 0, (1,)),))])
    # The lockstep driver makes the graph twin first.
    assert [scope for twin, scope in steps if twin == 0] == [stress]
    assert {1, 2} <= {twin for twin, _ in steps}  # the eager and clean twins stepped too
    assert all(scope is None for twin, scope in steps if twin != 0)


@pytest.mark.parametrize("late", ["copies", "compute", "host"])
def test_both_steps_of_a_delayed_pair_make_the_same_work_late(monkeypatch, late):
    # With late compute the first step's replay is what the second step's upload must not
    # overtake: a pair whose first step made its copies late instead would hide that race.
    pair = Stress(pipelined=True, delay_cycles=1000, late=late)
    prefill = Batch((Request(0, (1, 2), 0, (1,)),))
    first, second = (Batch((Request(0, (t,), n, (1,)),)) for t, n in ((3, 2), (4, 3)))
    steps = _scopes_of_steps(monkeypatch, [prefill, first, pair, second])
    graph = [scope for twin, scope in steps if twin == 0]
    assert [(s.delay_cycles, s.late) for s in graph if s is not None] == [
        (0, "copies"),  # the prefill, undelayed
        (1000, late),
        (1000, late),
    ]


UNGUARDED_UNTIL_COMPILING = """
import json, sys
import torch
from pytest_graphmode.runtime.backends import guarded_mode
from pytest_graphmode.strategies import stream_delays

with stream_delays.delayed_streams(5):
    first = torch.ones(3).add_(1).tolist()
imported = "torch._dynamo" in sys.modules
import torch._dynamo

guarded = []
unseen = guarded_mode._dispatch_unseen_by_compiler
guarded_mode._dispatch_unseen_by_compiler = lambda *args: guarded.append(1) or unseen(*args)
with stream_delays.delayed_streams(5):
    then = torch.ones(3).add_(2).tolist()
print(json.dumps([imported, first, bool(guarded), then]))
"""


def test_the_delay_mode_imports_no_compiler_stack_and_is_guarded_once_one_is_imported():
    # torch's guard on a mode imports torch._dynamo at its first call: about a second of a cuda
    # campaign that compiles nothing. Once imported (something may be compiling), it guards.
    done = subprocess.run(
        [sys.executable, "-c", UNGUARDED_UNTIL_COMPILING],
        cwd=Path(__file__).parents[2], capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    imported, first, guarded, then = json.loads(done.stdout.splitlines()[-1])
    assert not imported and first == [2.0] * 3
    assert guarded and then == [3.0] * 3


def test_a_runner_compiled_with_fullgraph_runs_under_the_delays():
    # The mode was traced into, and its guard against the compiler broke the graph: every
    # `torch.compile(fullgraph=True)` runner failed on cuda under delayed copies.
    compiled = torch.compile(lambda x: (x.sin() + 1).to(torch.float64) * 2, fullgraph=True,
                             backend="eager")  # fmt: skip
    x = torch.linspace(0, 1, 5)
    with delayed_streams(5):
        out = compiled(x)
    assert torch.equal(out, (x.sin() + 1).to(torch.float64) * 2)


def test_the_graph_twins_weight_update_runs_right_before_its_step_in_its_scope(monkeypatch):
    # Between the two the harness reads nothing of the twin (a snapshot waits for the device on
    # cuda): a load the step does not wait for must still be in flight when the step reads.
    update = Stress(weight_seed=3, delay_cycles=1000)
    prefill, decode = Batch((Request(0, (1, 2), 0, (1,)),)), Batch((Request(0, (3,), 2, (1,)),))
    calls = _calls(monkeypatch, [prefill, update, decode])
    graph = [(what, scope) for what, twin, scope in calls if twin == 0 and what != "state"]
    assert graph[-2:] == [("update", update), ("step", update)]
    at = calls.index(("update", 0, update))
    assert calls[at + 1] == ("step", 0, update)  # nothing read of any twin in between
    references = [(twin, scope) for what, twin, scope in calls[:at] if what == "update"]
    assert {twin for twin, _ in references} >= {1, 2} and all(s is None for _, s in references)


class _Held:
    """Stands in for the event recorded after a long sleep: `done` says whether it passed."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.fixture
def held(sleeps, monkeypatch: pytest.MonkeyPatch) -> list[_Held]:
    """The events marking the end of each long sleep, in order."""
    marks: list[_Held] = []

    def passed(stream: Any) -> _Held:
        marks.append(_Held())
        return marks[-1]

    monkeypatch.setattr(stream_delays, "_passed", passed)
    return marks


def test_a_hold_sleeps_long_once_per_stream_while_that_sleep_holds_it_back(
    sleeps, held, monkeypatch
):
    monkeypatch.setattr(torch.cuda.Event, "record", lambda event, stream=None: None)
    with FakeTensorMode():
        device_tensor, host = torch.empty(4, device="cuda"), torch.empty(4)
        with delayed_streams(7, hold_cycles=700):
            host.copy_(device_tensor, non_blocking=True)
            host.copy_(device_tensor, non_blocking=True)  # queued behind the long sleep
            torch.cuda.Event.record("event", "copy stream")  # another stream: long too
            held[0].done = True  # the host waited for the current stream: held back no more
            host.copy_(device_tensor, non_blocking=True)
    current = ("current", CUDA)
    assert sleeps == [(current, 700), (current, 7), ("copy stream", 700), (current, 700)]


def test_late_compute_holds_its_stream_back_on_entry_and_again_once_it_caught_up(
    sleeps, held, monkeypatch
):
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: None)
    with delayed_compute(13, hold_cycles=1300):
        torch.cuda.CUDAGraph.replay("graph")
        held[0].done = True
        torch.cuda.CUDAGraph.replay("graph")
    assert sleeps == [(None, 1300), (None, 13), (None, 1300)]


def test_a_hold_shorter_than_the_delay_is_the_delay(sleeps):
    with delayed_compute(13, hold_cycles=5):
        pass
    assert sleeps == [(None, 13)]


def test_a_negative_hold_is_refused():
    with pytest.raises(ValueError, match="hold_cycles must be >= 0"), delayed_streams(1, -1):
        pass


def test_a_held_stream_is_the_only_one_that_sleeps(sleeps, held, monkeypatch):
    monkeypatch.setattr(torch.cuda.Event, "record", lambda event, stream=None: None)
    with FakeTensorMode():
        device_tensor, host = torch.empty(4, device="cuda"), torch.empty(4)
        with delayed_streams(7, hold_cycles=700, held_stream=1):
            host.copy_(device_tensor, non_blocking=True)  # the step's stream 0
            torch.cuda.Event.record("event", "copy stream")  # stream 1: held back
            host.copy_(device_tensor, non_blocking=True)
            torch.cuda.Event.record("event", "copy stream")  # queued behind the long sleep
            torch.cuda.Event.record("event", "output stream")  # stream 2
    assert sleeps == [("copy stream", 700), ("copy stream", 7)]


def test_a_held_stream_the_step_never_reaches_delays_nothing(sleeps, held, monkeypatch):
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: None)
    with delayed_compute(13, hold_cycles=1300, held_stream=1):
        torch.cuda.CUDAGraph.replay("graph")
    assert sleeps == []


def test_a_held_stream_past_the_streams_earlier_steps_met_is_taken_modulo_their_count(
    sleeps, held, monkeypatch
):
    # One stream, as a runner that queues everything on its current stream: the held streams 1
    # and 2 a schedule draws would otherwise hold back nothing.
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: None)
    met = StreamsMet()
    with delayed_compute(13, held_stream=1, met=met):
        torch.cuda.CUDAGraph.replay("graph")  # the first step: nothing met yet, nothing held
    assert sleeps == [] and met.most == 1
    with delayed_compute(13, held_stream=1, met=met):
        torch.cuda.CUDAGraph.replay("graph")
    assert sleeps == [(None, 13), (None, 13)]


def test_a_step_meeting_more_streams_counts_them_and_keeps_earlier_places(
    sleeps, held, monkeypatch
):
    monkeypatch.setattr(torch.cuda.Event, "record", lambda event, stream=None: None)
    met = StreamsMet()
    with FakeTensorMode():
        device_tensor, host = torch.empty(4, device="cuda"), torch.empty(4)
        with delayed_streams(7, held_stream=0, met=met):
            host.copy_(device_tensor, non_blocking=True)
            torch.cuda.Event.record("event", "copy stream")
        assert met.most == 2
        with delayed_streams(7, held_stream=1, met=met):  # below the count: as given
            host.copy_(device_tensor, non_blocking=True)
            torch.cuda.Event.record("event", "copy stream")
            torch.cuda.Event.record("event", "output stream")
        assert met.most == 3
        with delayed_streams(7, held_stream=4, met=met):  # 4 modulo 3: the copy stream
            host.copy_(device_tensor, non_blocking=True)
            torch.cuda.Event.record("event", "copy stream")
    current = ("current", CUDA)
    assert sleeps == [(current, 7), ("copy stream", 7), ("copy stream", 7)]


def test_the_streams_a_step_met_are_counted_when_it_raises(sleeps, held):
    met = StreamsMet()
    with pytest.raises(RuntimeError, match="step failed"), delayed_compute(13, met=met):
        raise RuntimeError("step failed")
    assert met.most == 1


def test_the_graph_twins_delayed_steps_of_one_phase_share_one_count_of_streams(monkeypatch):
    mets: list[Any] = []

    @contextmanager
    def scope(backend: Any, stress: Stress, hold_cycles: int = 0, met: Any = None) -> Any:
        mets.append(met)
        yield

    monkeypatch.setattr(stressors, "delayed_step", scope)
    prefill = Batch((Request(0, (1, 2), 0, (1,)),))
    decodes = [Batch((Request(0, (t,), n, (1,)),)) for t, n in ((3, 2), (4, 3))]
    replay([prefill, Stress(delay_cycles=1000), *decodes], factory=ToyTarget, backend="sim")
    assert len(mets) == 3 and all(isinstance(met, StreamsMet) for met in mets)
    assert mets[1] is mets[2] and mets[0] is not mets[1]  # the decodes' count, the prefill's


def test_a_held_stream_without_a_hold_sleeps_the_delay(sleeps, held):
    with delayed_compute(13, held_stream=0):
        pass
    assert sleeps == [(None, 13)]


def test_a_negative_held_stream_is_refused():
    with pytest.raises(ValueError, match="held_stream must be >= 0"), delayed_streams(1, 0, -1):
        pass
    with pytest.raises(ValueError, match="held_stream=-1 must be >= 0"):
        Stress(delay_cycles=1, held_stream=-1)


def test_a_held_back_stream_that_captures_is_neither_asked_nor_delayed(sleeps, held, monkeypatch):
    monkeypatch.setattr(torch.cuda.Event, "record", lambda event, stream=None: None)
    capturing: set[str] = set()
    monkeypatch.setattr(stream_delays, "_capturing", lambda stream: stream in capturing)

    def query() -> bool:
        raise AssertionError("an event queried while a stream captures ends the capture")

    with delayed_streams(7, hold_cycles=700):
        torch.cuda.Event.record("event", "main stream")  # held back before the capture
        held[0].query = query
        capturing.add("main stream")
        torch.cuda.Event.record("event", "main stream")
    assert sleeps == [("main stream", 700)]


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.cuda.CUDAGraph.capture_begin` and `capture_end` that do nothing (a CPU build has
    no capture to begin); a scope entered afterwards counts the calls to them."""
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda graph, *a, **k: None)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", lambda graph: None)


def test_a_held_back_side_stream_is_neither_asked_nor_delayed_while_a_capture_is_underway(
    sleeps, held, captures, monkeypatch
):
    # The side stream does not capture; asking its event in torch's default (global) capture
    # mode would end the capture on the other stream all the same.
    monkeypatch.setattr(torch.cuda.Event, "record", lambda event, stream=None: None)

    def query() -> bool:
        raise AssertionError("an event queried during a global capture ends the capture")

    with delayed_streams(7, hold_cycles=700):
        torch.cuda.Event.record("event", "side stream")  # held back before the capture
        held[0].query = query
        torch.cuda.CUDAGraph.capture_begin("graph")
        torch.cuda.Event.record("event", "side stream")
        torch.cuda.CUDAGraph.capture_end("graph")
        held[0].query = lambda: True  # the long sleep has passed
        torch.cuda.Event.record("event", "side stream")
    assert sleeps == [("side stream", 700), ("side stream", 700)]


def test_late_compute_sleeps_before_no_replay_while_a_capture_is_underway(
    sleeps, captures, monkeypatch
):
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: None)
    with delayed_compute(13):
        torch.cuda.CUDAGraph.capture_begin("graph")
        torch.cuda.CUDAGraph.replay("another graph")  # replayed into the capture
        torch.cuda.CUDAGraph.capture_end("graph")
        torch.cuda.CUDAGraph.replay("another graph")
    assert sleeps == [(None, 13), (None, 13)]  # the step's own, on entry, and the last replay


def test_landed_copies_wait_for_no_stream_while_a_capture_is_underway(waits, captures):
    with FakeTensorMode():
        device_tensor, host = torch.empty(4, device="cuda"), torch.empty(4)
        with landed_copies():
            torch.cuda.CUDAGraph.capture_begin("graph")
            aten.copy_.default(device_tensor, host, True)  # on a stream that is not capturing
            torch.cuda.CUDAGraph.capture_end("graph")
            aten.copy_.default(device_tensor, host, True)
    assert waits == [("current", CUDA)]  # only the copy after the capture ended


def test_a_capture_that_fails_to_begin_is_not_counted(waits, monkeypatch):
    def refused(graph: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("capture refused")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", refused)
    with FakeTensorMode():
        device_tensor, host = torch.empty(4, device="cuda"), torch.empty(4)
        with landed_copies():
            with pytest.raises(RuntimeError, match="capture refused"):
                torch.cuda.CUDAGraph.capture_begin("graph")
            aten.copy_.default(device_tensor, host, True)
    assert waits == [("current", CUDA)]


def test_the_capture_counters_are_put_back_when_the_step_raises(sleeps):
    begin = vars(torch.cuda.CUDAGraph).get("capture_begin")
    end = vars(torch.cuda.CUDAGraph).get("capture_end")
    for scope in (landed_copies(), delayed_streams(1), delayed_compute(1)):
        with pytest.raises(KeyError), scope:
            assert torch.cuda.CUDAGraph.capture_begin is not begin
            raise KeyError("the runner failed")
        assert vars(torch.cuda.CUDAGraph).get("capture_begin") is begin
        assert vars(torch.cuda.CUDAGraph).get("capture_end") is end
