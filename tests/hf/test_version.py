"""The adapter admits exactly the transformers releases whose private surface it was written
against, and picks the cache layout each one has."""

import importlib.metadata

import pytest
import torch

from pytest_graphmode.hf import versions
from pytest_graphmode.hf.continuous_api import ContinuousApiEngine
from pytest_graphmode.hf.engine import Engine, EngineConfig
from pytest_graphmode.hf.paged_tensors import PagedTensorsEngine
from pytest_graphmode.hf.sector_cache import SectorCacheEngine
from pytest_graphmode.hf.target import ENGINES


@pytest.mark.parametrize("version", ["5.25.0", "6.0.0", "4.57.6"])
def test_an_unsupported_release_is_refused_with_the_range_to_install(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    with pytest.raises(versions.UnsupportedTransformers) as raised:
        versions.check_version()
    assert f"transformers {version} is installed" in str(raised.value)
    assert "pip install 'transformers>=5.0,<5.25'" in str(raised.value)
    assert versions.support_problem() == str(raised.value)


@pytest.mark.parametrize(
    ("version", "layout"),
    [
        ("5.0.0", "continuous_api"),
        ("5.1.0", "continuous_api"),
        ("5.2.0", "continuous_api"),
        ("5.3.0", "continuous_api"),
        ("5.3.9.dev0", "continuous_api"),
        ("5.4.0", "paged_tensors"),
        ("5.5.4", "paged_tensors"),
        ("5.6.0", "paged_tensors"),
        ("5.6.2", "paged_tensors"),
        ("5.7.0", "paged_tensors"),
        ("5.8.1", "paged_tensors"),
        ("5.9.0", "paged_tensors"),
        ("5.10.4", "paged_tensors"),
        ("5.11.0", "paged_tensors"),
        ("5.12.1", "paged_tensors"),
        ("5.13.0", "paged_tensors"),
        ("5.14.1", "paged_tensors"),
        ("5.17.0", "paged_tensors"),
        ("5.17.3.dev0", "paged_tensors"),
        ("5.18.0", "sector_cache"),
        ("5.21.0", "sector_cache"),
        ("5.24.0", "sector_cache"),
        ("5.24.1.dev0", "sector_cache"),
    ],
)
def test_a_supported_release_is_admitted_with_its_layout(
    monkeypatch: pytest.MonkeyPatch, version: str, layout: str
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    assert versions.check_version() == version
    assert versions.support_problem() is None
    assert versions.installed_layout() == layout


def test_a_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert "pip install 'pytest-graphmode[hf]'" in (versions.support_problem() or "")


def test_every_layout_has_the_engine_that_declares_it() -> None:
    assert set(ENGINES) == set(versions.LAYOUTS)
    assert all(engine.layout == layout for layout, engine in ENGINES.items())


@pytest.mark.parametrize(
    ("version", "engine"),
    [
        ("5.17.0", SectorCacheEngine),
        ("5.24.0", PagedTensorsEngine),
        ("5.3.0", PagedTensorsEngine),
        ("5.4.0", ContinuousApiEngine),
    ],
)
def test_an_engine_refuses_a_release_of_the_other_layout(
    monkeypatch: pytest.MonkeyPatch, version: str, engine: type[Engine]
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    with pytest.raises(versions.UnsupportedTransformers) as raised:
        engine(EngineConfig(), seed=0, graphs=False, device=torch.device("cpu"))
    assert f"transformers {version} is installed" in str(raised.value)
    assert f"make the engine of its layout, {versions.layout_of(version)!r}" in str(raised.value)


@pytest.mark.parametrize(
    ("version", "split"),
    [
        ("5.0.0", False),
        ("5.3.0", False),
        ("5.6.0", False),
        ("5.11.0", False),
        ("5.12.1", False),
        ("5.13.0", True),
        ("5.17.0", True),
        ("5.24.0", True),
    ],
)
def test_the_trash_blocks_split_from_5_13(version: str, split: bool) -> None:
    assert versions.split_trash(version) is split


OLDER = {"io_object", "graph_store", "compute_stream"}
NEWER = {"maybe_pad_inputs", "model_runner", "seed_option", "max_requests_per_batch", "split_trash"}


@pytest.mark.parametrize(
    ("version", "lacks"),
    [
        ("5.0.0", set(versions.SINCE)),
        ("5.1.0", set(versions.SINCE) - {"io_object"}),
        ("5.2.0", set(versions.SINCE) - {"io_object"}),
        ("5.3.0", set(versions.SINCE) - OLDER),
        ("5.4.0", set(versions.SINCE) - OLDER),
        ("5.5.4", set(versions.SINCE) - OLDER - {"warmup"}),
        ("5.6.0", {"self_sized_warmup"} | NEWER),
        ("5.7.0", NEWER),
        ("5.8.1", NEWER - {"maybe_pad_inputs"}),
        ("5.9.0", {"max_requests_per_batch", "split_trash"}),
        ("5.10.4", {"max_requests_per_batch", "split_trash"}),
        ("5.11.0", {"split_trash"}),
        ("5.13.0", set()),
        ("5.24.0", set()),
    ],
)
def test_each_release_lacks_exactly_the_surface_it_was_read_without(
    version: str, lacks: set[str]
) -> None:
    assert {feature for feature in versions.SINCE if not versions.has(version, feature)} == lacks
