"""Capture-time rules CUDA enforces, raised as CaptureError on every backend."""

import pytest
import torch

from tests.conformance.case import another_stream


def test_manual_seed_with_another_seed_during_capture_raises(be):
    seed = torch.initial_seed()
    x = torch.ones(4, device=be.device)
    with pytest.raises(be.CaptureError, match="seed"), be.graph(be.Graph()):
        y = x * 2
        torch.manual_seed(seed + 1)
        y.add_(1)
    torch.manual_seed(seed)


def test_manual_seed_with_the_same_seed_during_capture_is_allowed(be):
    torch.manual_seed(1234)
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        torch.manual_seed(1234)
        y = x * 2
    g.replay()
    be.synchronize()
    assert torch.equal(y, torch.full((4,), 2.0, device=be.device))


def test_waiting_on_an_event_recorded_before_the_capture_raises(be):
    x = torch.ones(4, device=be.device)
    before = be.Event()
    before.record()
    be.synchronize()  # even a completed event: it is not part of the capture
    with pytest.raises(be.CaptureError), be.graph(be.Graph()):
        y = x * 2
        be.current_stream().wait_event(before)
        y.add_(1)


def test_allocating_on_a_stream_outside_the_capture_raises(be):
    x = torch.ones(1 << 20, device=be.device)
    with pytest.raises(be.CaptureError), be.graph(be.Graph()):
        y = x * 2
        with be.stream(another_stream(be)):
            # a fresh allocation the caching allocator cannot serve from its cache
            torch.empty(64 << 20, dtype=torch.uint8, device=be.device).fill_(1)
        y.add_(1)
    g = be.Graph()
    with be.graph(g):
        y = x + 1
    g.replay()
    be.synchronize()
    assert torch.equal(y[:4], torch.full((4,), 2.0, device=be.device))


def test_capturing_twice_into_one_graph_raises_until_reset(be):
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 2
    with pytest.raises(be.CaptureError), be.graph(g):
        y = x * 3
    g.reset()
    with be.graph(g):
        y = x * 3
    g.replay()
    be.synchronize()
    assert torch.equal(y, torch.full((4,), 3.0, device=be.device))


def test_raw_capture_begin_on_the_default_stream_raises_a_runtime_error(be):
    """Raw capture_begin on the default stream: RuntimeError on both (CaptureError is one)."""
    g = be.Graph()
    with be.stream(be.default_stream()), pytest.raises(RuntimeError):
        g.capture_begin()
