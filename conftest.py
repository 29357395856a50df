"""Hypothesis profiles for the project's own tests.

`default` keeps the suite quick on a 2-core machine; `ci` is what `.ci/run` gets (CI=true);
`thorough` is for a local soak (`HYPOTHESIS_PROFILE=thorough`). No profile has a per-example
deadline: a first example that captures graphs is legitimately slow.
"""

import importlib
import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}

settings.register_profile("default", max_examples=25, **_COMMON)
settings.register_profile("ci", max_examples=25, print_blob=True, **_COMMON)
settings.register_profile("thorough", max_examples=400, **_COMMON)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
)

# One intra-op thread per test process: the suite runs one process per core (pytest-xdist), and
# small tensor kernels slow down by orders of magnitude when threads oversubscribe the cores.
torch.set_num_threads(1)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked `graphmode_gpu_alone` beside other pytest workers: they share its GPU.
    `make test` runs the marked tests again in one process after the parallel run."""
    # pytest-xdist tells each worker how many there are (unset without xdist)
    others = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) - 1
    if others and item.get_closest_marker("graphmode_gpu_alone"):
        pytest.skip(
            f"needs the GPU to itself, which the other {others} pytest workers share: "
            "run it without xdist (-p no:xdist), as `make test` does after its parallel run"
        )


@pytest.fixture(autouse=True)
def _torch_left_as_found() -> Iterator[None]:
    """Fail a test that leaves the sim routing torch (an `activate()` or a drop-in scope never
    left, a campaign's twins never closed): every later test of that process would run through
    it, e.g. `torch.manual_seed` would no longer seed the GPU's generator."""
    before = _sim_routing()
    yield
    after = _sim_routing()
    if after != before:
        pytest.fail(
            f"the test left the sim as (drop-in active, dispatch active) = {after}, not {before} "
            "as it found it: leave every drop_in()/activate() scope and close every campaign"
        )


def _sim_routing() -> tuple[bool, bool]:
    """(drop-in active, sim dispatch active), without making the sim backend where none exists."""
    drop_in = importlib.import_module("pytest_graphmode.runtime.backends.sim.drop_in")
    sim = importlib.import_module("pytest_graphmode.runtime.backends.sim.backend")
    return drop_in.is_active(), sim._BACKEND is not None and sim._BACKEND.is_active
