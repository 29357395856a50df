"""The adapter admits only the transformers releases whose private surface it was written against."""

import importlib.metadata

import pytest

from pytest_graphmode.hf import engine


@pytest.mark.parametrize("version", ["5.12.1", "5.18.0", "6.0.0", "4.57.6"])
def test_an_unsupported_release_is_refused_with_the_range_to_install(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    with pytest.raises(engine.UnsupportedTransformers) as raised:
        engine.check_version()
    assert f"transformers {version} is installed" in str(raised.value)
    assert "pip install 'transformers>=5.13,<5.18'" in str(raised.value)


@pytest.mark.parametrize("version", ["5.13.0", "5.14.1", "5.17.0", "5.17.3.dev0"])
def test_a_supported_release_is_admitted(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    assert engine.check_version() == version
    assert engine.support_problem() is None


def test_a_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert "pip install 'pytest-graphmode[hf]'" in (engine.support_problem() or "")
