"""Measure the mutant zoo on the sim backend and print the tables of docs/mutants.md.

    .venv/bin/python -m tests.mutants.measure --seeds 10 --fp-seeds 20 --jobs 2

For every mutant and campaign seed 0..seeds-1: the check that failed it, and the examples and steps
run until the first failing example (the detection budget of `budget.py`: no shrinking). For every
correct target and seed 0..fp-seeds-1: a full campaign with the default budget and its failures.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pytest_graphmode.contract import TargetFactory

CORRECT_TARGETS = ("runtime", "runtime_piecewise", "runtime_vmm", "minimal", "overlapped")


def correct_factory(name: str) -> TargetFactory:
    """The correct targets: the default target, its piecewise and vmm variants (the mutants of
    classes 9 and 12 start from those), the independent minimal runner, and its variant that
    overlaps its steps on side streams (the mutant `upload_event_skipped` starts from it)."""
    from functools import partial

    from pytest_graphmode.runtime.target import make_target
    from tests.runners import minimal, overlapped

    factories: dict[str, Callable[..., Any]] = {
        "runtime": make_target,
        "runtime_piecewise": partial(make_target, piecewise=True),
        "runtime_vmm": partial(make_target, memory="vmm"),
        "minimal": minimal.make_target,
        "overlapped": overlapped.make_target,
    }
    return factories[name]


@dataclass(frozen=True)
class Run:
    target: str
    seed: int
    check: str | None
    examples: int
    steps: int
    seconds: float


def _campaign(job: tuple[str, int, int, int, bool]) -> Run:
    import torch

    from pytest_graphmode.fuzz import GraphmodeFailure, run_campaign
    from tests.mutants import zoo
    from tests.mutants.budget import detection_settings

    torch.set_num_threads(1)
    name, seed, examples, steps, is_mutant = job
    factory = zoo.load(name).factory if is_mutant else correct_factory(name)
    started = time.perf_counter()
    check: str | None = None
    try:
        stats = run_campaign(
            factory,
            backend="sim",
            max_steps=steps,
            seed=seed,
            settings=detection_settings(examples),
        )
    except GraphmodeFailure as failed:
        assert failed.stats is not None
        stats, check = failed.stats, failed.failure.check
    except Exception as crashed:  # the harness itself broke: a finding, shown in the table
        return Run(name, seed, f"crash: {crashed}"[:80], -1, -1, time.perf_counter() - started)
    return Run(name, seed, check, stats.examples, stats.steps, time.perf_counter() - started)


def _median(values: list[int]) -> str:
    return f"{statistics.median(values):g}" if values else "-"


def _missed(run: Run) -> str:
    return f"{run.seed} ({run.check})" if run.check else str(run.seed)


def mutant_table(runs: list[Run]) -> list[str]:
    from tests.mutants import zoo

    lines = [
        "| mutant | class | expected check | caught | checks seen | median examples | "
        "median steps | max examples | seeds missed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mutant in zoo.MUTANTS:
        mine = [r for r in runs if r.target == mutant.name]
        if not mine:
            continue
        caught = [r for r in mine if r.check is not None and not r.check.startswith("crash")]
        seen = ", ".join(sorted({r.check for r in caught if r.check is not None})) or "-"
        lines.append(
            f"| `{mutant.name}` | {mutant.bug_class} | `{mutant.check}` | "
            f"{len(caught)}/{len(mine)} | {seen} | {_median([r.examples for r in caught])} | "
            f"{_median([r.steps for r in caught])} | "
            f"{max((r.examples for r in caught), default='-')} | "
            f"{', '.join(_missed(r) for r in mine if r not in caught) or '-'} |"
        )
    return lines


def false_positive_table(runs: list[Run], examples: int, steps: int) -> list[str]:
    lines = [
        "| target | seeds | examples per seed | max steps | steps run | failures |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in CORRECT_TARGETS:
        mine = [r for r in runs if r.target == name]
        if not mine:
            continue
        failed = [f"seed {r.seed}: {r.check}" for r in mine if r.check is not None]
        lines.append(
            f"| `{name}` | {len(mine)} | {examples} | {steps} | {sum(r.steps for r in mine)} | "
            f"{len(failed)}{' (' + '; '.join(failed) + ')' if failed else ''} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    from tests.mutants import zoo
    from tests.mutants.budget import MAX_EXAMPLES, MAX_STEPS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="campaign seeds per mutant")
    parser.add_argument("--fp-seeds", type=int, default=20, help="seeds per correct target")
    parser.add_argument("--fp-examples", type=int, default=MAX_EXAMPLES)
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--only", nargs="*", help="mutant or target names to run (default: all)")
    args = parser.parse_args(argv)
    names = [m.name for m in zoo.MUTANTS]
    wanted = set(args.only or [*names, *CORRECT_TARGETS])
    jobs = [
        (name, seed, MAX_EXAMPLES, MAX_STEPS, True)
        for name in names
        if name in wanted
        for seed in range(args.seeds)
    ] + [
        (name, seed, args.fp_examples, MAX_STEPS, False)
        for name in CORRECT_TARGETS
        if name in wanted
        for seed in range(args.fp_seeds)
    ]
    started = time.perf_counter()
    runs = []
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for run in pool.imap_unordered(_campaign, jobs, chunksize=1):
            runs.append(run)
            print(f"[{len(runs)}/{len(jobs)}] {run}", file=sys.stderr, flush=True)
    mutants = [r for r in runs if r.target in names]
    correct = [r for r in runs if r.target not in names]
    print("\n".join(mutant_table(mutants)))
    print()
    print("\n".join(false_positive_table(correct, args.fp_examples, MAX_STEPS)))
    print(f"\n{len(jobs)} campaigns in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
