"""The types a user touches come from the package top, without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pytest_graphmode

USER_TYPES = (
    "GraphmodeFailure",
    "Failure",
    "CampaignStats",
    "GraphmodeFuzz",
    "Twins",
    "Stress",
    "Timing",
    "Comparison",
)


def test_every_exported_name_resolves() -> None:
    for name in pytest_graphmode.__all__:
        assert getattr(pytest_graphmode, name) is not None, name
    assert set(USER_TYPES) <= set(pytest_graphmode.__all__)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        _ = pytest_graphmode.Nothing  # type: ignore[attr-defined]


def test_user_types_import_without_torch() -> None:
    code = (
        f"import sys; from pytest_graphmode import {', '.join(USER_TYPES)}; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_engine_raises_the_exported_failure_type() -> None:
    from pytest_graphmode import fuzz

    assert fuzz.GraphmodeFailure is pytest_graphmode.GraphmodeFailure
    assert fuzz.CampaignStats is pytest_graphmode.CampaignStats
