"""Operations that cannot be captured raise CaptureError and leave the backend usable."""

import pytest
import torch

from tests.conformance.case import another_stream


def _item(be, x):
    return x.sum().item()


def _tolist(be, x):
    return x.tolist()


def _bool(be, x):
    return bool(x[0] > 0)


def _nonzero(be, x):
    return torch.nonzero(x)


def _synchronize(be, x):
    be.synchronize()


@pytest.mark.parametrize("illegal", [_item, _tolist, _bool, _nonzero, _synchronize])
def test_illegal_op_in_capture_raises_capture_error(be, illegal):
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with pytest.raises(be.CaptureError), be.graph(g):
        y = x * 2
        illegal(be, y)
    with pytest.raises(RuntimeError):
        g.replay()


@pytest.mark.parametrize("illegal", [_item, _nonzero, _synchronize])
def test_backend_keeps_working_after_a_failed_capture(be, illegal):
    x = torch.ones(4, device=be.device)
    with pytest.raises(be.CaptureError), be.graph(be.Graph()):
        illegal(be, x * 2)
    if be.name == "cuda":
        # The allocator must know the capture is over: if it still routed allocations to the
        # failed graph's pool, emptying its cache would abort the process.
        torch.cuda.empty_cache()
    g = be.Graph()
    with be.graph(g):
        y = x + 1
    g.replay()
    be.synchronize()
    assert torch.equal(y, torch.full((4,), 2.0, device=be.device))


def test_sim_capture_error_names_the_op(sim):
    x = torch.ones(4, device=sim.device)
    with pytest.raises(sim.CaptureError, match="nonzero"), sim.graph(sim.Graph()):
        torch.nonzero(x)


def test_sim_capture_on_default_stream_is_refused(sim):
    g = sim.Graph()
    with pytest.raises(sim.CaptureError, match="non-default stream"):
        g.capture_begin()


def _event_query(be, x):
    done = be.Event()
    done.record()
    done.query()


@pytest.mark.parametrize("illegal", [_item, _nonzero, _synchronize, _event_query])
def test_failed_capture_restores_the_current_stream(be, illegal):
    """Eager work after a failed capture must not silently run on the capture stream."""
    before = be.current_stream()
    x = torch.ones(4, device=be.device)
    with pytest.raises(be.CaptureError), be.graph(be.Graph()):
        illegal(be, x * 2)
    assert be.current_stream() == before


def test_capture_failing_at_its_end_restores_the_current_stream(be):
    before = be.current_stream()
    x = torch.ones(4, device=be.device)
    with pytest.raises(be.CaptureError), be.graph(be.Graph()):
        side = another_stream(be)
        side.wait_stream(be.current_stream())
        with be.stream(side):
            x.mul(2)  # forked and never joined back: capture_end fails
    assert be.current_stream() == before


def test_capture_on_the_default_stream_raises_capture_error(be):
    """One promise on both backends: a CaptureError, which is also a RuntimeError."""
    before = be.current_stream()
    with pytest.raises(be.CaptureError), be.graph(be.Graph(), stream=be.default_stream()):
        pass
    assert issubclass(be.CaptureError, RuntimeError)
    assert be.current_stream() == before
