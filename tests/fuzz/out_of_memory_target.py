"""Toy factories that run out of device memory while their targets are made, as a campaign does
on a GPU too small for every process that shares it: torch raises `OutOfMemoryError` from the
allocator. Module-level, so helper and isolated campaigns can import them by name."""

from __future__ import annotations

import multiprocessing
from typing import Literal

import torch

from pytest_graphmode.runtime import target as runtime_target
from pytest_graphmode.runtime.target import RuntimeTarget
from tests.fuzz.toy import ToyTarget, make_target

MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; no room left for these twins)"


def _out_of_memory() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(MESSAGE)


def in_helpers(mode: str, *, seed: int, backend: str) -> ToyTarget:
    """A toy target, except in a helper campaign's process, where no target fits."""
    if multiprocessing.current_process().name.startswith("graphmode-helper"):
        raise _out_of_memory()
    return make_target(mode, seed=seed, backend=backend)


def graph_twins(mode: str, *, seed: int, backend: str) -> ToyTarget:
    """A toy target, except a graph twin: the campaign's first twins never fit (the eager target
    that tells the spec does)."""
    if mode == "graph":
        raise _out_of_memory()
    return make_target(mode, seed=seed, backend=backend)


def graph_twins_in_this_process(mode: str, *, seed: int, backend: str) -> ToyTarget:
    """`graph_twins` in the process that started the campaign, a toy target in its helpers."""
    if multiprocessing.current_process().name == "MainProcess":
        return graph_twins(mode, seed=seed, backend=backend)
    return make_target(mode, seed=seed, backend=backend)


def more_than_the_gpu_in_helpers(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> RuntimeTarget:
    """The default target, except that in a helper campaign's process each target first asks
    the CUDA caching allocator for twice the GPU's memory: a real out-of-memory error."""
    if multiprocessing.current_process().name.startswith("graphmode-helper"):
        total = torch.cuda.mem_get_info()[1]
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    return runtime_target.make_target(mode, seed=seed, backend=backend)
