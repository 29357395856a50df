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
(`state_precision`), and float32 state kept beside such state (a float8 cache's scales, taken
from the amax of bfloat16 keys) at that tolerance relative to each slot's own magnitude.

bfloat16 holds 8 significant bits, and a correct model's graph path that rounds otherwise than
its eager path moves its logits by up to 2.2% of a row's scale (a fused recurrent step against a
chunked scan) and, with sharp attention, a deeper layer's values by up to 2.5% of a slot's
(split-KV attention against one pass): both are judged at 4e-2. A float8 cache puts an element
on the neighbouring code now and then where two paths quantize by other arithmetic (one fused
amax against a per-head loop, a scale applied before or after the matmul); logits over it move
by up to 0.27 of a unit in the last place (3.3% of a row's scale for `e4m3`), and are judged at
half a unit, the rounding of storing a value in the type at all.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pytest_graphmode.contract import TargetSpec, slot_major

_RTOL = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.float16: 2e-2,
    torch.bfloat16: 4e-2,
}

SAMPLED_AGREEMENT = 1e-6
"""Largest |logit difference| / temperature at which two runs of a sampled row must draw the same
token (see `sampling_check.py` for why this never cries wolf in practice)."""


def rtol(dtype: torch.dtype) -> float:
    """The relative tolerance of a value, or a slot, stored in `dtype`: for a float8 type one
    unit in its last place (0.125 for `e4m3`, 0.25 for `e5m2`), so a neighbouring code passes."""
    if dtype in _RTOL:
        return _RTOL[dtype]
    if _is_float8(dtype):
        return float(torch.finfo(dtype).eps)
    return 1e-4


def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _exponent_only(dtype: torch.dtype) -> bool:
    """A float8 type with no mantissa bits (`float8_e8m0fnu`): one unit is a factor of two."""
    return _is_float8(dtype) and rtol(dtype) >= 1


def logits_rtol(dtype: torch.dtype) -> float:
    """The relative tolerance of logits computed in `dtype`, or of any value computed over state
    kept in it: half a unit in the last place for a float8 type (2^-4 for `e4m3`)."""
    return rtol(dtype) / 2 if _is_float8(dtype) else rtol(dtype)


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


def matmul_precision(backend: str) -> torch.dtype | None:
    """The precision float32 matrix products round to on `backend` as torch is set now, where it
    is coarser than float32: on cuda with TF32 matmuls allowed (`allow_tf32`, a float32 matmul
    precision below "highest", or torch's newer `fp32_precision = "tf32"`), float16's, whose 10
    mantissa bits TF32 keeps; None otherwise, and on sim, whose CPU kernels round in float32
    whatever the setting. Engines turn TF32 on at start-up (a process-wide setting, so read at
    every step, after the runner's constructor): a float32 model's logits then carry a half
    type's rounding, and another kernel for another batch size moves them by that much."""
    if backend != "cuda":
        return None
    return torch.float16 if _tf32_matmuls() else None


def _tf32_matmuls() -> bool:
    matmul = torch.backends.cuda.matmul
    try:
        # torch >= 2.9; follows the older setters too. The older getters raise once both kinds
        # of setter were used.
        return bool(matmul.fp32_precision == "tf32")
    except (AttributeError, RuntimeError):
        return torch.get_float32_matmul_precision() != "highest" or bool(matmul.allow_tf32)


# Slot-major integer state of these types is a quantized cache's codes (an int8 KV cache; float8
# codes stored through a uint8 view), not indices or counts, which are wider.
QUANTIZED_CODES = frozenset({torch.int8, torch.uint8})


def coarser_precision(*dtypes: torch.dtype | None) -> torch.dtype | None:
    """The coarsest of `dtypes` as `logits_rtol` ranks them (None where all are None): the
    precision a runner computes in, from its state's (`state_precision`) and its logits'
    (`computed_in`): an int8 cache beside float32 scales shows none in its state, while its
    bfloat16 model's logits show bfloat16."""
    known = [d for d in dtypes if d is not None]
    return max(known, key=logits_rtol) if known else None


