"""The pytest-xdist workers that share this machine, and its GPU, with the test running now."""

from __future__ import annotations

import os


def other_workers() -> int:
    """How many other pytest workers run beside this one (0 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) - 1
