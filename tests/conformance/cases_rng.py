"""Random numbers: a captured draw advances per replay, and is seeded from the global generator."""

from __future__ import annotations

from typing import Any

import torch

from pytest_graphmode.runtime import backends
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


# Generators besides the default one, as samplers with a generator per request hold them. They are
# made where a target lives (on sim: the drop-in, where torch.Generator(device=...) is the sim's).


def _generator(be: Any, seed: int = 7) -> torch.Generator:
    return torch.Generator(device=be.device).manual_seed(seed)


def _registered_noise_graph(be: Any, generator: torch.Generator) -> tuple[Any, torch.Tensor]:
    g = be.Graph()
    g.register_generator_state(generator)
    with be.graph(g):
        noise = torch.rand(64, device=be.device, generator=generator)
    return g, noise


@case("raises CaptureError")
def unregistered_generator_draws_in_a_capture(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        g = be.Graph()
        with be.graph(g):
            torch.rand(64, device=be.device, generator=generator)
    return "captured"


@case("differs per replay")
def registered_generator_advances_per_replay(be: Any) -> str:
    with backends.target_scope(be.name):
        g, noise = _registered_noise_graph(be, _generator(be))
        g.replay()
        first = noise.clone()
        g.replay()
        be.synchronize()
    return "same each replay" if same(first, noise) else "differs per replay"


@case("same draws")
def reseeding_a_registered_generator_repeats_the_draws(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        g, noise = _registered_noise_graph(be, generator)
        generator.manual_seed(_SEED)
        g.replay()
        first = noise.clone()
        generator.manual_seed(_SEED)
        g.replay()
        be.synchronize()
    return "same draws" if same(first, noise) else "different draws"


@case("same draws")
def restoring_a_registered_generators_state_repeats_the_draws(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        g, noise = _registered_noise_graph(be, generator)
        state = generator.get_state()
        g.replay()
        first = noise.clone()
        generator.set_state(state)
        g.replay()
        be.synchronize()
    return "same draws" if same(first, noise) else "different draws"


@case("advanced")
def replay_advances_a_registered_generator(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        g, _ = _registered_noise_graph(be, generator)
        generator.manual_seed(_SEED)
        plain = torch.rand(64, device=be.device, generator=generator)
        generator.manual_seed(_SEED)
        g.replay()
        after_replay = torch.rand(64, device=be.device, generator=generator)
        be.synchronize()
    return "not advanced" if same(plain, after_replay) else "advanced"


@case("different draws")
def two_graphs_registering_one_generator_draw_in_turn(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        first, first_noise = _registered_noise_graph(be, generator)
        second, second_noise = _registered_noise_graph(be, generator)
        generator.manual_seed(_SEED)
        first.replay()
        second.replay()
        be.synchronize()
    return "same draws" if same(first_noise, second_noise) else "different draws"


@case("raises CaptureError")
def generator_registered_with_another_graph_draws_in_a_capture(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        _registered_noise_graph(be, generator)
        g = be.Graph()
        with be.graph(g):
            torch.rand(64, device=be.device, generator=generator)
    return "captured"


@case("raises CaptureError")
def generator_reseeded_with_a_new_seed_during_capture(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        g = be.Graph()
        g.register_generator_state(generator)
        with be.graph(g):
            generator.manual_seed(_SEED + 1)
            torch.rand(64, device=be.device, generator=generator)
    return "captured"


@case("raises RuntimeError")
def host_generator_draws_on_the_device(be: Any) -> str:
    with backends.target_scope(be.name):
        torch.rand(64, device=be.device, generator=torch.Generator().manual_seed(_SEED))
    return "drawn"


@case("differs per replay")
def default_device_generator_named_in_a_capture(be: Any) -> str:
    with backends.target_scope(be.name):
        g = be.Graph()
        with be.graph(g):
            noise = torch.rand(64, device=be.device, generator=torch.cuda.default_generators[0])
        g.replay()
        first = noise.clone()
        g.replay()
        be.synchronize()
    return "same each replay" if same(first, noise) else "differs per replay"


# A device generator's state is a seed and a philox offset, which each draw moves on: samplers
# that must repeat a draw (a discarded token drawn again) set the offset back.


@case("moved by a multiple of 4")
def each_draw_moves_the_offset(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        before = generator.get_offset()
        torch.rand(64, device=be.device, generator=generator)
        after = generator.get_offset()
    moved = after - before
    return "moved by a multiple of 4" if moved > 0 and moved % 4 == 0 else f"moved by {moved}"


@case("same draws")
def setting_the_offset_back_repeats_a_draw(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        offset = generator.get_offset()
        first = torch.rand(64, device=be.device, generator=generator)
        generator.set_offset(offset)
        second = torch.rand(64, device=be.device, generator=generator)
        be.synchronize()
    return "same draws" if same(first, second) else "different draws"


@case("raises RuntimeError")
def an_offset_that_is_not_a_multiple_of_4(be: Any) -> str:
    with backends.target_scope(be.name):
        _generator(be).set_offset(6)
    return "set"


@case("16 bytes, its seed first")
def a_device_generators_state_is_its_seed_and_offset(be: Any) -> str:
    with backends.target_scope(be.name):
        state = _generator(be, seed=7).get_state()
    seed = int.from_bytes(bytes(state[:8].tolist()), "little")
    return f"{state.numel()} bytes, {'its seed first' if seed == 7 else f'{seed} first'}"


@case("a device generator drawing the same")
def a_cloned_state_is_a_device_generator(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        clone = generator.clone_state()
        mine = torch.rand(64, device=be.device, generator=generator)
        theirs = torch.rand(64, device=be.device, generator=clone)
        be.synchronize()
    kind = "a device generator" if clone.device.type == "cuda" else "a host generator"
    return f"{kind} drawing {'the same' if same(mine, theirs) else 'otherwise'}"


@case("shared")
def a_graphsafe_state_is_shared(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        other = generator.graphsafe_get_state()
        torch.rand(64, device=be.device, generator=generator)
        return "shared" if other.get_offset() == generator.get_offset() else "copied"


@case("moved at launch")
def a_replay_moves_its_registered_generator_when_launched(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        g, _ = _registered_noise_graph(be, generator)
        before = generator.get_offset()
        g.replay()
        after = generator.get_offset()  # the replay may still be queued
        be.synchronize()
    return "moved at launch" if after > before else "not moved at launch"


@case("same draws")
def a_replay_draws_what_an_eager_draw_at_its_offset_draws(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        g, noise = _registered_noise_graph(be, generator)
        offset = generator.get_offset()
        eager = torch.rand(64, device=be.device, generator=generator)
        generator.set_offset(offset)
        g.replay()
        be.synchronize()
    return "same draws" if same(eager, noise) else "different draws"


@case("raises CaptureError")
def the_offset_asked_during_a_capture(be: Any) -> str:
    with backends.target_scope(be.name):
        generator = _generator(be)
        g = be.Graph()
        g.register_generator_state(generator)
        with be.graph(g):
            generator.get_offset()
    return "captured"
