"""Item 4: staging a step's inputs with one packed non-blocking copy (what `StaticInputs` does)
vs one non-blocking copy per field, at the static inputs' maximum shape."""

from __future__ import annotations

from typing import Any

import torch
from graph_workloads import Suite, make_executor

from pytest_graphmode.benchmark import GraphBenchmark
from pytest_graphmode.runtime.model import Decoder


def test_packed_copy_vs_copy_per_field(
    graphmode_benchmark: GraphBenchmark, graphmode_backend: Any, decoder: Decoder, suite: Suite
) -> None:
    executor = make_executor(decoder, graphmode_backend, [max(suite.capture_schedule)])
    try:
        fields = executor.inputs.tensors()
    finally:
        executor.close()
    device = graphmode_backend.device
    host_fields = {
        name: graphmode_backend.empty_pinned(tuple(t.shape), dtype=t.dtype)
        for name, t in fields.items()
    }
    device_fields = {name: torch.empty_like(t, device=device) for name, t in fields.items()}
    nbytes = sum(t.numel() * t.element_size() for t in fields.values())
    host_packed = graphmode_backend.empty_pinned(nbytes, dtype=torch.uint8)
    device_packed = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def packed() -> None:
        device_packed.copy_(host_packed, non_blocking=True)

    def per_field() -> None:
        for name, target in device_fields.items():
            target.copy_(host_fields[name], non_blocking=True)

    graphmode_benchmark.extra_info.update(staged_bytes=nbytes, fields=len(fields))
    medians = graphmode_benchmark.compare({"packed_copy": packed, "copy_per_field": per_field})
    if medians is not None:
        ratio = medians["copy_per_field"] / medians["packed_copy"]
        graphmode_benchmark.extra_info["per_field_over_packed"] = ratio
