"""`scaled_dot_product_attention` on the sim: CUDA's choice of kernel, the CPU's computation.

torch runs SDPA with one of several kernels, the first in its order that the inputs suit and that
`sdpa_kernel` (or `torch.backends.cuda.enable_*_sdp`) leaves enabled; when none is left it raises
"No available kernel". Left to the CPU, the sim answered by the CPU's kernels, whose rules differ:
- the CPU has no efficient or cuDNN kernel, so `sdpa_kernel(EFFICIENT_ATTENTION)` alone, which a
  GPU runs, raised;
- the CPU's flash kernel takes a mask, float32 and any head size, so a runner that forces flash
  with a mask passed on sim and raised on a GPU;
- the math kernel makes its causal mask with the query's options, a host tensor to the sim's
  dispatcher, and then refused to add it to the device scores.

So the sim decides as torch on an sm90 GPU (H100, H200) does which kernels would take the call
(the rules of torch's `sdp_utils.cpp`, set where they differ by what an H200 with torch 2.11 took),
raises CUDA's error with torch's warnings when none would, and otherwise computes on the CPU, with
math where CUDA would run math and with the CPU's own choice where CUDA runs a fused kernel; the
tensors the kernel makes inside are device tensors (`call_through`). Numerics follow the CPU's
kernels, not the GPU's: what the sim checks is which calls run. `torch.nn.attention.bias` masks
(`causal_lower_right`) are made and dispatched as torch does on CUDA.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch.utils._python_dispatch import _disable_current_modes

from pytest_graphmode.runtime.backends.sim import placement
from pytest_graphmode.runtime.backends.sim.device import SIM_DEVICE, call_through, on_device

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.backend import SimBackend

NO_KERNEL = "No available kernel. Aborting execution."
"""torch's error when no enabled kernel takes an SDPA call (sdp_utils.cpp)."""

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PARAMETERS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclasses.dataclass(frozen=True)
class _Call:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    dropout: float
    causal: bool
    gqa: bool
    dtype: torch.dtype  # what the kernel sees: autocast casts the inputs first

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key, self.value)


