"""Under pytest-xdist: one base seed for all workers, one GPU each, one merged summary."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugin.conftest import TOY, TOY_SOURCE

WORKER_TEST = """
import os
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from graphmode_toy import make_target
from pytest_graphmode.settings import settings_of

@pytest.mark.graphmode_fuzz
def test_record_and_fuzz(graphmode_fuzz, pytestconfig, worker_id):
    seen = f"{settings_of(pytestconfig).seed} {os.environ.get('CUDA_VISIBLE_DEVICES')}"
    Path(f"seen-{worker_id}.txt").write_text(seen)
    quick = settings(max_examples=2, phases=[Phase.generate], deadline=None, database=None)
    graphmode_fuzz(make_target, max_steps=2, settings=quick)
"""


@pytest.fixture(scope="module")
def xdist_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Two workers each run the same fuzz test once (`--dist each`)."""
    project = tmp_path_factory.mktemp("xdist")
    (project / "graphmode_toy.py").write_text(TOY_SOURCE)
    (project / "test_workers.py").write_text(WORKER_TEST)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--dist",
            "each",
            "--graphmode-fuzz",
            f"--graphmode-target={TOY}",
            "--graphmode-backend=auto",
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(project), "CUDA_VISIBLE_DEVICES": "6,7"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return project, done.stdout


def test_every_worker_gets_the_base_seed_of_the_header(xdist_run: tuple[Path, str]) -> None:
    project, stdout = xdist_run
    header_seed = stdout.split(" seed=", 1)[1].split(" ", 1)[0]
    seeds = {(project / f"seen-gw{i}.txt").read_text().split()[0] for i in range(2)}
    assert seeds == {header_seed}


def test_each_worker_gets_its_own_gpu_from_the_visible_list(xdist_run: tuple[Path, str]) -> None:
    project, _ = xdist_run
    gpus = [(project / f"seen-gw{i}.txt").read_text().split()[1] for i in range(2)]
    assert gpus == ["6", "7"]


def test_controller_summary_merges_all_workers(xdist_run: tuple[Path, str]) -> None:
    _, stdout = xdist_run
    pytest.LineMatcher(stdout.splitlines()).fnmatch_lines(
        ["*= graphmode fuzz summary =*", "campaigns: 2  examples: 4  steps: *", "failures: 0"]
    )


def test_controller_prints_a_line_per_finished_campaign(xdist_run: tuple[Path, str]) -> None:
    _, stdout = xdist_run
    for worker in ("gw0", "gw1"):
        pytest.LineMatcher(stdout.splitlines()).fnmatch_lines(
            [
                f"[[]{worker}[]] graphmode test_workers.py::test_record_and_fuzz: 1 campaign(s), "
                "2 examples, * steps, 0 failures, * s"
            ]
        )
