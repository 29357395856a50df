"""`Backend` is the facade's type: `backends.get` returns one, and each backend satisfies it
(mypy checks the signatures; these tests check what a user can see at run time)."""

from __future__ import annotations

import typing

import pytest
import torch

from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.backends import Backend


def test_get_is_typed_as_returning_a_backend() -> None:
    assert typing.get_type_hints(backends.get)["return"] is Backend


@pytest.mark.parametrize(
    "name",
    [
        "sim",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ],
)
def test_every_backend_has_every_member_of_the_protocol(name: str) -> None:
    assert isinstance(backends.get(name), Backend)
