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
def long_lived_objects_frozen() -> Iterator[None]:
    """Keep the objects that exist before the campaign (torch, Hypothesis, the runner's modules)
    out of the cycle collector's way while it runs.

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
    first time a dispatch mode or a custom op runs, which in a campaign is one of its first steps
    (the sim's mode, the cuda delay stressor's, a runner's own custom ops). It is imported here
    first so that it is frozen too: imported after the freeze, every collection of the campaign
    walked it (22 collections, 1.3 s of a 40-example cuda campaign on the H200 host).
    """
    if "torch" in sys.modules:
        import torch._dynamo  # noqa: F401
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
