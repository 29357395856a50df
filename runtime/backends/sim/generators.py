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

A device generator's state is CUDA's: a seed and a philox offset (`get_state()` holds the two in 16
bytes; `get_offset`, `set_offset`, a multiple of 4). Each draw takes the values its seed and offset
give, then moves the offset on by 4, as a CUDA kernel drawing a few values per thread does: setting
the offset back repeats a draw, and a replay draws at the offset its generator holds when the
replay runs. The values are the CPU's (a generator seeded from the seed and offset), not Philox's.

`torch.default_generator` stands for the device's default generator (`torch.cuda.default_generators`
in the drop-in): the sim's device draws without a generator come from it, with the CPU's state.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
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


def refuse_in_capture(backend: SimBackend, what: str) -> None:
    """A device generator's `what` (`get_offset`, `set_offset`, `seed`, `clone_state`), which
    CUDA asserts no stream captures for: refused while the current stream captures."""
    active = backend.capturing_here()
    if active is not None:
        raise active.capture.fail(
            f"Cannot call CUDAGeneratorImpl::{what} during CUDA graph capture (as CUDA refuses "
            "it): call it before the capture or after it"
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


DRAW_INCREMENT = 4
"""How far a draw moves its generator's offset: a CUDA kernel that draws up to four values per
thread (every small draw, as a sampler's) moves it by 4."""
_MASK = 2**64 - 1


@dataclass
class PhiloxState:
    """A device generator's state as CUDA keeps it: its seed and philox offset. Generators that
    share one (`graphsafe_get_state`, `graphsafe_set_state`) draw from the same offsets."""

    seed: int
    offset: int = 0


# Device generators by the seed of their host generator. Torch hands a dispatched operation its
# generator as a fresh `torch._C.Generator` around the same host generator, without the
# `SimGenerator` (and its seed and offset) it was called with; that seed, one per device
# generator and never changed (its own seed and offset are kept apart), finds it again.
_BY_NAME: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_NAMES = itertools.count(2**63 + 0x5EED)
DEFAULT_SEED = int(torch._C.Generator().initial_seed())
"""The seed of a new generator, on CUDA as on the CPU."""


def name_device_generator(generator: Any) -> None:
    """Make `generator` (a new `SimGenerator`) one `philox_state` finds in a dispatched call."""
    name = next(_NAMES)
    torch._C.Generator.manual_seed(generator, name)
    _BY_NAME[name] = generator


def device_generator(generator: Any) -> Any:
    """The sim device generator (`SimGenerator`) `generator` is, or stands for in a dispatched
    call; None for any other generator."""
    if generator is None:
        return None
    if getattr(generator, "_philox", None) is not None:
        return generator
    return _BY_NAME.get(int(generator.initial_seed()))


def philox_state(generator: Any) -> PhiloxState | None:
    """The seed and offset of a sim device generator (`device_generator`); None for any other."""
    owner = device_generator(generator)
    return None if owner is None else owner._philox  # type: ignore[no-any-return]


def bind_draw(generator: Any) -> torch.Generator:
    """The host generator one draw from device generator `generator` runs with: seeded from its
    seed and offset now, whose offset then moves on (`DRAW_INCREMENT`)."""
    state = philox_state(generator)
    assert state is not None
    return _seeded(*_take_draw(state))


class CapturedDraws:
    """The draws a capture recorded from device generators, in the order the program runs them.
    Each launch of the program takes its draws' seeds and offsets (`reserve`) and moves the
    generators on, as CUDA does when a replay is launched, whenever the replay then runs: a draw
    on the host after `replay()` draws past the replay's."""

    def __init__(self) -> None:
        self._generators: list[Any] = []
        self._bound: list[tuple[int, int]] = []

    def __bool__(self) -> bool:
        return bool(self._generators)

    def record(self, func: Callable[..., Any], generator: Any) -> Callable[..., Any]:
        """`func`, a draw from device `generator`, as a replay runs it: at the seed and offset
        its launch reserved."""
        index = len(self._generators)
        self._generators.append(device_generator(generator))

        def draw(*args: Any, **kwargs: Any) -> Any:
            seed, offset = self._bound[index]
            return func(*args, **dict(kwargs, generator=_seeded(seed, offset)))

        return draw

    def reserve(self) -> list[tuple[int, int]]:
        """At a launch: the (seed, offset) of each draw, each generator moved on past them."""
        return [_take_draw(generator._philox) for generator in self._generators]

    def bind(self, reserved: list[tuple[int, int]]) -> None:
        """At a run: the draws run at the seeds and offsets their launch reserved."""
        self._bound = reserved


def _take_draw(state: PhiloxState) -> tuple[int, int]:
    """The seed and offset of one draw from `state`, moved on past it (an unsigned 64-bit
    offset, as CUDA's, wraps to 0)."""
    taken = (state.seed, state.offset)
    state.offset = (state.offset + DRAW_INCREMENT) & _MASK
    return taken


def _seeded(seed: int, offset: int) -> torch.Generator:
    """The host generator a draw at `seed` and `offset` runs with (torch's own class: in the
    drop-in `torch.Generator` is the sim's)."""
    made = torch._C.Generator()
    made.manual_seed(_mix(seed, offset))
    return made


def _mix(seed: int, offset: int) -> int:
    """A 64-bit seed for the host generator of (seed, offset): splitmix64's finaliser, so that
    neighbouring offsets give unrelated draws."""
    x = (seed ^ (offset * 0x9E3779B97F4A7C15)) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)
