"""What a replay sees: memory, not Python names; host values as they were at capture."""

from __future__ import annotations

from typing import Any

import torch

from tests.conformance.case import case, value


@case("value=[2.0, 2.0, 2.0, 2.0]")
def capture_records_and_does_not_compute(be: Any) -> str:
    buf = torch.zeros(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        buf.add_(1)
    before = buf.clone()
    g.replay()
    g.replay()
    be.synchronize()
    return value(be, buf) if not before.any() else "computed at capture"


@case("ran once")
def python_in_the_capture_region_runs_once(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    runs = []
    g = be.Graph()
    with be.graph(g):
        runs.append(1)
        x * 2
    for _ in range(3):
        g.replay()
    be.synchronize()  # the replays are asynchronous: x must outlive them
    return "ran once" if len(runs) == 1 else f"ran {len(runs)} times"


@case("value=[0.0, 3.0, 6.0, 9.0]")
def input_updated_in_place(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * 3
    x.copy_(torch.arange(4.0, device=be.device))
    g.replay()
    return value(be, y)


@case("value=[5.0, 5.0, 0.0, 0.0]")
def view_of_an_input_written_in_place(be: Any) -> str:
    x = torch.zeros(4, device=be.device)
    head = x[:2]
    g = be.Graph()
    with be.graph(g):
        y = x + 0
    head.fill_(5.0)
    g.replay()
    return value(be, y)


@case("stale")
def input_name_rebound(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    captured = x  # the graph holds the address, not the name: keep the memory alive
    g = be.Graph()
    with be.graph(g):
        y = x * 3
    x = torch.full((4,), 7.0, device=be.device)
    g.replay()
    be.synchronize()
    return "stale" if bool((y == captured * 3).all()) else "new value"


@case("value=[2.0, 2.0, 2.0, 2.0]")
def python_float_is_baked_at_capture(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    scale = 2.0
    g = be.Graph()
    with be.graph(g):
        y = x * scale
    scale = 5.0
    g.replay()
    return value(be, y)


@case("value=[2.0, 2.0, 2.0, 2.0]")
def fill_value_is_baked_at_capture(be: Any) -> str:
    buf = torch.zeros(4, device=be.device)
    fill = 2.0
    g = be.Graph()
    with be.graph(g):
        buf.fill_(fill)
    fill = 9.0
    buf.zero_()
    g.replay()
    return value(be, buf)


@case("value=[20.0, 22.0]")
def python_int_shape_is_frozen(be: Any) -> str:
    x = torch.arange(4.0, device=be.device)
    rows = 2
    g = be.Graph()
    with be.graph(g):
        y = x[:rows] * 2
    rows = 4
    x.add_(10)
    g.replay()
    return value(be, y)


@case("value=[2.0, 2.0, 2.0, 2.0]")
def host_scalar_tensor_is_baked_at_capture(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    scale = torch.tensor(2.0)  # 0-dim host tensor: a kernel argument on CUDA
    g = be.Graph()
    with be.graph(g):
        y = x * scale
    scale.fill_(5.0)
    g.replay()
    return value(be, y)


@case("value=[5.0, 5.0, 5.0, 5.0]")
def device_scalar_tensor_is_read_at_replay(be: Any) -> str:
    x = torch.ones(4, device=be.device)
    scale = torch.tensor(2.0, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = x * scale
    scale.fill_(5.0)
    g.replay()
    return value(be, y)


@case("value=[6.0, 6.0]")
def weight_updated_in_place(be: Any) -> str:
    weight = torch.ones(3, 2, device=be.device)
    x = torch.ones(1, 3, device=be.device)
    x @ weight  # warm-up: the first matmul creates the cuBLAS handle, which a capture cannot
    g = be.Graph()
    with be.graph(g):
        y = x @ weight
    weight.copy_(torch.full((3, 2), 2.0, device=be.device))
    g.replay()
    return value(be, y)


@case("value=[3.0, 3.0]")
def weight_rebound_while_the_old_one_lives(be: Any) -> str:
    layer = {"weight": torch.ones(3, 2, device=be.device)}
    old = layer["weight"]
    x = torch.ones(1, 3, device=be.device)
    x @ old  # warm-up: the first matmul creates the cuBLAS handle, which a capture cannot
    g = be.Graph()
    with be.graph(g):
        y = x @ layer["weight"]
    layer["weight"] = torch.full((3, 2), 2.0, device=be.device)
    g.replay()
    out = value(be, y)
    del old
    return out


@case("value=[3.0, 3.0, 3.0, 3.0]")
def in_place_updates_accumulate_per_replay(be: Any) -> str:
    counter = torch.zeros(4, device=be.device)
    g = be.Graph()
    with be.graph(g):
        counter.add_(1)
    for _ in range(3):
        g.replay()
    return value(be, counter)


@case("value=[12.0, 12.0]")
def one_graph_feeds_another(be: Any) -> str:
    x = torch.ones(2, device=be.device)
    first, second = be.Graph(), be.Graph()
    with be.graph(first):
        mid = x * 2
    with be.graph(second):
        out = mid * 3
    x.fill_(2.0)
    first.replay()
    second.replay()
    return value(be, out)


@case("value=[2.0, 4.0, 6.0, 8.0]")
def output_is_right_after_the_first_replay(be: Any) -> str:
    x = torch.arange(1.0, 5.0, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = torch.relu(x) * 2
    g.replay()
    return value(be, y)
