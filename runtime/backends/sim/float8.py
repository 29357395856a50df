"""What CUDA's float8 matrix product (`torch._scaled_mm`) refuses and the CPU's kernel takes.

The sim runs a device operation as the CPU kernel of the same operator. The CPU's `_scaled_mm`
takes either matrix in any layout and any size; CUDA's runs on cuBLASLt, which wants the first
matrix row-major and the second column-major (a weight stored `[out, in]` and passed as `w.t()`),
the inner size and both of the second matrix's sizes multiples of 16, and not both matrices in
float8 e5m2. Nor does it take a scale or a bias on the host, even a 0-dim one: the operator is
not one of TensorIterator's, whose kernels read a 0-dim host tensor as a number, so torch checks
that every tensor argument is on the device. A runner that broke one of these passed on sim and
raised on a GPU. The sim now raises CUDA's error at the call, as CUDA checks on the host before
it launches, also when the call is queued on a side stream or recorded in a capture: here for
layouts, sizes and e5m2, in torch 2.11's words on an H100 (docs/gpu-runs.md, 2026-12-05,
evening); for a host operand in the sim's host-operand check (`OpFacts.host_scalars`). The
scaling checks are left to the CPU kernel, which refuses the same calls with its own words.
"""

from __future__ import annotations

from typing import Any

import torch

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.size(1))


def _column_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) >= max(1, t.size(0))


def check_scaled_mm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    named = dict(zip(("self", "mat2"), args, strict=False)) | kwargs
    first, second = named.get("self"), named.get("mat2")
    if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
        return
    if first.dim() != 2 or second.dim() != 2:
        return  # the CPU kernel refuses these as CUDA's does
    if first.dtype not in _FLOAT8 or second.dtype not in _FLOAT8:
        return
    if first.dtype == second.dtype == torch.float8_e5m2:
        raise ValueError("Multiplication of two Float8_e5m2 matrices is not supported")
    if not (_row_major(first) and _column_major(second)):
        raise RuntimeError(
            "Only multiplication of row-major and column-major matrices is supported by cuBLASLt"
        )
    rows, inner = first.shape
    if inner % 16:
        raise RuntimeError(
            "Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: "
            f"({rows}x{inner})."
        )
    if second.size(0) % 16 or second.size(1) % 16:
        raise RuntimeError(
            f"mat2 shape ({second.size(0)}x{second.size(1)}) must be divisible by 16"
        )


CUDA_ARGUMENT_CHECKS = {
    torch.ops.aten._scaled_mm.default: check_scaled_mm,
    torch.ops.aten._scaled_mm.out: check_scaled_mm,
}
"""Operations whose CUDA kernel refuses arguments their CPU kernel takes: the check to run at the
call (`OpFacts.cuda_check`)."""
