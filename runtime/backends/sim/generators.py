"""CUDA's rules for random-number generators on the sim device.

The sim's device draws run on the CPU, so any generator would do; CUDA is stricter, and a runner
that passes on sim must not fail on the GPU for it (the H200 showed each rule, docs/backends.md):

- A draw on the device takes a device generator (`torch.Generator(device="cuda")`, a
  `SimGenerator` on sim) or the default one; a host generator fails ("Expected a 'cuda' device type
  for generator but found 'cpu'").
- In a capture, a generator other than the default draws only when it is registered with the graph
  being captured (`graph.register_generator_state(generator)`). Unregistered, its philox offset has
  no graph-safe home and CUDA refuses the draw ("Attempt to increase offset for a CUDA generator not
  in capture mode"); the capture is then invalid, as on sim. A registered generator advances per
  replay and replays the draws its seed gives, as the sim's replay (which draws afresh) does too.
- While the current stream captures, a device generator may be re-seeded only with its own seed.

`torch.default_generator` stands for the device's default generator (`torch.cuda.default_generators`
in the drop-in): the sim's device draws without a generator come from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.backend import SimBackend


def is_device_generator(generator: Any) -> bool:
    """Whether `generator` is one of the sim device's (the default, or a `SimGenerator`)."""
    return generator is torch.default_generator or generator.device.type == "cuda"


def check_draw(backend: SimBackend, generator: Any) -> None:
    """A device draw from `generator`: refused as CUDA refuses it (module docstring)."""
    if not is_device_generator(generator):
        raise RuntimeError(
            f"Expected a 'cuda' device type for generator but found '{generator.device.type}': "
            "a draw on the device takes a generator made with torch.Generator(device='cuda')"
        )
    active = backend.capturing_here()
    if active is None or generator is torch.default_generator or active.graph.draws_from(generator):
        return
    raise active.capture.fail(
        "a draw from a generator that is not registered with the graph being captured (CUDA: "
        "'Attempt to increase offset for a CUDA generator not in capture mode'): call "
        "graph.register_generator_state(generator) before the capture, or draw from the "
        "default generator"
    )


def check_reseed(backend: SimBackend, generator: Any, seed: int) -> None:
    """`generator.manual_seed(seed)`: refused while the current stream captures, unless `seed` is
    the generator's own (CUDA: 'set_current_seed can be called during stream capture only if new
    seed is the same as the original seed')."""
    active = backend.capturing_here()
    # torch keeps a seed as an unsigned 64-bit number (manual_seed(-1) reads back as 2**64 - 1)
    if active is not None and int(seed) % 2**64 != generator.initial_seed():
        raise active.capture.fail(
            f"manual_seed({seed}) of a device generator seeded {generator.initial_seed()} while the "
            "current stream captures: a generator can only be re-seeded with the same seed during "
            "a capture"
        )
