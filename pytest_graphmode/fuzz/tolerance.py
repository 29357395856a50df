"""How close is close enough: dtype-aware tolerances and NaN-aware element comparisons.

Logits, and each slot of floating slot-major state, are compared relative to their scale (a row's
or a slot's largest magnitude, at least 1), because a runner's graph path may legitimately use
other kernels than its eager path (a padded batch alone makes a GEMM library pick another
algorithm); an element near zero in a slot of larger values carries the rounding of the whole dot
product that made it, not of its own magnitude. Integers and anything that ran the same kernels
at the same shapes are compared bit for bit.

A model is no more precise than the state it keeps: a KV cache in bfloat16 rounds every key and
value to bfloat16, and float32 logits computed from attention over it (a float32 LM head, a
float32 soft-cap) carry that rounding. So logits are judged at the tolerance of the coarser of
the precision they show (`computed_in`) and that of the twin's floating slot-major state
(`state_precision`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pytest_graphmode.contract import TargetSpec, slot_major

_RTOL = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.float16: 2e-2,
    torch.bfloat16: 2e-2,
    # One unit in the last place at a slot's scale: three mantissa bits, and two.
    torch.float8_e4m3fn: 0.125,
    torch.float8_e5m2: 0.25,
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


def state_precision(state: Mapping[str, torch.Tensor], spec: TargetSpec) -> torch.dtype | None:
    """The coarsest precision of the floating slot-major tensors of `state` (a KV cache's dtype;
    None without such a tensor). A cache stored in 8 bits is read by arithmetic in a wider type,
    so float8 counts as bfloat16 here."""
    coarsest: torch.dtype | None = None
    for tensor in state.values():
        if not tensor.is_floating_point() or not slot_major(tensor, spec):
            continue
        dtype = torch.bfloat16 if tensor.element_size() == 1 else tensor.dtype
        if coarsest is None or rtol(dtype) > rtol(coarsest):
            coarsest = dtype
    return coarsest


def row_tolerance(reference: torch.Tensor, floor: torch.dtype | None = None) -> torch.Tensor:
    """Per-row absolute tolerance of `[rows, vocab]` logits: rtol of the precision they were
    computed in (`computed_in`, or `floor`, the twin's `state_precision`, where that is coarser)
    times the row's scale."""
    relative = rtol(computed_in(reference))
    if floor is not None:
        relative = max(relative, rtol(floor))
    return relative * _scale(reference)


def _scale(values: torch.Tensor) -> torch.Tensor:
    """Per leading index (a row of logits, a slot of state): the largest finite magnitude, at
    least 1, in float32."""
    flat = values.detach().flatten(1) if values.dim() > 1 else values.detach()[:, None]
    return flat.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=1).clamp_min(1.0).float()


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


def within_slots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise closeness of two slot-major tensors, each slot (the leading index) judged at
    its dtype's tolerance times its scale (its largest finite magnitude in `b`, at least 1), as
    logits are per row; exact for integers, NaN equals NaN."""
    if not a.is_floating_point():
        return a == b
    a32, b32 = a.float(), b.float()
    tol = rtol(a.dtype) * _scale(b32).reshape(-1, *([1] * (b32.dim() - 1)))
    return ((a32 - b32).abs() <= tol) | same_bits(a32, b32)


def within(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise closeness with the dtype's tolerance; exact for integers, NaN equals NaN."""
    if not a.is_floating_point():
        return a == b
    tol = rtol(a.dtype)
    a32, b32 = a.float(), b.float()
    return ((a32 - b32).abs() <= tol * (1.0 + b32.abs())) | same_bits(a32, b32)
