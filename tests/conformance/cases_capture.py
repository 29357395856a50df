"""Capture legality: what a capturing stream refuses, and the few host crossings it accepts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.conformance.case import (
    UNCHECKED_INDEX_COPY,
    another_stream,
    case,
    index_copy_of_too_many_dims,
)

_REFUSED = "raises CaptureError"


def _attempt(be: Any, body: Callable[[torch.Tensor], object]) -> str:
    """Capture `body` applied to a small device tensor; "captured" when the capture succeeds."""
    x = torch.arange(1.0, 5.0, device=be.device)
    g = be.Graph()
    with be.graph(g):
        body(x * 1)
    return "captured"


@case(_REFUSED)
def item_reads_the_host(be: Any) -> str:
    return _attempt(be, lambda x: x.sum().item())


@case(_REFUSED)
def tolist_reads_the_host(be: Any) -> str:
    return _attempt(be, lambda x: x.tolist())


@case(_REFUSED)
def bool_of_a_tensor_reads_the_host(be: Any) -> str:
    return _attempt(be, lambda x: bool((x > 2).any()))


@case(_REFUSED)
def torch_equal_reads_the_host(be: Any) -> str:
    return _attempt(be, lambda x: torch.equal(x, x + 0))


@case(_REFUSED)
def nonzero_has_a_data_dependent_shape(be: Any) -> str:
    return _attempt(be, lambda x: torch.nonzero(x > 2))


@case(_REFUSED)
def unique_has_a_data_dependent_shape(be: Any) -> str:
    return _attempt(be, lambda x: torch.unique(x))


@case(_REFUSED)
def masked_select_has_a_data_dependent_shape(be: Any) -> str:
    return _attempt(be, lambda x: torch.masked_select(x, x > 2))


@case(_REFUSED)
def boolean_mask_indexing_has_a_data_dependent_shape(be: Any) -> str:
    return _attempt(be, lambda x: x[x > 2])


@case(_REFUSED)
def repeat_interleave_without_output_size(be: Any) -> str:
    return _attempt(be, lambda x: torch.repeat_interleave(x, x.long()))


@case("captured")
def repeat_interleave_with_output_size(be: Any) -> str:
    return _attempt(be, lambda x: torch.repeat_interleave(x, x.long(), output_size=10))


@case("captured")
def device_factories_are_captured(be: Any) -> str:
    def body(x: torch.Tensor) -> None:
        torch.zeros(4, device=be.device) + torch.arange(4, device=be.device) + x
        torch.full((4,), 3.0, device=be.device).mul_(x)

    return _attempt(be, body)


@case(_REFUSED)
def synchronize_during_capture(be: Any) -> str:
    return _attempt(be, lambda x: be.synchronize())


@case(_REFUSED)
def event_query_during_capture(be: Any) -> str:
    done = be.Event()
    done.record()  # a real event, recorded and completed before the capture
    be.synchronize()
    return _attempt(be, lambda x: done.query())


@case(_REFUSED)
def event_synchronize_during_capture(be: Any) -> str:
    done = be.Event()
    done.record()
    be.synchronize()
    return _attempt(be, lambda x: done.synchronize())


@case(_REFUSED)
def stream_synchronize_during_capture(be: Any) -> str:
    return _attempt(be, lambda x: be.current_stream().synchronize())


@case(_REFUSED)
def another_stream_synchronized_during_capture(be: Any) -> str:
    # torch captures in CUDA's global mode, where waiting for any stream is unsafe, not only for
    # the capturing one: the capture ends with an error.
    return _attempt(be, lambda x: another_stream(be).synchronize())


@case(_REFUSED)
def stream_query_during_capture(be: Any) -> str:
    return _attempt(be, lambda x: be.current_stream().query())


@case(_REFUSED)
def graph_on_the_default_stream(be: Any) -> str:
    g = be.Graph()
    with be.graph(g, stream=be.default_stream()):
        torch.ones(4, device=be.device) * 2
    return "captured"


@case("refused")
def capture_begin_on_the_default_stream(be: Any) -> str:
    g = be.Graph()
    with be.stream(be.default_stream()):
        try:
            g.capture_begin()
        except RuntimeError:
            return "refused"
        g.capture_end()
    return "captured"


@case("captured")
def capture_on_a_stream_passed_to_graph(be: Any) -> str:
    g = be.Graph()
    with be.graph(g, stream=be.Stream()):
        torch.ones(4, device=be.device) * 2
    return "captured"


# -- host <-> device crossings ------------------------------------------------------------------


@case(_REFUSED)
def cpu_copies_to_the_host(be: Any) -> str:
    return _attempt(be, lambda x: x.cpu())


@case(_REFUSED)
def blocking_copy_device_to_pageable(be: Any) -> str:
    host = torch.zeros(4)
    return _attempt(be, lambda x: host.copy_(x))


@case(_REFUSED)
def blocking_copy_pageable_to_device(be: Any) -> str:
    host = torch.ones(4)
    return _attempt(be, lambda x: x.copy_(host))


@case(_REFUSED)
def blocking_copy_device_to_pinned(be: Any) -> str:
    pinned = be.empty_pinned(4)
    return _attempt(be, lambda x: pinned.copy_(x))


@case(_REFUSED)
def blocking_copy_pinned_to_device(be: Any) -> str:
    pinned = be.empty_pinned(4)
    pinned.fill_(1.0)
    return _attempt(be, lambda x: x.copy_(pinned))


@case(_REFUSED)
def non_blocking_copy_pageable_to_device(be: Any) -> str:
    host = torch.ones(4)
    return _attempt(be, lambda x: x.copy_(host, non_blocking=True))


@case(_REFUSED)
def non_blocking_copy_device_to_pageable(be: Any) -> str:
    host = torch.zeros(4)
    return _attempt(be, lambda x: host.copy_(x, non_blocking=True))


@case(_REFUSED)
def tensor_constant_uploaded_during_capture(be: Any) -> str:
    return _attempt(be, lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0], device=be.device))


@case("captured")
def non_blocking_copy_pinned_to_device(be: Any) -> str:
    pinned = be.empty_pinned(4)
    pinned.fill_(1.0)
    return _attempt(be, lambda x: x.copy_(pinned, non_blocking=True))


@case("captured")
def non_blocking_copy_device_to_pinned(be: Any) -> str:
    pinned = be.empty_pinned(4)
    return _attempt(be, lambda x: pinned.copy_(x, non_blocking=True))


@case("raises IndexError at the call", pending=UNCHECKED_INDEX_COPY)
def argument_error_in_a_capture_raises_at_the_call(be: Any) -> str:
    copy = index_copy_of_too_many_dims(be)
    g = be.Graph()
    try:
        with be.graph(g):
            copy()
    except IndexError as exc:
        return f"raises {type(exc).__name__} at the call"
    return "captured"
