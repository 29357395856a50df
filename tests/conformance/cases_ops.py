"""Operations a capture takes or refuses on CUDA for reasons of their own: a host read hidden in
the kernel (a value read with .item(), an output sized on the host), a host value copied to the
device first, or a host check on other devices that CUDA leaves to the device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.conformance.case import case

_REFUSED = "raises CaptureError"


def _attempt(be: Any, body: Callable[[torch.Tensor, torch.Tensor], object]) -> str:
    """Capture `body` applied to small device tensors of values and of indices."""
    x = torch.arange(16.0, device=be.device)
    index = torch.tensor([0, 3, 3, 5], device=be.device)
    g = be.Graph()
    with be.graph(g):
        body(x * 1, index + 0)
    return "captured"


def _masked_set(value: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor, Any], None]:
    def body(x: torch.Tensor, index: torch.Tensor) -> None:
        x[x > 7] = value(x)

    return body


@case("captured")
def masked_assignment_of_a_number(be: Any) -> str:
    # A top-p sampler's `logits[cumulative > p] = -inf`: CUDA makes it a masked_fill.
    return _attempt(be, _masked_set(lambda x: float("-inf")))


@case("captured")
def masked_assignment_of_a_host_scalar_tensor(be: Any) -> str:
    return _attempt(be, _masked_set(lambda x: torch.tensor(0.0)))


@case(_REFUSED)
def masked_assignment_of_a_device_scalar(be: Any) -> str:
    return _attempt(be, _masked_set(lambda x: x[1] * 2))


@case(_REFUSED)
def masked_accumulation(be: Any) -> str:
    return _attempt(
        be,
        lambda x, i: x.index_put_((x > 7,), torch.ones((), device=be.device), accumulate=True),
    )


@case(_REFUSED)
def index_assignment_of_a_number(be: Any) -> str:
    # `table[rows] = 0` with device rows: CUDA copies the number to the device first.
    def body(x: torch.Tensor, index: torch.Tensor) -> None:
        x[index] = 1.0

    return _attempt(be, body)


@case("captured")
def index_assignment_of_device_values(be: Any) -> str:
    def body(x: torch.Tensor, index: torch.Tensor) -> None:
        x[index] = x[:4] * 2

    return _attempt(be, body)


@case(_REFUSED)
def masked_fill_with_a_device_scalar(be: Any) -> str:
    return _attempt(be, lambda x, i: x.masked_fill(x > 7, x[2]))


@case("captured")
def masked_fill_with_a_number(be: Any) -> str:
    return _attempt(be, lambda x, i: x.masked_fill(x > 7, 0.0))


@case(_REFUSED)
def index_fill_with_a_device_scalar(be: Any) -> str:
    return _attempt(be, lambda x, i: x.index_fill(0, i, x[2]))


@case(_REFUSED)
def bincount_sizes_its_output_on_the_host(be: Any) -> str:
    return _attempt(be, lambda x, i: torch.bincount(i, minlength=8))


@case(_REFUSED)
def histc_without_a_range_reads_it_on_the_host(be: Any) -> str:
    return _attempt(be, lambda x, i: torch.histc(x, bins=4))


@case("captured")
def histc_with_a_range(be: Any) -> str:
    return _attempt(be, lambda x, i: torch.histc(x, bins=4, min=0, max=16))


@case("captured")
def one_hot_with_its_number_of_classes(be: Any) -> str:
    # An MoE router's one_hot(expert_ids, num_experts): checked on the host on every device but
    # CUDA, which leaves out-of-range ids to a device-side assert.
    return _attempt(be, lambda x, i: torch.nn.functional.one_hot(i, 8))


@case(_REFUSED)
def one_hot_without_its_number_of_classes(be: Any) -> str:
    return _attempt(be, lambda x, i: torch.nn.functional.one_hot(i))


@case("[3, 4] on the device")
def one_hot_outside_a_capture_counts_its_classes(be: Any) -> str:
    ids = torch.tensor([1, 0, 3], device=be.device)
    hot = torch.nn.functional.one_hot(ids)
    where = "on the device" if hot.device == ids.device else "on the host"
    return f"{list(hot.shape)} {where}"


@case(_REFUSED)
def normal_with_a_tensor_std_checks_it_on_the_host(be: Any) -> str:
    return _attempt(be, lambda x, i: torch.normal(x, torch.ones_like(x)))


@case("captured")
def normal_with_a_number_std(be: Any) -> str:
    return _attempt(be, lambda x, i: torch.normal(x, 1.0))


@case("value=[0, 2, 0, 1, 2, 1] on the device")
def combinations_makes_its_inner_mask_on_the_device(be: Any) -> str:
    # Its C++ builds a mask with the input's options: device memory on CUDA, where the sim's
    # dispatcher saw a host tensor made amid device work.
    pairs = torch.combinations(torch.tensor([0, 2, 1], device=be.device))
    where = "on the device" if pairs.device == be.device else "on the host"
    be.synchronize()
    return f"value={pairs.flatten().tolist()} {where}"


@case(_REFUSED)
def combinations_in_a_capture_sizes_its_output_on_the_host(be: Any) -> str:
    # masked_select inside: its output's size is read back from the device.
    return _attempt(be, lambda x, i: torch.combinations(x[:4]))
