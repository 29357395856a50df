"""pytest-graphmode: property-based fuzzing of graph-mode (CUDA Graph) LLM inference.

The types a user touches are exported here. None of them needs torch at import time, so pytest can
load the plugin for every run at no cost; the fixture and benchmark types are imported on first
use, since their modules import pytest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_graphmode.campaign_stats import CampaignStats
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
from pytest_graphmode.failure import Failure, GraphmodeFailure
from pytest_graphmode.strategies.plans import Stress

if TYPE_CHECKING:
    from pytest_graphmode.benchmark import Comparison, Timing
    from pytest_graphmode.fixtures import GraphmodeFuzz, Twins

__all__ = [
    "CONTRACT_VERSION",
    "AddressView",
    "Batch",
    "CampaignStats",
    "Comparison",
    "Failure",
    "GraphTarget",
    "GraphmodeFailure",
    "GraphmodeFuzz",
    "Request",
    "StepResult",
    "Stress",
    "TargetFactory",
    "TargetSpec",
    "Timing",
    "Twins",
]


def __getattr__(name: str) -> Any:
    if name in ("GraphmodeFuzz", "Twins"):
        from pytest_graphmode import fixtures

        return getattr(fixtures, name)
    if name in ("Comparison", "Timing"):
        from pytest_graphmode import benchmark

        return getattr(benchmark, name)
    raise AttributeError(f"module 'pytest_graphmode' has no attribute {name!r}")
