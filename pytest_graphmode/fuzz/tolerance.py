"""How close is close enough: dtype-aware tolerances and NaN-aware element comparisons.

Logits are compared relative to their scale (a row's largest magnitude, at least 1), because a
runner's graph path may legitimately use other kernels than its eager path; integers and anything
that ran the same kernels at the same shapes are compared bit for bit.
"""

from __future__ import annotations

import torch

_RTOL = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.float16: 2e-2,
    torch.bfloat16: 2e-2,
}

SAMPLED_AGREEMENT = 1e-6
"""Largest |logit difference| / temperature at which two runs of a sampled row must draw the same
token (see `sampling_check.py` for why this never cries wolf in practice)."""


def rtol(dtype: torch.dtype) -> float:
    return _RTOL.get(dtype, 1e-4)


def computed_in(logits: torch.Tensor) -> torch.dtype:
    """The precision `logits` were computed in: their dtype, or, for float32 logits whose every
    finite value a half-precision type holds exactly, that type. A model that computes in
    bfloat16 or float16 and hands out its logits upcast to float32 (as serving engines do) has
    the half type's rounding, and different kernels for different batch sizes change its logits
    by that much; float32 arithmetic leaves bits below half precision set in all but a few of a
    row's values. Values of two significant bits or fewer (0, 1, 3, 0.5: a test's or a toy's
    logits) tell nothing of a precision, and leave float32's."""
    if logits.dtype != torch.float32 or logits.numel() == 0:
        return logits.dtype
    values = logits.detach()
    values = values[values.isfinite()]
    if bool((values.to(torch.float8_e5m2).float() == values).all()):
        return logits.dtype
    for half in (torch.bfloat16, torch.float16):
        if bool((values.to(half).float() == values).all()):
            return half
    return logits.dtype


def row_tolerance(reference: torch.Tensor) -> torch.Tensor:
    """Per-row absolute tolerance of `[rows, vocab]` logits: rtol of the precision they were
    computed in (`computed_in`) times the row's scale."""
    scale = reference.detach().abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=-1).clamp_min(1.0)
    return rtol(computed_in(reference)) * scale.float()


def logit_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise |a - b| of two logits tensors in float32, 0 where they are equal: a token
    masked out on both sides (-inf, as a grammar's bitmask or a top-k filter leaves it) is no
    difference, where a plain subtraction gives NaN. NaN where either holds NaN."""
    a32, b32 = a.float(), b.float()
    return (a32 - b32).abs().masked_fill(a32 == b32, 0.0)


def argmax_decided(reference: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """Per row of `[rows, vocab]` logits, whether its greedy token is decided within `tol`: the
    top-2 margin exceeds twice the tolerance (or the vocabulary has one token)."""
    if reference.shape[-1] == 1:
        return torch.ones(reference.shape[0], dtype=torch.bool)
    top2 = reference.float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) > 2 * tol


def sample_decided(gap: float, temperature: float) -> bool:
    """Whether two runs of a sampled row whose logits differ by at most `gap` must draw the same
    token (`SAMPLED_AGREEMENT`)."""
    return gap <= SAMPLED_AGREEMENT * temperature


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise equality where NaN equals NaN (poisoned memory holds NaN on both sides)."""
    equal = a == b
    if a.is_floating_point():
        equal |= a.isnan() & b.isnan()
    return equal


def within(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise closeness with the dtype's tolerance; exact for integers, NaN equals NaN."""
    if not a.is_floating_point():
        return a == b
    tol = rtol(a.dtype)
    a32, b32 = a.float(), b.float()
    close = (a32 - b32).abs() <= tol * (1.0 + b32.abs())
    return close | (a32.isnan() & b32.isnan()) | (a32 == b32)
