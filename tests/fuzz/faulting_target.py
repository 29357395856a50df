"""Toy targets whose graph twin faults like a device would, for the isolation tests.

On a GPU an out-of-bounds index poisons the CUDA context or aborts the process; these targets do
the same on purpose, on any backend, at the first step with more than one request: a campaign's
first examples have a single request, so the fault comes some way into the campaign.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from pytest_graphmode.contract import Batch, StepResult
from tests.fuzz.toy import ToyTarget

FAULT_REQUESTS = 2
"""The graph twin faults on the first step with at least this many requests."""


class _Faulting(ToyTarget):
    def state(self) -> Mapping[str, torch.Tensor]:
        # Only the KV cache: the contract's state is slot-major, and the plugin checks it before
        # the first campaign (the toy's output weights are no such state).
        return {"kv": self.kv}

    def step(self, batch: Batch) -> StepResult:
        if self.mode == "graph" and batch.num_reqs >= FAULT_REQUESTS:
            self.fault()
        return super().step(batch)

    def fault(self) -> None:
        raise NotImplementedError


class _Aborting(_Faulting):
    def fault(self) -> None:
        os.abort()  # what a device-side assert does to the process


class _RaisingAcceleratorError(_Faulting):
    def fault(self) -> None:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


def make_aborting_target(mode: str, *, seed: int, backend: str) -> ToyTarget:
    return _Aborting(mode, seed=seed, backend=backend)


def make_accelerator_error_target(mode: str, *, seed: int, backend: str) -> ToyTarget:
    return _RaisingAcceleratorError(mode, seed=seed, backend=backend)


class _FaultSurfacingLate(_Faulting):
    """Its step returns; the fault surfaces at the next use of the device (here: its state),
    outside `step()`, as an asynchronous device error does."""

    faulted = False

    def fault(self) -> None:
        self.faulted = True

    def state(self) -> Mapping[str, torch.Tensor]:
        if self.faulted:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return super().state()


def make_late_fault_target(mode: str, *, seed: int, backend: str) -> ToyTarget:
    return _FaultSurfacingLate(mode, seed=seed, backend=backend)


class _AbortingWhenMade(ToyTarget):
    """Its graph twin aborts the process while it is made, as a capture that faults the device
    does (for the check the plugin makes of the twins before any campaign)."""

    def __init__(self, mode: str, *, seed: int, backend: str) -> None:
        if mode == "graph":
            os.abort()
        super().__init__(mode, seed=seed, backend=backend)

    def state(self) -> Mapping[str, torch.Tensor]:
        return {"kv": self.kv}


def make_aborting_when_made(mode: str, *, seed: int, backend: str) -> ToyTarget:
    return _AbortingWhenMade(mode, seed=seed, backend=backend)


class _FaultingWhenMade(_AbortingWhenMade):
    def __init__(self, mode: str, *, seed: int, backend: str) -> None:
        if mode == "graph":
            raise torch.AcceleratorError("CUDA error: device-side assert triggered")
        super().__init__(mode, seed=seed, backend=backend)


def make_faulting_when_made(mode: str, *, seed: int, backend: str) -> ToyTarget:
    return _FaultingWhenMade(mode, seed=seed, backend=backend)
