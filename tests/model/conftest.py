"""Decoder tests run single-threaded: on a small shared machine, OpenMP's spinning thread pool
makes tiny matrix products thousands of times slower than one thread does."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
