"""`torch.compile` in the drop-in: the compiled function's own Python, run op by op on the sim.

Dynamo does not trace while a dispatch mode it does not know is active, and the sim's device is
one: under the sim every frame `torch.compile` meets is skipped and runs as plain Python. That
keeps the function's meaning (the sim runs each of its operations as a GPU would, captures
included), but it hid two things from a runner's author. `fullgraph=True`, which promises that
nothing is skipped, raised Dynamo's "found no compiled frames" on a runner that compiles on a GPU.
And a compile that captures CUDA graphs itself (`mode="reduce-overhead"`, CUDAGraph Trees) or
hands its graph to a backend of the runner's own (vLLM's piecewise capture lives in one) ran
without any of its graphs: a runner whose graphs only such a compile makes was tested eagerly on
sim while it claimed graph mode.

So inside the drop-in `torch.compile` returns the model or function itself for the backends whose
compiled code means what the Python means (Inductor without CUDA graphs, `eager`, `aot_eager`),
and refuses, at the call, a compile whose graphs the sim would never build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pytest_graphmode.runtime.backends.sim.limits import SimUnsupportedError

# torch's own backends whose compiled code computes what the Python computes, with no graphs of
# their own: the sim runs the Python.
PLAIN_BACKENDS = frozenset({"inductor", "eager", "aot_eager", "aot_eager_decomp_partition"})
# Inductor's modes that capture CUDA graphs (CUDAGraph Trees) around the compiled code.
CUDA_GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})


_WHY = (
    "the sim runs a compiled function's Python, and the CUDA graphs this compile captures itself "
    "would never be built (capture with torch.cuda.graph around the compiled code instead)"
)


def graphs_built_by(backend: Any, mode: str | None, options: Mapping[str, Any] | None) -> str:
    """What CUDA graphs a `torch.compile` with these arguments builds itself, described for the
    message that refuses it; "" when it builds none."""
    if backend == "cudagraphs":
        return "backend='cudagraphs' (CUDA graphs of the traced graph)"
    if not isinstance(backend, str) or backend not in PLAIN_BACKENDS:
        return (
            f"backend={backend!r} (a backend of the runner's own: Dynamo does not trace under the "
            "sim, so whatever graphs the backend captures would never be built)"
        )
    if mode in CUDA_GRAPH_MODES:
        return f"mode={mode!r} (CUDAGraph Trees)"
    if options and options.get("triton.cudagraphs"):
        return "options={'triton.cudagraphs': True} (CUDAGraph Trees)"
    return ""


def sim_compile(host_compile: Callable[..., Any]) -> Callable[..., Any]:
    """The drop-in's `torch.compile`, with torch's own signature (`host_compile` is torch's)."""

    def compile(
        model: Any = None,
        *,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        backend: Any = "inductor",
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
        disable: bool = False,
    ) -> Any:
        if model is None:  # @torch.compile(mode=...) as a decorator
            return lambda fn: compile(
                fn,
                fullgraph=fullgraph,
                dynamic=dynamic,
                backend=backend,
                mode=mode,
                options=options,
                disable=disable,
            )
        if mode is not None and options is not None:
            # torch's own refusal, so a runner that does this fails on sim as on a GPU.
            return host_compile(model, mode=mode, options=options, disable=disable)
        if disable:
            return model
        graphs = graphs_built_by(backend, mode, options)
        if graphs:
            raise SimUnsupportedError(f"torch.compile with {graphs}", _WHY)
        return model

    compile.__doc__ = host_compile.__doc__
    return compile
