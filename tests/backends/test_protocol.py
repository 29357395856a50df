"""`Backend` is the facade's type: `backends.get` returns one, and each backend satisfies it
(mypy checks the signatures; these tests check what a user can see at run time)."""

from __future__ import annotations

import typing

import pytest
import torch

from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.backends import Backend
from tests.conformance.case import another_stream


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


def test_capture_state_and_memory_questions_on_the_facade(be) -> None:  # type: ignore[no-untyped-def]
    # What a runner asks of the device around its captures, through the facade alone: whether
    # the current stream is capturing (not a stream outside the capture), and the memory queries
    # it sizes its cache by.
    x = torch.ones(2, device=be.device)
    seen = {}
    g = be.Graph()
    with be.graph(g):
        seen["capturing"] = be.is_current_stream_capturing()
        with be.stream(another_stream(be)):  # not joined to the capture
            seen["outside"] = be.is_current_stream_capturing()
        x.mul_(2)
    free, total = be.mem_get_info()
    be.empty_cache()
    assert seen == {"capturing": True, "outside": False}
    assert not be.is_current_stream_capturing()
    assert isinstance(free, int) and isinstance(total, int) and 0 < free <= total