def state_precision(state: Mapping[str, torch.Tensor], spec: TargetSpec) -> torch.dtype | None:
    """The coarsest precision of the floating slot-major tensors of `state` (a KV cache's dtype;
    None without such a tensor), coarsest as `logits_rtol` ranks them. A type with no mantissa
    (`float8_e8m0fnu`, the power-of-two scales of an MX cache) holds scales, not values, and is
    left out: judged by its unit, its neighbouring power of two, the logits would pass at half
    their scale."""
    return coarser_precision(
        *(
            tensor.dtype
            for tensor in state.values()
            if tensor.is_floating_point()
            and slot_major(tensor, spec)
            and not _exponent_only(tensor.dtype)
        )
    )


def row_tolerance(reference: torch.Tensor, floor: torch.dtype | None = None) -> torch.Tensor:
    """Per-row absolute tolerance of `[rows, vocab]` logits: `logits_rtol` of the precision they
    were computed in (`computed_in`), or of `floor` (the twin's `state_precision`) where that is
    coarser, times the row's scale."""
    relative = logits_rtol(computed_in(reference))
    if floor is not None:
        relative = max(relative, logits_rtol(floor))
    return relative * _scale(reference)


def _scale(values: torch.Tensor) -> torch.Tensor:
    """Per leading index (a row of logits, a slot of state): the largest finite magnitude, at
    least 1, in float32."""
    return _magnitude(values).clamp_min(1.0)


def _magnitude(values: torch.Tensor) -> torch.Tensor:
    """Per leading index: the largest finite magnitude, in float32."""
    flat = values.detach().flatten(1) if values.dim() > 1 else values.detach()[:, None]
    return flat.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=1).float()


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


def within_slots(
    a: torch.Tensor, b: torch.Tensor, floor: torch.dtype | None = None
) -> torch.Tensor:
    """Elementwise closeness of two slot-major tensors, each slot (the leading index) judged at
    its dtype's tolerance times its scale (its largest finite magnitude in `b`, at least 1), as
    logits are per row; exact for integers but 8-bit codes, NaN equals NaN. `floor` is the
    precision the runner computes in (`coarser_precision`): where it is coarser than the tensor's
    dtype, a slot within `logits_rtol(floor)` of its own largest magnitude, however far below 1,
    passes too, as float32 state computed from coarser values (a scale from the amax of bfloat16
    keys) carries their rounding. A slot-major 8-bit integer tensor holds a quantized cache's
    codes, `round(x / scale)`: two paths whose `x` differ by their rounding land on neighbouring
    codes, so a code passes within one unit, or within `logits_rtol(floor)` of its slot's largest
    code."""
    shape = (-1, *([1] * (b.dim() - 1)))
    if a.dtype in QUANTIZED_CODES:
        a32, b32 = a.float(), b.float()
        relative = logits_rtol(floor) if floor is not None else 0.0
        units = (relative * _magnitude(b32)).clamp_min(1.0).reshape(shape)
        return (a32 - b32).abs() <= units
    if not a.is_floating_point():
        return a == b
    a32, b32 = a.float(), b.float()
    tol = rtol(a.dtype) * _scale(b32).reshape(shape)
    if floor is not None and rtol(floor) > rtol(a.dtype):
        tol = tol.maximum(logits_rtol(floor) * _magnitude(b32).reshape(shape))
    return ((a32 - b32).abs() <= tol) | same_bits(a32, b32)


def within(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise closeness with the dtype's tolerance; exact for integers, NaN equals NaN."""
    if not a.is_floating_point():
        return a == b
    tol = rtol(a.dtype)
    a32, b32 = a.float(), b.float()
    return ((a32 - b32).abs() <= tol * (1.0 + b32.abs())) | same_bits(a32, b32)
