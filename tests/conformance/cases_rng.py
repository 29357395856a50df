"""Random numbers: a captured draw advances per replay, and is seeded from the global generator."""

from __future__ import annotations

from typing import Any

import torch

from tests.conformance.case import case, same

_SEED = 1234


def _noise_graph(be: Any) -> tuple[Any, torch.Tensor]:
    g = be.Graph()
    with be.graph(g):
        noise = torch.rand(64, device=be.device)
    return g, noise


@case("differs per replay")
def rand_in_a_capture_advances_per_replay(be: Any) -> str:
    g, noise = _noise_graph(be)
    g.replay()
    first = noise.clone()
    g.replay()
    be.synchronize()
    return "same each replay" if same(first, noise) else "differs per replay"


@case("in [0, 1)")
def rand_in_a_capture_draws_valid_values(be: Any) -> str:
    g, noise = _noise_graph(be)
    g.replay()
    be.synchronize()
    return "in [0, 1)" if bool(((noise >= 0) & (noise < 1)).all()) else "out of range"


@case("same draws")
def reseeding_before_replay_repeats_the_draws(be: Any) -> str:
    g, noise = _noise_graph(be)
    torch.manual_seed(_SEED)
    g.replay()
    first = noise.clone()
    torch.manual_seed(_SEED)
    g.replay()
    be.synchronize()
    return "same draws" if same(first, noise) else "different draws"


@case("advanced")
def replay_advances_the_eager_generator(be: Any) -> str:
    g, _ = _noise_graph(be)
    torch.manual_seed(_SEED)
    plain = torch.rand(64, device=be.device)
    torch.manual_seed(_SEED)
    g.replay()
    after_replay = torch.rand(64, device=be.device)
    be.synchronize()
    return "not advanced" if same(plain, after_replay) else "advanced"


@case("captured")
def manual_seed_with_the_same_seed_during_capture(be: Any) -> str:
    torch.manual_seed(_SEED)
    g = be.Graph()
    with be.graph(g):
        torch.manual_seed(_SEED)
        torch.rand(4, device=be.device)
    return "captured"


@case(
    "raises CaptureError",
)
def manual_seed_with_a_new_seed_during_capture(be: Any) -> str:
    torch.manual_seed(_SEED)
    g = be.Graph()
    with be.graph(g):
        torch.manual_seed(_SEED + 1)
        torch.rand(4, device=be.device)
    return "captured"


@case("differs per replay")
def dropout_mask_differs_per_replay(be: Any) -> str:
    x = torch.ones(256, device=be.device)
    g = be.Graph()
    with be.graph(g):
        y = torch.nn.functional.dropout(x, p=0.5, training=True)
    g.replay()
    first = y.clone()
    g.replay()
    be.synchronize()
    return "same each replay" if same(first, y) else "differs per replay"
