"""Stressors: what the harness does to a target between steps to provoke graph-mode bugs.

Each one targets a bug class (docs/bug-classes.md): poisoned static buffers expose stale inputs and
padding rows that are not reset (classes 1, 3); NaN in the null block exposes valid rows that read
padding's sink (1); allocator churn exposes addresses that are not stable (6); delays and a reseeded
stream scheduler expose missing stream/event waits and host-staging races (8). The functions take
plain tensors and a `random.Random`, so the same seed poisons the same way every time.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from pytest_graphmode.contract import Batch, TargetSpec, slot_major
from pytest_graphmode.runtime.backends import Backend
from pytest_graphmode.runtime.backends.cuda import CudaBackend
from pytest_graphmode.strategies.plans import Stress
from pytest_graphmode.strategies.stream_delays import (
    StreamsMet,
    delayed_compute,
    delayed_streams,
    landed_copies,
)

_FLOAT_POISON = (float("nan"), float("inf"), float("-inf"), 3.0e38)
_CHURN_BYTES = (4 << 10, 256 << 10, 4 << 20)


def live_indices(spec: TargetSpec, batches: Sequence[Batch]) -> tuple[list[int], list[int]]:
    """Block ids and slot ids the requests of `batches` own: the values a stale index would hold."""
    blocks = sorted({b for batch in batches for r in batch.requests for b in r.block_ids})
    size = spec.block_size
    slots = [b * size + i for b in blocks for i in range(size)]
    return blocks, slots


def writes_into_targets() -> Any:
    """The harness's own writes into a runner's tensors (poison, marks, a kept twin's restored
    state), run below autograd. A tensor the runner made in inference mode (every tensor a
    capture under it allocates, a buffer or cache made under it) is one torch refuses to update
    in place outside the mode; the runner's own writes to it come from inside the mode, and the
    harness's must pass as they do, on any backend."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


def poison_static_buffers(
    buffers: Mapping[str, torch.Tensor],
    *,
    live_blocks: Sequence[int],
    live_slots: Sequence[int],
    rng: random.Random,
) -> None:
    """Overwrite every static buffer in place: NaN/inf in floats; in integers, a mix of live
    block ids, live slot ids, -1 and huge values, so an unreset entry hits someone else's KV."""
    generator = torch.Generator().manual_seed(rng.randrange(2**62))
    for tensor in buffers.values():
        if tensor.numel() == 0:
            continue
        if tensor.dtype == torch.bool:
            values = torch.randint(0, 2, tensor.shape, generator=generator).bool()
        elif tensor.is_floating_point():
            values = _pick(_FLOAT_POISON, tensor, generator)
        else:
            info = torch.iinfo(tensor.dtype)
            pool = [*live_blocks, *live_slots, -1, info.max, rng.randrange(info.max)]
            pool = [v for v in pool if info.min <= v <= info.max]
            values = _pick(pool, tensor, generator)
        with writes_into_targets():
            tensor.copy_(values.to(device=tensor.device, dtype=tensor.dtype))


def _pick(pool: Sequence[float], like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    choices = torch.tensor(pool, dtype=torch.float64 if like.is_floating_point() else torch.int64)
    return choices[torch.randint(0, len(pool), like.shape, generator=generator)]


def poison_null_block(state: Mapping[str, torch.Tensor], spec: TargetSpec) -> None:
    """NaN into the null block's slots of every floating slot-major tensor (KV caches)."""
    start = spec.null_block * spec.block_size
    for tensor in state.values():
        if tensor.is_floating_point() and slot_major(tensor, spec):
            with writes_into_targets():
                tensor[start : start + spec.block_size].fill_(float("nan"))


def churn(device: torch.device, count: int, rng: random.Random) -> list[torch.Tensor]:
    """Allocate `count` NaN-filled tensors of assorted sizes and free half of them at once; the
    caller keeps the rest alive across the step, so freed and reused memory both hold garbage."""
    made = []
    for _ in range(count):
        nbytes = rng.choice(_CHURN_BYTES)
        made.append(torch.full((nbytes // 4,), float("nan"), device=device))
    return made[::2]


def stressed_timing(backend: Backend, stress: Stress) -> bool:
    """Whether `stress` changes when the step's work runs on `backend`: only on cuda, only with
    `delay_cycles` (work made late, or, with `late="host"`, copies waited for)."""
    return bool(stress.delay_cycles) and backend.name == "cuda"


def delays_on(backend: Backend, stress: Stress) -> bool:
    """Whether `stress` queues sleeps on `backend`: where it changes the step's timing
    (`stressed_timing`), unless it makes the host late instead (`late="host"`)."""
    return stressed_timing(backend, stress) and stress.late != "host"


def delay(backend: Backend, stress: Stress) -> None:
    """Make asynchronous work land late: a sleep kernel on the current cuda stream, or a fresh
    seed for the sim backend's stream scheduler (where the backend offers one)."""
    if delays_on(backend, stress):
        torch.cuda._sleep(stress.delay_cycles)
    if stress.scheduler_seed is not None and hasattr(backend, "set_scheduler_seed"):
        backend.set_scheduler_seed(stress.scheduler_seed)


def delayed_step(
    backend: Backend, stress: Stress, hold_cycles: int = 0, met: StreamsMet | None = None
) -> AbstractContextManager[None]:
    """The scope to run the stressed twin's step in: on cuda with `stress.delay_cycles`, every
    asynchronous host copy and event record lands late, or the step's eager kernels and graph
    replays where `stress.late` says "compute", by at least `hold_cycles` where no earlier sleep
    holds their stream back, on every stream or on the step's `stress.held_stream`-th alone
    (`stream_delays`; `met`, the streams the runner's earlier delayed steps met, takes the held
    stream modulo their count), the host's accesses to a copy's pinned bytes while the copy is
    in flight (late, or queued behind late work) being races the backend hands over
    (`cuda_races`); with `late="host"` every
    asynchronous copy between host and device lands before the host goes on instead
    (`landed_copies`); anywhere else nothing is entered at all, so an unstressed step pays
    nothing."""
    if not stressed_timing(backend, stress):
        return nullcontext()
    if stress.late == "host":
        return landed_copies()
    inflight = backend.inflight_copies if isinstance(backend, CudaBackend) else None
    if stress.late == "compute":
        return delayed_compute(stress.delay_cycles, hold_cycles, stress.held_stream, met, inflight)
    return delayed_streams(stress.delay_cycles, hold_cycles, stress.held_stream, met, inflight)
