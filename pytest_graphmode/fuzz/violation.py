"""A check's verdict on one step, with everything a person needs to find the fault."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch


@dataclass(frozen=True)
class Violation:
    """One broken rule: which check, what went wrong, and where (request, row, slot)."""

    check: str
    detail: str
    req_id: int | None = None
    row: int | None = None
    slot: int | None = None
    expected: str | None = None
    actual: str | None = None

    def describe(self) -> str:
        where = [
            f"{name}={value}"
            # "batch_row": the request's row in the batch, which a runner that keeps requests in
            # slots of its own may replay at another row of its graph.
            for name, value in (
                ("req_id", self.req_id),
                ("batch_row", self.row),
                ("slot", self.slot),
            )
            if value is not None
        ]
        lines = [self.detail]
        if where:
            lines.append("at " + ", ".join(where))
        if self.expected is not None:
            lines.append(f"expected: {self.expected}")
        if self.actual is not None:
            lines.append(f"actual:   {self.actual}")
        return "\n".join(lines)


class Texts(TypedDict):
    expected: str
    actual: str


def differences(
    expected: torch.Tensor, actual: torch.Tensor, equal: torch.Tensor | None = None
) -> Texts:
    """`expected=` / `actual=` texts for a `Violation`: the first element where `equal` (default:
    bitwise equality, NaN equal to NaN) is False, both values there and how many elements differ,
    instead of two whole rows a person cannot scan."""
    expected, actual = expected.detach().cpu(), actual.detach().cpu()
    if equal is None:
        equal = (expected == actual) | (expected != expected) & (actual != actual)
    differing = ~equal
    if not bool(differing.any()):
        # The fault is elsewhere (e.g. the same logits sampled to different tokens): say so
        # rather than pick an element.
        same = f"all {equal.numel()} elements equal"
        return {"expected": same, "actual": same}
    index = tuple(int(i) for i in differing.nonzero()[0])
    where = f"element {index}" if index else "value"
    return {
        "expected": f"{where} = {expected[index].item()!r}",
        "actual": f"{where} = {actual[index].item()!r} "
        f"({int(differing.sum())} of {equal.numel()} elements differ)",
    }
