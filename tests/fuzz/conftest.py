"""Fixtures of the fuzz tests that run on a GPU (the stream delays, copies in flight)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.backends import Backend


@pytest.fixture
def any_be() -> Iterator[Backend]:
    """The cuda backend, for a test whose outcome no timing decides."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    backend = backends.get("cuda")
    backend.synchronize()
    yield backend
    backend.synchronize()


@pytest.fixture
def be(any_be: Backend) -> Backend:
    """The cuda backend, for a test whose outcome a delay decides. The delays count the SM's
    clock, which runs on while the GPU serves another process's context: on a GPU shared by
    twelve pytest workers (the H100, 2026-12-07) a delay of 25 ms ran out before the work it held
    back was due and four of these races came out the other way. A test that uses it carries the
    mark `graphmode_gpu_alone`, which skips it beside other workers and has `make test` run it
    alone (`test_gpu_alone.py` checks the mark on the CPU too)."""
    return any_be
