"""Which host operations race a copy in flight (runtime/backends/cuda_races.py), judged on the CPU:
the copies are noted with a stand-in for their event, the host operations are ATen's own."""

from __future__ import annotations

import pytest
import torch

from pytest_graphmode.runtime.backends.cuda_races import InflightCopies
from pytest_graphmode.runtime.backends.footprint import issuing

aten = torch.ops.aten


class _Completion:
    """A copy's event: not done until the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _noted(upload: bool) -> tuple[InflightCopies, torch.Tensor, _Completion]:
    inflight, host, completion = InflightCopies(), torch.zeros(8), _Completion()
    inflight.note(host[:4], upload, completion, "aten.copy_ (non-blocking)", "stream #3")
    return inflight, host, completion


def test_a_host_write_into_an_uploads_bytes_is_a_race_naming_both_sides():
    inflight, host, _ = _noted(upload=True)
    inflight.host_operation(aten.fill_.Scalar, (host[2:6], 1.0), {})
    (race,) = inflight.take()
    assert race.byte_range == (8, 16)
    assert (race.earlier.op, race.earlier.stream, race.earlier.access) == (
        "aten.copy_ (non-blocking)",
        "stream #3",
        "read",
    )
    assert (race.later.op, race.later.stream, race.later.access) == (
        "aten.fill_",
        "the host",
        "write",
    )
    assert race.later.line.startswith("tests/backends/test_inflight_copies.py:")


def test_each_side_names_the_step_it_was_issued_in():
    inflight, host, completion = InflightCopies(), torch.zeros(8), _Completion()
    with issuing("step 6, the first of a pipelined pair"):
        inflight.note(host[:4], True, completion, "aten.copy_ (non-blocking)", "stream #3")
    with issuing("step 7, the second of a pipelined pair"):
        inflight.host_operation(aten.fill_.Scalar, (host, 1.0), {})
    (race,) = inflight.take()
    assert race.earlier.line.startswith("tests/backends/test_inflight_copies.py:")
    assert race.earlier.line.endswith(", in step 6, the first of a pipelined pair")
    assert race.later.line.endswith(", in step 7, the second of a pipelined pair")


@pytest.mark.parametrize(
    ("upload", "operation", "races"),
    [
        (True, "read", False),  # the upload reads the bytes too
        (False, "read", True),  # the download has not written them yet
        (False, "write", True),  # the download lands over the host's write
        (True, "write of other bytes", False),
        (True, "write to another buffer", False),
    ],
)
def test_what_races_a_copy_in_flight(upload, operation, races):
    inflight, host, _ = _noted(upload)
    if operation == "read":
        inflight.host_operation(aten.sum.default, (host[1:3],), {})
    elif operation == "write":
        inflight.host_operation(aten.copy_.default, (host[3:5], torch.ones(2)), {})
    elif operation == "write of other bytes":
        inflight.host_operation(aten.fill_.Scalar, (host[4:],), {"value": 1.0})
    else:
        inflight.host_operation(aten.fill_.Scalar, (torch.zeros(8), 1.0), {})
    assert bool(inflight.take()) == races


def test_an_argument_written_by_name_is_a_write():
    inflight, host, _ = _noted(upload=True)
    inflight.host_operation(aten.add.out, (torch.ones(4), torch.ones(4)), {"out": host[:4]})
    (race,) = inflight.take()
    assert race.later.access == "write"


@pytest.mark.parametrize(
    "operation",
    [
        (aten.slice.Tensor, (0, 0, 2)),  # a view: no bytes touched
        (aten.empty_like.default, ()),  # an allocation shaped like it
        (aten.is_pinned.default, ()),  # a question about its memory
    ],
)
def test_operations_that_touch_no_bytes_race_nothing(operation):
    inflight, host, _ = _noted(upload=False)
    func, rest = operation
    inflight.host_operation(func, (host, *rest), {})
    assert inflight.take() == []


def test_an_operation_on_a_device_tensor_runs_in_stream_order_and_races_nothing():
    inflight, host, _ = _noted(upload=False)
    device = torch.zeros(4, device="meta")  # any tensor not in host memory
    inflight.host_operation(aten.copy_.default, (device, host[:4]), {})
    assert inflight.take() == []


def test_a_completed_copy_races_nothing_and_is_forgotten():
    inflight, host, completion = _noted(upload=True)
    completion.done = True
    inflight.host_operation(aten.fill_.Scalar, (host, 1.0), {})
    assert inflight.take() == []
    assert not inflight.pending


def test_one_pair_of_lines_once_until_taken_then_again():
    # a failing example replayed in the same process (shrinking) must fail again
    inflight, host, _ = _noted(upload=True)

    def write() -> None:  # one line of the program, met again and again
        inflight.host_operation(aten.fill_.Scalar, (host, 1.0), {})

    for _ in range(3):
        write()
    assert len(inflight.take()) == 1
    write()
    assert len(inflight.take()) == 1


def test_nothing_is_asked_of_the_device_while_a_capture_is_underway():
    inflight, host, completion = _noted(upload=True)
    queries = []
    completion.query = lambda: queries.append(1) or False  # type: ignore[method-assign]
    inflight.host_operation(aten.fill_.Scalar, (host, 1.0), {}, lambda: True)
    assert queries == []
    assert inflight.take() == []  # taken once the capture is over: then asked


def test_whether_a_capture_is_underway_is_asked_only_of_a_host_operation():
    inflight, host, _ = _noted(upload=False)

    def asked() -> bool:
        raise AssertionError("asked for an operation that runs in stream order")

    device = torch.zeros(4, device="meta")
    inflight.host_operation(aten.add_.Tensor, (device, device), {}, asked)
    inflight.host_operation(aten.slice.Tensor, (host, 0, 0, 2), {}, asked)
    assert inflight.take() == []


# -- writes the dispatcher does not show (a numpy view of the pinned buffer) ---------------------


def _numpy_write(host: torch.Tensor, at: int, value: float) -> None:
    host.numpy()[at] = value  # no ATen operation: only the bytes tell


def test_a_numpy_write_into_an_upload_in_flight_is_found_by_its_bytes_at_the_next_copy():
    inflight, host, _ = _noted(upload=True)
    _numpy_write(host, 1, 5.0)
    inflight.note(torch.zeros(2), True, _Completion(), "aten.copy_ (non-blocking)", "stream #3")
    (race,) = inflight.take()
    assert race.later.op == "a numpy view or another path torch does not see"
    assert (race.later.stream, race.later.access) == ("the host", "write")
    assert "the changed bytes were found at tests/backends/test_inflight_copies.py:" in (
        race.later.line
    )
    assert race.byte_range == (4, 8) and race.earlier.access == "read"  # the changed bytes


def test_a_numpy_write_is_found_at_the_next_host_operation_or_when_the_races_are_taken():
    inflight, host, _ = _noted(upload=True)
    _numpy_write(host, 0, 5.0)
    inflight.host_operation(aten.add.Tensor, (torch.ones(2), torch.ones(2)), {})
    assert len(inflight.take()) == 1
    inflight, host, _ = _noted(upload=True)
    _numpy_write(host, 3, 5.0)
    (race,) = inflight.take()
    assert "found at the end of the step" in race.later.line


def test_a_change_seen_only_once_the_upload_completed_is_no_race():
    # it may have been made after the copy read the bytes
    inflight, host, completion = _noted(upload=True)
    _numpy_write(host, 1, 5.0)
    completion.done = True
    assert inflight.take() == []


def test_a_numpy_write_past_the_uploads_bytes_or_between_its_elements_is_no_race():
    inflight, host, _ = _noted(upload=True)  # host[:4]
    _numpy_write(host, 6, 5.0)
    strided = torch.zeros(8)
    inflight.note(strided[::2], True, _Completion(), "aten.copy_ (non-blocking)", "stream #3")
    _numpy_write(strided, 1, 5.0)  # a byte of the span that is none of the upload's
    assert inflight.take() == []


def test_a_download_landing_in_an_uploads_bytes_is_no_host_write():
    inflight, host, _ = _noted(upload=True)
    inflight.note(host[2:4], False, _Completion(), "aten.copy_ (non-blocking)", "stream #4")
    _numpy_write(host, 2, 5.0)  # as the download's landing would
    assert inflight.take() == []


def test_an_upload_of_bytes_a_download_is_still_landing_in_is_not_watched():
    # queued on one stream, the download lands first and the upload reads what it brought
    inflight, host, completion = _noted(upload=False)
    inflight.note(host[:4], True, _Completion(), "aten.copy_ (non-blocking)", "stream #3")
    _numpy_write(host, 2, 5.0)  # as the download's landing would
    assert inflight.take() == []
    completion.done = True  # landed: an upload noted now is watched
    inflight.note(host[:4], True, _Completion(), "aten.copy_ (non-blocking)", "stream #3")
    _numpy_write(host, 2, 6.0)
    assert len(inflight.take()) == 1


def test_a_dispatched_write_is_one_race_not_two():
    inflight, host, _ = _noted(upload=True)
    inflight.host_operation(aten.fill_.Scalar, (host, 1.0), {})
    host.fill_(1.0)  # what the operation then does to the bytes
    (race,) = inflight.take()
    assert race.later.op == "aten.fill_"


def test_a_blocking_download_into_an_uploads_bytes_on_another_stream_is_a_race_named_as_such():
    inflight, host, _ = _noted(upload=True)  # host[:4], stream #3
    inflight.blocking_copy(host[2:6], False, "aten.copy_", "stream #5")
    _numpy_write(host, 2, 5.0)  # what the download then does to the bytes
    (race,) = inflight.take()  # the change is this race's, not a write unseen
    assert race.later.op == "aten.copy_ (blocking, device to host, on stream #5)"
    assert (race.later.stream, race.later.access) == ("the host", "write")
    assert race.later.line.startswith("tests/backends/test_inflight_copies.py:")
    assert race.byte_range == (8, 16)


def test_a_blocking_copy_on_the_copys_own_stream_comes_after_it_and_races_nothing():
    inflight, host, _ = _noted(upload=True)  # stream #3
    inflight.blocking_copy(host[:4], False, "aten.copy_", "stream #3")
    _numpy_write(host, 1, 5.0)  # the download, landed after the upload read the bytes
    assert inflight.take() == []


def test_a_blocking_upload_races_a_download_in_flight_into_its_bytes_not_an_upload():
    inflight, host, _ = _noted(upload=False)  # a download into host[:4], stream #3
    inflight.blocking_copy(host[1:2], True, "aten.copy_", "the default stream")
    (race,) = inflight.take()
    assert (race.earlier.access, race.later.access) == ("write", "read")
    assert race.later.op == "aten.copy_ (blocking, host to device, on the default stream)"
    inflight, host, _ = _noted(upload=True)  # both read the bytes
    inflight.blocking_copy(host[1:2], True, "aten.copy_", "the default stream")
    assert inflight.take() == []


def test_a_blocking_copy_after_the_copy_completed_races_nothing():
    inflight, host, completion = _noted(upload=True)
    completion.done = True
    inflight.blocking_copy(host, False, "aten.copy_", "stream #5")
    assert inflight.take() == []
