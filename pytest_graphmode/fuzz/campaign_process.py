"""What a campaign arranges in its process while it runs, and undoes afterwards: torch's CPU
threads and a frozen heap."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from pytest_graphmode.settings import DEFAULT_CPU_THREADS

__all__ = [
    "DEFAULT_CPU_THREADS",
    "FrozenHeap",
    "check_cpu_threads",
    "long_lived_objects_frozen",
    "torch_cpu_threads",
]


def check_cpu_threads(count: int | None) -> None:
    """Raise ValueError unless `count` is a thread count >= 1, or None."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(
            f"cpu_threads={count!r} must be a number of threads >= 1, or None to leave torch's "
            "setting as it is"
        )


@contextmanager
def torch_cpu_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op CPU threads set to `count` while the campaign runs (None: left as they
    are), restored afterwards.

    A campaign's host tensors are tiny (on sim every tensor of the target is), so no kernel gains
    from a second thread, but every parallel region makes its threads meet. Where the cores are
    busy with other work (a CI runner's other jobs, pytest-xdist workers, the other ranks of a
    data-parallel campaign) a thread waits for a core at each meeting: on a shared 2-core machine,
    a sim campaign of 20 examples of the default target took 40.3 s with torch's 2 threads and
    5.3 s with 1, the same examples and steps.
    """
    check_cpu_threads(count)
    if count is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def long_lived_objects_frozen(backend: str = "sim") -> Iterator[FrozenHeap]:
    """Keep the objects that exist before the campaign (torch, Hypothesis, the runner's modules)
    out of the cycle collector's way while it runs on `backend` (a concrete one: "sim" or
    "cuda").

    A full collection walks every tracked object. Closing a graph memory pool on cuda needs one
    (graphs caught in reference cycles hold their memory until collected), once per twin closed,
    and with torch's heap that walk took about 0.15 s on the H200 host; frozen, it walks only
    what the campaign made.

    The heap is frozen also where something froze a part of it before (the H200 hosts' Python
    starts with a few hundred objects frozen): skipping the freeze there left every collection
    walking all of torch. Afterwards the whole heap is unfrozen, that part too: `gc` cannot
    unfreeze only the campaign's part, and a heap left frozen would keep every reference cycle in
    it (a later test's graphs, their device memory) for the rest of the process.

    torch imports its compiler stack (torch._dynamo, torch.fx, sympy: some 300,000 objects) the
    first time a dispatch mode guarded against torch.compile, a custom op or a meta function
    written in Python runs. Imported after the freeze, every collection of the campaign walks it
    (22 collections, 1.3 s of a 40-example cuda campaign on the H200 host). The sim imports it in
    a campaign's first step (the meta functions it runs to learn output shapes), so on sim it is
    imported here, before the freeze. A cuda campaign of a runner that neither compiles nor runs
    custom ops never imports it (the delay stressor's mode imports it only where it is imported
    already), and importing it costs about a second, a fifth of a 40-example campaign on the H200
    host: there it is left out, and `FrozenHeap.catch_up`, called between examples, freezes it
    once something imported it.
    """
    if backend == "sim" and "torch" in sys.modules:
        import torch._dynamo  # noqa: F401
    heap = FrozenHeap()
    gc.freeze()
    try:
        yield heap
    finally:
        gc.unfreeze()


class FrozenHeap:
    """The heap as `long_lived_objects_frozen` froze it; `catch_up` freezes what joined it since
    that is as long-lived."""

    def __init__(self) -> None:
        self._compiler_stack = COMPILER_STACK in sys.modules

    def catch_up(self) -> None:
        """Freeze the heap again, after a full collection, the first time this is called after
        something imported torch's compiler stack. Called between examples: what the campaign
        holds then (the kept twins, Hypothesis's state) is frozen with it and collected only
        once the campaign ends, after the collection has freed what it no longer holds."""
        if self._compiler_stack or COMPILER_STACK not in sys.modules:
            return
        self._compiler_stack = True
        gc.collect()
        gc.freeze()


COMPILER_STACK = "torch._dynamo"
