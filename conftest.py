"""Hypothesis profiles for the project's own tests.

`default` keeps the suite quick on a 2-core machine; `ci` is what `.ci/run` gets (CI=true);
`thorough` is for a local soak (`HYPOTHESIS_PROFILE=thorough`). No profile has a per-example
deadline: a first example that captures graphs is legitimately slow.
"""

import os

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
