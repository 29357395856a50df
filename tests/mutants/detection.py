"""Time to detection: how long `pytest --graphmode-fuzz` takes to find and to report each mutant.

    .venv/bin/python -m tests.mutants.detection --seeds 3
    .venv/bin/python -m tests.mutants.detection --seeds 2 --only padding_not_reset output_view \\
        --checkout old /work/wt/base/.venv/bin/python /work/wt/base \\
        --checkout new .venv/bin/python .

Every run is what a user types, with the default profile, in a fresh process and an empty
directory (so only the built-in suite runs; the checkout is put on PYTHONPATH for its mutants):

    python -m pytest --graphmode-fuzz --graphmode-target=tests.mutants.NAME:make_target
        --graphmode-backend=sim --graphmode-seed=S -p no:xdist -p no:randomly
        --graphmode-report=REPORT

(`--backend cuda` runs the same command with `--graphmode-backend=cuda`; `--pytest-option` adds an
option to it: `--pytest-option=--graphmode-leading=off` measures what drawn schedules find alone.)

Each checkout needs an interpreter that imports it: its own virtual environment, or, for a plain
source tree run by this repository's interpreter, the tree's `strategies/`, `runtime/` and
`planner/` copied into its `pytest_graphmode/` (an editable install maps those sub-packages to
this repository, whatever comes first on the path). A checkout that imports code from elsewhere is
refused before anything runs.

Time to the report is the wall time of that process. Time and examples to the first failure come
from the report's `first_failure_*` fields; a checkout whose reports lack them is measured by a
second run, `measure.py`'s detection campaign for the same mutant and seed (its own budget, no
shrinking), marked `*` in the table. Runs of several checkouts are interleaved, so a machine's
changing load falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPOSITORY = Path(__file__).parents[2]
_MEASURED = re.compile(r"Run\(target='(\w+)', seed=(\d+), check=(.*?), examples=(-?\d+), steps=")


@dataclass(frozen=True)
class Checkout:
    label: str
    python: str
    directory: Path


@dataclass(frozen=True)
class Detection:
    checkout: str
    mutant: str
    seed: int
    caught: bool
    check: str | None
    report_seconds: float
    first_seconds: float | None
    first_examples: int | None
    from_measure: bool  # the first-failure figures come from measure.py's campaign
    exit_code: int | None  # None: killed at the timeout


def detect(
    checkout: Checkout,
    mutant: str,
    seed: int,
    timeout: float,
    backend: str = "sim",
    options: Sequence[str] = (),
) -> Detection:
    """One `pytest --graphmode-fuzz` run of `checkout` against `mutant` on `backend`, with the
    pytest `options` added (`--graphmode-leading=off`, say)."""
    with tempfile.TemporaryDirectory(prefix="graphmode-detection-") as empty:
        report = Path(empty) / "report.json"
        command = [
            checkout.python,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-p",
            "no:randomly",
            "--graphmode-fuzz",
            f"--graphmode-target=tests.mutants.{mutant}:make_target",
            f"--graphmode-backend={backend}",
            f"--graphmode-seed={seed}",
            f"--graphmode-report={report}",
            *options,
        ]
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command,
                cwd=empty,
                env=_environment(checkout),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            exit_code: int | None = done.returncode
        except subprocess.TimeoutExpired:
            exit_code = None
        seconds = time.perf_counter() - started
        data = json.loads(report.read_text()) if report.exists() else {}
    failures = data.get("failures", [])
    check = failures[0]["check"] if failures else None
    first_seconds, first_examples = (
        data.get("first_failure_seconds"),
        data.get("first_failure_example"),
    )
    from_measure = bool(failures) and "first_failure_example" not in data
    if from_measure:
        first_seconds, first_examples = _measured(checkout, mutant, seed, timeout)
    return Detection(
        checkout.label,
        mutant,
        seed,
        bool(failures),
        check,
        seconds,
        first_seconds,
        first_examples,
        from_measure,
        exit_code,
    )


def _environment(checkout: Checkout) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    joined = str(checkout.directory) + (os.pathsep + path if path else "")
    return {**os.environ, "PYTHONPATH": joined}


MAPPED_SUBPACKAGES = ("strategies", "runtime", "planner")
"""Directories beside `pytest_graphmode/` that the install maps into it (pyproject's package-dir)."""


def check_imports_its_own_code(checkout: Checkout) -> None:
    """Fail unless `checkout.python`, with the checkout on PYTHONPATH, imports the harness from
    `checkout.directory`. An interpreter with this repository installed in editable mode finds
    `pytest_graphmode` in a plain source tree put first on the path, but not the sub-packages
    mapped into it at install: it takes those from the installed repository, and two checkouts
    would run the same strategies."""
    modules = ["pytest_graphmode", *(f"pytest_graphmode.{name}" for name in MAPPED_SUBPACKAGES)]
    probe = "import importlib, sys\nfor name in sys.argv[1:]: print(importlib.import_module(name).__file__)"
    done = subprocess.run(
        [checkout.python, "-c", probe, *modules],
        cwd=checkout.directory, env=_environment(checkout), capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"checkout {checkout.label}: cannot import the harness:\n{done.stderr}")
    root = checkout.directory.resolve()
    elsewhere = [
        f"{name} from {file}"
        for name, file in zip(modules, done.stdout.splitlines(), strict=True)
        if not Path(file).resolve().is_relative_to(root)
    ]
    if elsewhere:
        raise SystemExit(
            f"checkout {checkout.label} ({root}) imports code from elsewhere: "
            + "; ".join(elsewhere)
            + ". Give it an interpreter of its own (a virtual environment with that checkout "
            f"installed), or copy {', '.join(MAPPED_SUBPACKAGES)} into its pytest_graphmode/."
        )


def _measured(
    checkout: Checkout, mutant: str, seed: int, timeout: float
) -> tuple[float | None, int | None]:
    """Seconds and examples to the first failure from `measure.py`'s detection campaign, for a
    checkout whose reports do not record them."""
    command = [
        checkout.python,
        "-m",
        "tests.mutants.measure",
        "--seeds",
        str(seed + 1),
        "--fp-seeds",
        "0",
        "--jobs",
        "1",
        "--only",
        mutant,
    ]
    # measure.py runs seeds 0..seeds-1; only this seed's line is read.
    done = subprocess.run(
        command,
        cwd=checkout.directory,
        env=_environment(checkout),
        capture_output=True,
        text=True,
        timeout=timeout * (seed + 1),
        check=False,
    )
    for line in done.stderr.splitlines():
        match = _MEASURED.search(line)
        if match and int(match[2]) == seed and int(match[4]) >= 0:
            seconds = re.search(r"seconds=([\d.]+)", line)
            return (float(seconds[1]) if seconds else None), int(match[4])
    return None, None


def _median(values: list[float | int | None], digits: str = ".0f") -> str:
    known = [value for value in values if value is not None]
    return format(statistics.median(known), digits) if known else "-"


def table(runs: list[Detection]) -> list[str]:
    lines = [
        "| mutant | checkout | caught | checks | median s to first failure | "
        "median examples to first failure | median s to report |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mutant in dict.fromkeys(run.mutant for run in runs):
        for label in dict.fromkeys(run.checkout for run in runs):
            mine = [run for run in runs if (run.mutant, run.checkout) == (mutant, label)]
            if not mine:
                continue
            caught = [run for run in mine if run.caught]
            checks = ", ".join(sorted({run.check for run in caught if run.check})) or "-"
            mark = "*" if any(run.from_measure for run in caught) else ""
            lines.append(
                f"| `{mutant}` | {label} | {len(caught)}/{len(mine)} | {checks} | "
                f"{_median([r.first_seconds for r in caught], '.1f')}{mark} | "
                f"{_median([r.first_examples for r in caught], 'g')}{mark} | "
                f"{_median([r.report_seconds for r in mine], '.0f')} |"
            )
    for label in dict.fromkeys(run.checkout for run in runs):
        mine = [run for run in runs if run.checkout == label]
        lines.append(
            f"| all | {label} | {sum(r.caught for r in mine)}/{len(mine)} | | "
            f"{_median([r.first_seconds for r in mine if r.caught], '.1f')} | "
            f"{_median([r.first_examples for r in mine if r.caught], 'g')} | "
            f"{_median([r.report_seconds for r in mine], '.0f')} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    from tests.mutants import zoo

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per mutant")
    parser.add_argument("--only", nargs="*", help="mutant names (default: the whole zoo)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    parser.add_argument(
        "--checkout",
        nargs=3,
        action="append",
        metavar=("LABEL", "PYTHON", "DIRECTORY"),
        help="measure this checkout with this interpreter (repeatable; default: this one)",
    )
    parser.add_argument("--json", type=Path, help="also write every run to this JSON file")
    parser.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    parser.add_argument(
        "--pytest-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="add OPTION to every pytest run (repeatable), e.g. --pytest-option=--graphmode-leading=off",
    )
    args = parser.parse_args(argv)
    checkouts = [
        Checkout(label, str(Path(python).absolute()), Path(directory).absolute())
        for label, python, directory in args.checkout or [("this", sys.executable, str(REPOSITORY))]
    ]
    for checkout in checkouts:
        check_imports_its_own_code(checkout)
    mutants = args.only or [mutant.name for mutant in zoo.MUTANTS]
    runs: list[Detection] = []
    for mutant in mutants:
        for seed in range(args.seeds):
            for checkout in checkouts:
                run = detect(checkout, mutant, seed, args.timeout, args.backend, args.pytest_option)
                runs.append(run)
                print(json.dumps(asdict(run)), file=sys.stderr, flush=True)
                if args.json is not None:
                    args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1) + "\n")
    print("\n".join(table(runs)))


if __name__ == "__main__":
    main()
