"""Which calls of `scaled_dot_product_attention` run, with the kernels `sdpa_kernel` leaves
enabled: torch takes the first enabled kernel the inputs suit and raises when none is left. The
CPU's kernels follow other rules than a GPU's (runtime/backends/sim/attention.py), so each case is
a call the two used to answer differently, or one on the edge of a GPU kernel's rules."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from pytest_graphmode.runtime import backends
from tests.conformance.case import case

FLASH, EFFICIENT, MATH = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def _attend(
    be: Any,
    kernels: list[SDPBackend],
    *,
    dtype: torch.dtype = torch.float16,
    queries: int = 1,
    keys: int = 5,
    head_size: int = 64,
    value_head_size: int | None = None,
    mask: bool = False,
    additive_mask: torch.dtype | None = None,
    lower_right: bool = False,
    causal: bool = False,
    autocast: torch.dtype | None = None,
    kv_heads: int = 4,
) -> str:
    """One SDPA call with only `kernels` enabled: "ran, as math on the host computes it", "no
    kernel" or the efficient kernel's refusal of the mask; any other error escapes as the case's
    outcome."""
    grouped = kv_heads != 4
    with backends.target_scope(be.name):
        g = torch.Generator().manual_seed(0)
        host = [
            torch.randn(2, h, n, d, generator=g).to(dtype)
            for h, n, d in (
                (4, queries, head_size),
                (kv_heads, keys, head_size),
                (kv_heads, keys, value_head_size or head_size),
            )
        ]
        attn_mask: Any = torch.rand(2, 1, queries, keys, generator=g) > 0.3 if mask else None
        if attn_mask is not None:
            attn_mask[..., 0] = True  # every query sees a key: no row of NaNs
        if additive_mask is not None:
            attn_mask = torch.randn(2, 1, queries, keys, generator=g).to(additive_mask)
        q, k, v = (t.to(be.device) for t in host)
        device_mask = None if attn_mask is None else attn_mask.to(be.device)
        if lower_right:  # no tensor of its own: the same object on both sides
            attn_mask = device_mask = causal_lower_right(queries, keys)
        with sdpa_kernel([MATH]):
            expected = F.scaled_dot_product_attention(
                *(t.float() for t in host),
                attn_mask=attn_mask.float() if additive_mask is not None else attn_mask,
                is_causal=causal,
                enable_gqa=grouped,
            )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's reasons for each kernel it left out
                with sdpa_kernel(kernels):
                    if autocast is None:
                        out = F.scaled_dot_product_attention(
                            q, k, v, attn_mask=device_mask, is_causal=causal, enable_gqa=grouped
                        )
                    else:
                        with torch.autocast("cuda", dtype=autocast):
                            out = F.scaled_dot_product_attention(
                                q, k, v, attn_mask=device_mask, is_causal=causal, enable_gqa=grouped
                            )
        except RuntimeError as exc:
            if "No available kernel" in str(exc):
                return "no kernel"
            if "invalid dtype for bias" in str(exc):
                return "the kernel refuses the mask's dtype"
            raise
        close = torch.allclose(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)
        return "ran, as math on the host computes it" if close else "ran, with other values"


RAN = "ran, as math on the host computes it"


@case("no kernel")
def flash_alone_refuses_a_mask(be: Any) -> str:
    return _attend(be, [FLASH], mask=True)


@case("no kernel")
def flash_alone_refuses_float32(be: Any) -> str:
    return _attend(be, [FLASH], dtype=torch.float32)


@case(RAN)
def flash_alone_takes_float32_under_autocast(be: Any) -> str:
    return _attend(be, [FLASH], dtype=torch.float32, autocast=torch.float16)


@case("no kernel")
def flash_alone_refuses_causal_with_fewer_queries_than_keys(be: Any) -> str:
    return _attend(be, [FLASH], queries=2, causal=True)


@case("no kernel")
def flash_alone_refuses_a_head_size_over_256(be: Any) -> str:
    return _attend(be, [FLASH], head_size=320)


@case(RAN)
def efficient_alone_takes_float32_and_a_mask(be: Any) -> str:
    return _attend(be, [EFFICIENT], dtype=torch.float32, mask=True)


@case("no kernel")
def efficient_alone_refuses_a_half_head_size_not_a_multiple_of_8(be: Any) -> str:
    return _attend(be, [EFFICIENT], head_size=20)


@case(RAN)
def flash_or_efficient_take_a_value_head_size_unlike_the_query_s(be: Any) -> str:
    return _attend(be, [FLASH, EFFICIENT], value_head_size=32)


@case(RAN)
def math_alone_runs_causal_with_fewer_queries_than_keys(be: Any) -> str:
    return _attend(be, [MATH], queries=2, causal=True)


@case(RAN)
def math_alone_runs_causal_square(be: Any) -> str:
    return _attend(be, [MATH], queries=5, causal=True)


@case("no kernel")
def efficient_alone_refuses_grouped_query_heads(be: Any) -> str:
    # torch 2.11 on an H200 (2026-12-05); the efficient kernel of later sources takes them.
    return _attend(be, [EFFICIENT], kv_heads=2)


@case(RAN)
def flash_alone_takes_grouped_query_heads(be: Any) -> str:
    return _attend(be, [FLASH], kv_heads=2)


@case("the kernel refuses the mask's dtype")
def efficient_alone_refuses_a_float32_mask_with_half_inputs(be: Any) -> str:
    # Checked inside the kernel once chosen ("invalid dtype for bias"): no other kernel is tried.
    return _attend(be, [EFFICIENT], additive_mask=torch.float32)


@case(RAN)
def efficient_alone_takes_a_half_mask_with_half_inputs(be: Any) -> str:
    return _attend(be, [EFFICIENT], additive_mask=torch.float16)


@case(RAN)
def a_lower_right_causal_bias_runs_on_the_efficient_kernel(be: Any) -> str:
    return _attend(be, [EFFICIENT], dtype=torch.float32, queries=2, lower_right=True)


@case("no kernel")
def a_lower_right_causal_bias_in_float32_has_no_kernel_with_flash_alone(be: Any) -> str:
    return _attend(be, [FLASH], dtype=torch.float32, queries=2, lower_right=True)


@case("value matches eager")
def math_alone_causal_in_a_capture_replays_new_inputs(be: Any) -> str:
    # The math kernel makes its causal mask inside the capture: from the graph's pool on CUDA.
    with backends.target_scope(be.name):
        q = torch.randn(1, 2, 3, 16, device=be.device)
        kv = torch.randn(1, 2, 5, 16, device=be.device)
        with sdpa_kernel([MATH]):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True)  # warm-up
            be.synchronize()
            g = be.Graph()
            with be.graph(g):
                out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
            q.copy_(torch.randn(1, 2, 3, 16, device=be.device))
            g.replay()
            expected = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        be.synchronize()
        same = torch.allclose(out.cpu(), expected.cpu(), atol=1e-5)
        return "value matches eager" if same else "value is stale"