def _named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments after query, key and value, by name."""
    return dict(zip(_PARAMETERS, args[3:], strict=False)) | kwargs


def _call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
    query, key, value = args[:3]
    named = _named(args, kwargs)
    dtype = query.dtype
    if dtype.is_floating_point and torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")  # the sim runs CUDA's autocast as the CPU's
    return _Call(
        query,
        key,
        value,
        named.get("attn_mask"),
        float(named.get("dropout_p", 0.0)),
        bool(named.get("is_causal", False)),
        bool(named.get("enable_gqa", False)),
        dtype,
    )


# Each kernel's constraints, in torch's order: the first that fails is the reason it gives.
def _four_dimensional(c: _Call) -> str | None:
    if all(t.dim() == 4 for t in c.tensors):
        return None
    q, k, v = (t.dim() for t in c.tensors)
    return (
        "Both fused kernels requires query, key and value to be 4 dimensional, but got Query "
        f"dim: {q}, Key dim: {k}, Value dim: {v} instead."
    )


def _no_mask(c: _Call) -> str | None:
    return None if c.mask is None else "Flash Attention does not support non-null attn_mask."


def _flash_head_dim(c: _Call) -> str | None:
    q, k, v = (t.shape[-1] for t in c.tensors)
    if q == k == v and q <= 256:
        return None
    return (
        "Flash attention requires q,k,v to have the same last dimension and to be less than or "
        f"equal to 256. Got Query.size(-1): {q}, Key.size(-1): {k}, Value.size(-1): {v} instead."
    )


def _square_if_causal(c: _Call) -> str | None:
    lq, lk = c.query.shape[-2], c.key.shape[-2]
    if not c.causal or lq == lk:
        return None
    return (
        "Flash attention does not support the is_causal flag when seqlen_q != seqlen_k. Got "
        f"seqlen_q: {lq} seqlen_k: {lk}."
    )


def _dtype_in(allowed: tuple[torch.dtype, ...]) -> Callable[[_Call], str | None]:
    def check(c: _Call) -> str | None:
        if c.dtype in allowed:
            return None
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        return f"Expected query, key and value to all be of dtype: {{{names}}}. Got {c.dtype}."

    return check


def _alignment(c: _Call) -> int:
    # sm90: tensor cores, 128 bits a row (minimum_gemm_alignment in sdp_utils.cpp)
    return 8 if c.dtype in _LOW_PRECISION else 4


def _efficient_head_dim(c: _Call) -> str | None:
    q, k, v = (t.shape[-1] for t in c.tensors)
    align = _alignment(c)
    if q == k and q % align == 0 and q > 0 and v % align == 0 and v > 0:
        return None
    return (
        f"Mem efficient attention requires last dimension of inputs to be divisible by {align}. "
        f"Got Query.size(-1): {q}, Key.size(-1): {k}, Value.size(-1): {v} instead."
    )


def _aligned_offsets(c: _Call) -> str | None:
    align = _alignment(c)
    if all(t.numel() == 0 or t.storage_offset() % align == 0 for t in c.tensors):
        return None
    return (
        "Mem efficient attention on sm80 or newer requires q, k, and v storage offsets * "
        f"element_size to be aligned to {align * c.query.element_size()} bytes."
    )


def _nonzero_lengths(c: _Call) -> str | None:
    if all(t.shape[-2] > 0 for t in c.tensors):
        return None
    return "All fused kernels do not support zero seq_len_q or seq_len_kv."


def _last_dim_contiguous(c: _Call) -> str | None:
    if all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in c.tensors):
        return None
    return "All fused kernels require the last dimension of the input to have stride 1."


def _heads_alike(grouped: bool) -> Callable[[_Call], str | None]:
    """Batch and heads alike; `grouped`: more query heads than key heads are taken under
    `enable_gqa` (flash and cuDNN; the efficient kernel refused them on an H200 with torch
    2.11)."""

    def check(c: _Call) -> str | None:
        q, k, v = c.tensors
        if not q.shape[0] == k.shape[0] == v.shape[0]:
            return "For dense inputs, both fused kernels require query, key and value to have the same batch_size."
        hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
        if hq == hk == hv or (grouped and c.gqa and hk == hv and hq % hk == 0):
            return None
        return (
            "For dense input, both fused kernels require query, key and value to have the same "
            f"num_heads. Query.sizes(): {tuple(q.shape)}, Key sizes(): {tuple(k.shape)}, Value "
            f"sizes(): {tuple(v.shape)} instead. To broadcast dense inputs, try using unsqueeze "
            "and expand_to before passing them into the kernel."
        )

    return check


def _cudnn_mask_shape(c: _Call) -> str | None:
    m = c.mask
    if m is None:
        return None
    lq, lk, b, h = c.query.shape[2], c.key.shape[2], c.query.shape[0], c.query.shape[1]
    rows_fit = m.dim() >= 2 and m.shape[-2] in (lq, 1) and m.shape[-1] in (lk, 1)
    if rows_fit and (
        m.dim() == 2 or (m.dim() == 4 and m.shape[0] in (b, 1) and m.shape[1] in (h, 1))
    ):
        return None
    return "Please use the following attn mask shapes: 2d - (Q_LEN, KV_LEN); 4d - (BATCH, HEADS or 1, Q_LEN, KV_LEN)"


def _cudnn_shapes(c: _Call) -> str | None:
    d_qk, d_v, lk = c.query.shape[3], c.value.shape[3], c.key.shape[2]
    if d_qk > 256 or d_v > 256:  # as an H200 with cuDNN 9.19 took 192 and 256 (2026-12-05)
        return "head_dim should be no more than 256"
    if d_qk % 8 or d_v % 8:
        return "head_dim should be a multiple of 8"
    if lk == 1:
        return "cudnn SDPA does not support key/value sequence length 1."
    return None


def _cudnn_dropout(c: _Call) -> str | None:
    if c.dropout * 16.0 == int(c.dropout * 16.0):
        return None
    return "cuDNN dropout probability resolution is limited to 1/16."


_CONSTRAINTS: dict[SDPBackend, tuple[Callable[[_Call], str | None], ...]] = {
    SDPBackend.FLASH_ATTENTION: (
        _four_dimensional,
        _no_mask,
        _flash_head_dim,
        _square_if_causal,
        _dtype_in(_LOW_PRECISION),
        _heads_alike(grouped=True),
        _nonzero_lengths,
        _last_dim_contiguous,
    ),
    SDPBackend.EFFICIENT_ATTENTION: (
        _four_dimensional,
        _efficient_head_dim,
        _aligned_offsets,
        _nonzero_lengths,
        _last_dim_contiguous,
        _heads_alike(grouped=False),
        _dtype_in(_EFFICIENT_DTYPES),
    ),
    SDPBackend.CUDNN_ATTENTION: (
        _four_dimensional,
        _dtype_in(_LOW_PRECISION),
        _cudnn_mask_shape,
        _cudnn_dropout,
        _nonzero_lengths,
        _last_dim_contiguous,
        _heads_alike(grouped=True),
        _cudnn_shapes,
    ),
}
_ENABLED = {
    SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
    SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
}
# The order torch warns in when no kernel is left (select_sdp_backend).
_WARNED = (
    ("Memory efficient kernel not used because:", SDPBackend.EFFICIENT_ATTENTION),
    ("Flash attention kernel not used because:", SDPBackend.FLASH_ATTENTION),
    ("cuDNN attention kernel not used because:", SDPBackend.CUDNN_ATTENTION),
)
_DISABLED = {
    SDPBackend.FLASH_ATTENTION: "Flash attention has been runtime disabled.",
    SDPBackend.EFFICIENT_ATTENTION: "Memory Efficient attention has been runtime disabled.",
    SDPBackend.CUDNN_ATTENTION: "cuDNN attention has been runtime disabled.",
}


def _refusal(kernel: SDPBackend, c: _Call) -> str | None:
    """Why CUDA's `kernel` would not take the call; None when it would."""
    if not _ENABLED[kernel]():
        return _DISABLED[kernel]
    for constraint in _CONSTRAINTS[kernel]:
        reason = constraint(c)
        if reason is not None:
            return reason
    return None


