"""What drawn schedules find on their own: each outside runner's bug in campaigns without the
leading examples (`run_campaign(leading=False)`, `--graphmode-leading=off`).

    .venv/bin/python -m tests.runners.drawn_reach --seeds 3
    .venv/bin/python -m tests.runners.drawn_reach --only nsa_indexer_skip_baked fa3_schedule_planned_unpadded

Every runner of `test_from_docs.CAUGHT_BY` but those caught while the twins are made (no schedule
decides those) runs its buggy target in one campaign per seed, `--examples` examples of up to
`--steps` steps, reported as found (no shrinking), in a fresh process of its own, so that no
campaign depends on what the ones before it left in the process. Each campaign prints one JSON
line to stderr:
the example of the first failure (None: missed within the examples) and its check; the end is a
table of the runners with a seed missed or caught by another check than the one their tests name
(with the leading examples), and the count caught.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

from pytest_graphmode.fuzz import GraphmodeFailure, run_campaign
from tests.runners.test_from_docs import AT_START_UP, CAUGHT_BY, _factory


@dataclass(frozen=True)
class Reach:
    runner: str
    seed: int
    example: int | None  # the first failing example, counted from 1; None: missed
    check: str | None
    expected: bool  # the check is one the runner's tests name
    seconds: float


def reach(runner: str, seed: int, examples: int, steps: int) -> Reach:
    """One drawn-only campaign of `runner`'s bug on sim."""
    started = time.perf_counter()
    try:
        run_campaign(
            _factory(runner, "make_buggy_target"),
            max_examples=examples,
            max_steps=steps,
            seed=seed,
            shrink_seconds=0,
            leading=False,
        )
    except GraphmodeFailure as failed:
        named = CAUGHT_BY[runner]
        expected = (named,) if isinstance(named, str) else named
        check = failed.failure.check
        example = None if failed.stats is None else failed.stats.first_failure_example
        seconds = time.perf_counter() - started
        return Reach(runner, seed, example, check, check in expected, seconds)
    return Reach(runner, seed, None, None, False, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per runner")
    parser.add_argument("--first-seed", type=int, default=0, help="the first of those seeds")
    parser.add_argument("--examples", type=int, default=60, help="examples per campaign")
    parser.add_argument("--steps", type=int, default=8, help="steps per example at most")
    parser.add_argument("--only", nargs="*", help="runner names (default: every one)")
    parser.add_argument("--jobs", type=int, default=1, help="campaigns run at once")
    args = parser.parse_args(argv)
    runners = args.only or sorted(set(CAUGHT_BY) - AT_START_UP)
    unknown = sorted(set(runners) - set(CAUGHT_BY))
    if unknown:
        parser.error(f"not runners of tests/runners/test_from_docs.py: {', '.join(unknown)}")
    found: list[Reach] = []
    fresh = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=fresh, max_tasks_per_child=1) as pool:
        runs = [
            pool.submit(reach, runner, seed, args.examples, args.steps)
            for runner in runners
            for seed in range(args.first_seed, args.first_seed + args.seeds)
        ]
        for run in runs:
            found.append(run.result())
            print(json.dumps(asdict(found[-1])), file=sys.stderr, flush=True)
    print("| runner | first failing example, per seed | checks |")
    print("| --- | --- | --- |")
    for runner in runners:
        mine = [r for r in found if r.runner == runner]
        if all(r.example is not None and r.expected for r in mine):
            continue
        examples = ", ".join("missed" if r.example is None else str(r.example) for r in mine)
        checks = ", ".join(sorted({r.check for r in mine if r.check})) or "-"
        print(f"| `{runner}` | {examples} | {checks} |")
    caught = [r for r in found if r.example is not None]
    other = sum(not r.expected for r in caught)
    print(
        f"caught: {len(caught)} of {len(found)} campaigns ({other} by a check other than the one "
        "the runner's tests name, with the leading examples)"
    )


if __name__ == "__main__":
    main()
