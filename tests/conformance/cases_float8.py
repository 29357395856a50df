"""float8 matrix products (`torch._scaled_mm`): which calls CUDA's kernel takes. Its checks run
on the host at the call, outside a capture and inside one alike; the CPU's kernel takes layouts
and sizes CUDA's refuses, so a runner written against the CPU's passes on a host and fails on a
GPU."""

from __future__ import annotations

from typing import Any

import torch

from tests.conformance.case import case

_F8 = torch.float8_e4m3fn


def _scaled_mm(
    be: Any, rows: int, inner: int, cols: int, second_row_major: bool, dtype: torch.dtype = _F8
) -> str:
    x = torch.randn(rows, inner, device=be.device).to(dtype)
    if second_row_major:
        w = torch.randn(inner, cols, device=be.device).to(dtype)
    else:
        w = torch.randn(cols, inner, device=be.device).to(dtype).t()  # column-major
    one = torch.ones((), device=be.device)
    out = torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    expected = (x.float() @ w.float()).to(torch.bfloat16)
    same = torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-2)
    return f"ran, {'as' if same else 'unlike'} float32 on the same values"


@case("ran, as float32 on the same values")
def scaled_mm_takes_a_row_major_first_and_column_major_second_matrix(be: Any) -> str:
    return _scaled_mm(be, 16, 32, 16, second_row_major=False)


@case("ran, as float32 on the same values")
def scaled_mm_takes_a_row_count_not_a_multiple_of_16(be: Any) -> str:
    return _scaled_mm(be, 5, 32, 16, second_row_major=False)


@case("raises RuntimeError")
def scaled_mm_refuses_a_row_major_second_matrix(be: Any) -> str:
    return _scaled_mm(be, 16, 32, 16, second_row_major=True)


@case("raises RuntimeError")
def scaled_mm_refuses_an_inner_size_not_a_multiple_of_16(be: Any) -> str:
    return _scaled_mm(be, 16, 24, 16, second_row_major=False)


@case("raises ValueError")
def scaled_mm_refuses_two_e5m2_matrices(be: Any) -> str:
    return _scaled_mm(be, 16, 32, 16, second_row_major=False, dtype=torch.float8_e5m2)


@case("raises RuntimeError")
def scaled_mm_refuses_0_dim_scales_on_the_host(be: Any) -> str:
    # Not a TensorIterator operator: a 0-dim host tensor is no number to it, and torch checks
    # that every tensor argument is on the device.
    x = torch.randn(16, 32, device=be.device).to(_F8)
    w = torch.randn(16, 32, device=be.device).to(_F8).t()
    one = torch.ones(())
    torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return "ran"


@case("raises RuntimeError")
def scaled_mm_refuses_a_row_major_second_matrix_in_a_capture(be: Any) -> str:
    x = torch.randn(16, 32, device=be.device).to(_F8)
    w = torch.randn(32, 16, device=be.device).to(_F8)
    one = torch.ones((), device=be.device)
    g = be.Graph()
    with be.graph(g):
        torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return "captured"


@case("raises RuntimeError")
def scaled_mm_refuses_a_row_major_second_matrix_on_a_side_stream(be: Any) -> str:
    x = torch.randn(16, 32, device=be.device).to(_F8)
    w = torch.randn(32, 16, device=be.device).to(_F8)
    one = torch.ones((), device=be.device)
    side = be.Stream()
    side.wait_stream(be.current_stream())
    with be.stream(side):
        torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    be.synchronize()
    return "ran"