# The order a kernel is taken in when several would: cuDNN first on sm90 where torch prefers it
# (a recent cuDNN), else flash, efficient, math. Only the efficient kernel's own check below
# depends on it, and cuDNN first raises that check in fewer calls, never in more.
_ORDER = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def cuda_kernel(c: _Call) -> SDPBackend:
    """The kernel CUDA would take the call with; raises CUDA's error when none, math included,
    would, and the efficient kernel's own error for a mask of another dtype than the query's."""
    chosen = next((kernel for kernel in _ORDER if _refusal(kernel, c) is None), None)
    if chosen is None and torch.backends.cuda.math_sdp_enabled():
        chosen = SDPBackend.MATH
    if chosen is None:
        for heading, kernel in _WARNED:
            warnings.warn(heading, UserWarning, stacklevel=4)
            warnings.warn(str(_refusal(kernel, c)), UserWarning, stacklevel=4)
        raise RuntimeError(NO_KERNEL)
    if chosen is SDPBackend.EFFICIENT_ATTENTION and c.mask is not None:
        mask_dtype = c.mask.dtype
        if mask_dtype.is_floating_point and torch.is_autocast_enabled("cpu"):
            mask_dtype = c.dtype  # autocast casts the mask with the inputs
        if mask_dtype != torch.bool and mask_dtype != c.dtype:
            # Checked in the kernel (attention.cu), after the kernel was chosen: no fallback.
            raise RuntimeError("invalid dtype for bias - should match query's dtype")
    return chosen


def scaled_dot_product_attention(
    backend: SimBackend, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The device mode's handler for `F.scaled_dot_product_attention` (module docstring)."""
    if len(args) < 3 or not all(isinstance(t, torch.Tensor) for t in args[:3]):
        return func(*args, **kwargs)  # torch's own argument error
    c = _call(args, kwargs)
    inputs = [*c.tensors, *([c.mask] if c.mask is not None else [])]
    if not any(on_device(t) for t in inputs):
        return func(*args, **kwargs)  # host attention: the CPU's rules are the host's
    if isinstance(c.mask, CausalBias):
        return _causal_bias(backend, func, c, args, kwargs)
    fused = cuda_kernel(c) is not SDPBackend.MATH
    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if fused else [SDPBackend.MATH]
    with sdpa_kernel(kernels):
        return call_through(backend, func, args, kwargs)


def _causal_bias(
    backend: SimBackend, func: Any, c: _Call, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A `torch.nn.attention.bias` mask, as its own `__torch_function__` dispatches it on CUDA: a
    square or upper-left one is `is_causal=True`; a lower-right one runs on a fused kernel with
    causal masking where flash or efficient would take the unmasked call, else with the mask
    made on the device (its own code would make it with a device the CPU build refuses)."""
    bias = c.mask
    assert isinstance(bias, CausalBias)
    if c.causal:
        raise ValueError("CausalBias should not be used with causal=True")
    named = _named(args, kwargs)
    if bias.seq_len_q == bias.seq_len_kv or bias.variant == CausalVariant.UPPER_LEFT:
        causal = dict(named, attn_mask=None, is_causal=True)
        return scaled_dot_product_attention(backend, func, args[:3], causal)
    rows, cols = bias.seq_len_q, bias.seq_len_kv
    mask = placement.factory(
        backend, torch.ones, (rows, cols), {"dtype": torch.bool, "device": SIM_DEVICE}
    ).tril(diagonal=cols - rows)
    unmasked = dataclasses.replace(c, mask=None)
    masked = dict(named, attn_mask=mask)
    if any(_refusal(k, unmasked) is None for k in _ORDER[1:]):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
            return call_through(backend, func, args[:3], masked)
    return scaled_dot_product_attention(backend, func, args[:3], masked)


def patch_causal_bias_new() -> Callable[[], None]:
    """`causal_lower_right(...)` and `causal_upper_left(...)` make a `CausalBias`, a tensor
    subclass that torch's legacy constructor builds over an empty tensor. Made through the sim's
    dispatch mode, that tensor came back with a Python object of its own, and torch then refused
    to make it a `CausalBias` ("already associated to a python object"), so the documented
    bottom-right causal mask could not be made on sim. It holds no data: made with the dispatch
    modes set aside. Returns what puts torch's back."""

    def new(cls: type, *args: Any) -> Any:
        with _disable_current_modes():
            return torch.Tensor.__new__(cls, *args)

    CausalBias.__new__ = staticmethod(new)  # type: ignore[assignment,method-assign]

    def restore() -> None:
        del CausalBias.__new__

    return restore


HANDLERS: dict[Any, Callable[..., Any]] = {
    torch.nn.functional.scaled_dot_product_attention: scaled_dot_product_attention,
}
