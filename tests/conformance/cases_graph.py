"""The Graph object: capture once, replay, reset, and what a failed capture leaves behind."""

from __future__ import annotations

from typing import Any

import torch

from tests.conformance.case import case, value


@case("raises RuntimeError")
def replay_before_any_capture(be: Any) -> str:
    be.Graph().replay()
    return "replayed"


@case("raises RuntimeError")
def replay_after_reset(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        x * 2
    g.replay()
    be.synchronize()
    g.reset()
    g.replay()
    return "replayed"


@case("value=[3.0, 3.0, 3.0, 3.0]")
def capture_again_after_reset(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        x * 2
    g.replay()
    be.synchronize()
    g.reset()
    with be.graph(g):
        y = x * 3
    g.replay()
    return value(be, y)


@case("refused")
def capture_twice_into_one_graph(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        x * 2
    try:
        with be.graph(g):
            x * 3
    except RuntimeError:
        return "refused"
    return "captured"


@case("value=[2.0, 2.0, 2.0, 2.0]")
def capture_begin_and_end_by_hand(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    side = be.Stream()
    be.synchronize()
    with be.stream(side):
        g.capture_begin()
        try:
            y = x * 2
        finally:
            g.capture_end()
    g.replay()
    return value(be, y)


@case("raises RuntimeError")
def failed_capture_leaves_nothing_to_replay(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    try:
        with be.graph(g):
            (x * 2).sum().item()
    except be.CaptureError:
        pass
    g.replay()
    return "replayed"


@case("value=[5.0, 5.0, 5.0, 5.0]")
def capturing_works_after_a_failed_capture(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    try:
        with be.graph(be.Graph()):
            torch.nonzero(x)
    except be.CaptureError:
        pass
    g = be.Graph()
    with be.graph(g):
        y = x * 5
    g.replay()
    return value(be, y)


@case("default stream")
def current_stream_restored_after_a_failed_capture(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    try:
        with be.graph(be.Graph()):
            (x * 2).sum().item()
    except be.CaptureError:
        pass
    return "default stream" if be.current_stream() == be.default_stream() else "capture stream"


@case("default stream")
def current_stream_restored_after_a_capture(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    with be.graph(be.Graph()):
        x * 2
    return "default stream" if be.current_stream() == be.default_stream() else "capture stream"
