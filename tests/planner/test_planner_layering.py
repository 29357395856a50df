"""The planner is an offline tool: running graphs never loads it."""

from __future__ import annotations

import subprocess
import sys


def test_the_runtime_runs_without_loading_the_planner() -> None:
    code = (
        "import sys\n"
        "from pytest_graphmode.runtime.target import make_target\n"
        "make_target('graph', seed=0, backend='sim').close()\n"
        "print(sorted(m for m in sys.modules if m.startswith('pytest_graphmode.planner')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
