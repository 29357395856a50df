"""Counter-based sampling: Gumbel-max with noise hashed from (seed, position, token id).

No generator state exists, so nothing can be baked into a graph at capture or consumed by another
row: a row's sample is a pure function of its own logits, seed, temperature and position. The hash
is integer tensor arithmetic, bit-identical on every device; products are kept below 2**63 (32-bit
lanes times 31-bit constants) so int64 never overflows.
"""

from __future__ import annotations

import torch
from torch import Tensor

_LANE = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)
_TOKEN_SALT = 0x5BD1E995
_UNIFORM_BITS = 24  # float32 represents (k + 0.5) / 2**24 exactly


def sample(logits: Tensor, seeds: Tensor, temperatures: Tensor, positions: Tensor) -> Tensor:
    """[R] int64 next tokens from logits [R, vocab].

    seeds [R] int64: a negative seed means greedy (argmax). temperatures [R] float32: a row with
    temperature <= 0 is greedy as well. positions [R] int64: the position of the token being
    sampled, so each step of a request draws fresh noise.
    """
    logits = logits.float()
    vocab = logits.shape[1]
    token_ids = torch.arange(vocab, device=logits.device, dtype=torch.int64)
    hashed = _hash(seeds[:, None], positions[:, None], token_ids[None, :])  # [R, vocab]
    uniform = ((hashed >> (32 - _UNIFORM_BITS)).float() + 0.5) * (1.0 / 2**_UNIFORM_BITS)
    gumbel = -torch.log(-torch.log(uniform))
    greedy = (seeds < 0) | (temperatures <= 0)
    safe_temperature = torch.where(greedy, 1.0, temperatures.float())
    sampled = torch.argmax(logits / safe_temperature[:, None] + gumbel, dim=-1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


def _hash(seeds: Tensor, positions: Tensor, token_ids: Tensor) -> Tensor:
    """32-bit hash (in int64) of every (seed, position, token id) combination, broadcast.

    Each 64-bit input is folded into one 32-bit lane (its high half xor its low half) before it is
    mixed in: three mixes instead of one per 32-bit word. A sampling step is a few dozen tensor
    operations whatever the batch, and on the sim, which runs every operation through Python, its
    operation count is what it costs."""
    state = _mix(token_ids ^ _TOKEN_SALT)
    for word in (positions, seeds):
        state = _mix(state ^ ((word ^ (word >> 32)) & _LANE))
    return state


def _mix(x: Tensor) -> Tensor:
    """An avalanche finaliser on 32-bit lanes (xor-shift, multiply, xor-shift, multiply)."""
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIERS[0]) & _LANE
    x = x ^ (x >> 15)
    x = (x * _MULTIPLIERS[1]) & _LANE
    return x ^ (x >> 16)
