"""`torch.autocast("cuda")` on the sim.

The sim's device tensors are CPU tensors to torch's dispatcher, which CUDA's autocast never sees:
the drop-in's `autocast("cuda")` runs its block under the CPU's autocast instead, with the dtype
CUDA's would use (float16 unless told). The CPU's autocast casts a different set of operations,
so for the operations CUDA's casts and the CPU's leaves alone, the sim adds CUDA's casts to the
CPU's autocast (kernels at its dispatch key, registered at the first use and doing nothing but
pass through outside a CUDA autocast block): softmax, norms, `exp`, `sum` and the rest of CUDA's
float32 list compute in float32, `mv` and `addmv` in the low precision, and `index_put`,
`addcmul` and the rest of CUDA's promote list at the widest floating type of their inputs. An
operation both autocasts cast keeps the CPU's cast (matmuls, linear layers, convolutions and
attention go to the low precision on both).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

# CUDA's lists (ATen's autocast_mode.h), as (operation, overload) names.
_TO_FLOAT32 = (
    *(
        (name, "default")
        for name in [
            "acos",
            "asin",
            "cosh",
            "erfinv",
            "exp",
            "expm1",
            "log",
            "log10",
            "log2",
            "log1p",
            "reciprocal",
            "rsqrt",
            "sinh",
            "tan",
            "softplus",
            "layer_norm",
            "native_layer_norm",
            "rms_norm",
            "group_norm",
            "nuclear_norm",
            "cosine_similarity",
            "poisson_nll_loss",
            "cosine_embedding_loss",
            "nll_loss",
            "nll_loss2d",
            "hinge_embedding_loss",
            "kl_div",
            "l1_loss",
            "smooth_l1_loss",
            "huber_loss",
            "mse_loss",
            "margin_ranking_loss",
            "multilabel_margin_loss",
            "soft_margin_loss",
            "triplet_margin_loss",
            "multi_margin_loss",
            "binary_cross_entropy_with_logits",
            "dist",
            "pdist",
            "cdist",
            "renorm",
            "logsumexp",
        ]
    ),
    ("pow", "Tensor_Scalar"),
    ("pow", "Tensor_Tensor"),
    ("pow", "Scalar"),
    ("frobenius_norm", "dim"),
    ("nuclear_norm", "dim"),
)
_FLOAT32_UNLESS_TOLD = (
    ("prod", "default"),
    ("prod", "dim_int"),
    ("softmax", "int"),
    ("log_softmax", "int"),
    ("cumprod", "default"),
    ("cumsum", "default"),
    ("linalg_vector_norm", "default"),
    ("linalg_matrix_norm", "default"),
    ("linalg_matrix_norm", "str_ord"),
    ("sum", "default"),
    ("sum", "dim_IntList"),
)
_TO_LOW_PRECISION = tuple(
    (name, "default")
    for name in [
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "einsum",
        "mm",
        "mv",
        "bmm",
        "baddbmm",
        "addbmm",
        "chain_matmul",
        "linalg_multi_dot",
        "linear",
        "prelu",
        "scaled_dot_product_attention",
    ]
)
_TO_WIDEST = tuple(
    (name, "default")
    for name in [
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "vdot",
        "grid_sampler",
        "index_put",
        "tensordot",
        "scatter_add",
    ]
)

_LOW = (torch.float16, torch.bfloat16)
_CPU_AUTOCAST_OFF = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


class _Blocks(threading.local):
    """How deep the current thread is in CUDA autocast blocks (autocast state is per thread)."""

    depth = 0


_blocks = _Blocks()
_library: Any = None


class SimAutocast(torch.amp.autocast_mode.autocast):
    """`torch.autocast(device_type, ...)` in the drop-in: "cuda" is the CPU's autocast with CUDA's
    casts (module docstring); any other device type is torch's own."""

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        self._sim_cuda = device_type == "cuda"
        if self._sim_cuda:
            _register_cuda_casts()
            dtype = torch.get_autocast_dtype("cuda") if dtype is None else dtype
            device_type = "cpu"
        super().__init__(device_type, dtype, enabled, cache_enabled)

    def __enter__(self) -> None:
        if self._sim_cuda:
            _blocks.depth += 1
        super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._sim_cuda:
            _blocks.depth -= 1


class SimCudaAutocast(SimAutocast):
    """`torch.cuda.amp.autocast(...)`, torch's deprecated spelling of `autocast("cuda", ...)`."""

    def __init__(
        self,
        enabled: bool = True,
        dtype: torch.dtype = torch.float16,
        cache_enabled: bool = True,
    ) -> None:
        super().__init__("cuda", dtype, enabled, cache_enabled)


def autocast_query(host_query: Callable[..., bool]) -> Callable[..., bool]:
    """`torch.is_autocast_enabled("cuda")` (and the bare legacy form, which means CUDA) answers
    whether the drop-in's autocast is on."""

    def query(device_type: str | None = None) -> bool:
        return bool(host_query("cpu" if device_type in (None, "cuda") else device_type))

    return query


def _register_cuda_casts() -> None:
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    policies: tuple[tuple[Any, Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]], ...] = (
        (_TO_FLOAT32, _to_float32),
        (_FLOAT32_UNLESS_TOLD, _float32_unless_told),
        (_TO_LOW_PRECISION, _to_low_precision),
        (_TO_WIDEST, _to_widest),
    )
    for names, policy in policies:
        for name, overload in names:
            qualified = f"aten::{name}" + ("" if overload == "default" else f".{overload}")
            if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "AutocastCPU"):
                continue  # the CPU's autocast casts it already
            op = getattr(getattr(torch.ops.aten, name), overload)
            library.impl(qualified.removeprefix("aten::"), _kernel(op, policy), "AutocastCPU")
    _library = library


def _kernel(op: Any, policy: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_CPU_AUTOCAST_OFF):
            if _blocks.depth == 0:
                return op(*args, **kwargs)
            return policy(op, args, kwargs)

    return kernel


def _cast_all(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, only: tuple[torch.dtype, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments, every tensor of a dtype in `only` cast to `dtype` (in lists too)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype in only else t

    cast_args, cast_kwargs = tree_map_only(torch.Tensor, cast, (args, kwargs))
    return cast_args, cast_kwargs


def _to_float32(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    args, kwargs = _cast_all(args, kwargs, torch.float32, _LOW)
    return op(*args, **kwargs)


def _float32_unless_told(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # A dtype the caller named wins; else a floating input computes and returns float32.
    first = args[0]
    told = kwargs.get("dtype")
    if told is None and isinstance(first, torch.Tensor) and first.dtype in _LOW:
        kwargs = dict(kwargs, dtype=torch.float32)
    return op(*args, **kwargs)


def _to_low_precision(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    args, kwargs = _cast_all(args, kwargs, torch.get_autocast_dtype("cpu"), (torch.float32,))
    return op(*args, **kwargs)


def _to_widest(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    floating = [
        t.dtype
        for t in (*args, *kwargs.values())
        if isinstance(t, torch.Tensor) and t.dtype in (*_LOW, torch.float32, torch.float64)
    ]
    if not floating:
        return op(*args, **kwargs)
    widest = max(floating, key=lambda d: torch.finfo(d).bits)
    args, kwargs = _cast_all(args, kwargs, widest, tuple(d for d in floating if d != widest))
    return op(*args, **kwargs)
