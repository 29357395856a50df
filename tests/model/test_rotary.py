"""Rotary embedding: the one-roll form gives the bits of the textbook two-halves rotation."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.runtime.model.ops import apply_rope, rope_angles, rope_inv_freq

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _two_halves(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


@given(
    tokens=st.integers(1, 24),
    heads=st.integers(1, 4),
    half=st.integers(1, 40),
    dtype=st.sampled_from(sorted(_BITS, key=str)),
    seed=st.integers(0, 2**31),
    poisoned=st.booleans(),
)
def test_rotary_gives_the_bits_of_the_two_halves_rotation(
    tokens: int, heads: int, half: int, dtype: torch.dtype, seed: int, poisoned: bool
) -> None:
    generator = torch.Generator().manual_seed(seed)
    head_dim = 2 * half
    # Garbage positions too: a padding row's position is whatever its buffer held.
    positions = torch.randint(-(2**20), 2**20, (tokens,), generator=generator)
    x = (torch.randn(tokens, heads, head_dim, generator=generator) * 8).to(dtype)
    if poisoned:
        x[0, 0, 0], x[-1, -1, -1] = float("nan"), float("inf")
    inv_freq = rope_inv_freq(head_dim, 10_000.0, "cpu")
    cos, sin = rope_angles(positions, inv_freq)
    got = apply_rope(x, cos, sin)
    expected = _two_halves(x, positions, inv_freq)
    assert torch.equal(got.view(_BITS[dtype]), expected.view(_BITS[dtype]))
