"""pytest-graphmode: property-based fuzzing of graph-mode (CUDA Graph) LLM inference.

Only the contract is imported eagerly; it needs no torch at import time, so pytest can load the
plugin for every run at no cost.
"""

from pytest_graphmode.contract import (
    CONTRACT_VERSION,
    AddressView,
    Batch,
    GraphTarget,
    Request,
    StepResult,
    TargetFactory,
    TargetSpec,
)

__all__ = [
    "CONTRACT_VERSION",
    "AddressView",
    "Batch",
    "GraphTarget",
    "Request",
    "StepResult",
    "TargetFactory",
    "TargetSpec",
]
