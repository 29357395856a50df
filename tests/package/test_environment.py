"""The environment `make setup` builds holds its own `pytest` script, so that after activating it
the documented `pytest --graphmode-fuzz ...` commands run this interpreter with this plugin, and
the project's own run is not flooded with pytest-benchmark's xdist notice."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="not running in a virtual environment")
def test_the_virtual_environment_has_its_own_pytest_script() -> None:
    script = Path(sys.prefix) / "bin" / "pytest"
    assert script.is_file(), f"{script} missing: `pytest` would resolve to another interpreter's"
    assert (
        Path(script.read_text().splitlines()[0].removeprefix("#!")).resolve()
        == Path(sys.executable).resolve()
    )


def test_the_projects_run_under_xdist_prints_no_benchmark_notice() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "1",
            "-p",
            "no:cacheprovider",
            "-q",
            "tests/package/test_exports.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Benchmarks are automatically disabled" not in done.stdout + done.stderr
