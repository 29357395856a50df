"""One fuzz campaign of the default target, as a child process of `test_engine_speedup.py`.

It imports `pytest_graphmode` from wherever `sys.path` finds it first, so the same script measures
this checkout and a previous release installed into a directory put first on `PYTHONPATH`. Prints
one JSON line: the engine's version, examples, steps and the campaign's own seconds (imports and
process start excluded).

With `--kernel-share` (sim only) it also reports `kernel_seconds`: the time spent inside torch's
own operator calls (its C++ dispatcher and CPU kernels), which the sim's dispatch mode makes for
every ATen operation of the campaign. That is what an eager run of the same operations on the CPU
costs without the sim, the harness or Hypothesis: `seconds / kernel_seconds` bounds the speed-up
any engine change can give the same campaign.

torch imports its compiler stack lazily, the first time a dispatch mode or a custom op runs: in a
campaign that is one of its first steps (about a second on the H200 host, more without compiled
bytecode), paid once per process. `--compiler-stack-first` imports it before the clock starts, so
that the figure is the campaign's own work, the same for every engine.

With `--seconds S` the campaign has a time budget of S seconds instead of a count (`--examples`
then caps it), and with `--workers N` (this engine only, with `--seconds`) it runs on N processes:
itself and N-1 helper campaigns (`fuzz/helpers.py`), as `pytest --graphmode-fuzz` does under a time
budget. Its seconds are then wall-clock time from the first helper's start, helpers' process
starts included.

    python benchmarks/engine_campaign.py --backend sim --examples 10 --steps 8 --seed 0
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any


def time_operator_calls() -> list[float]:
    """Accumulate, in the returned one-item list, the seconds spent in outermost ATen operator
    calls (`OpOverload.__call__`) from now on."""
    import torch._ops

    call = torch._ops.OpOverload.__call__
    spent = [0.0]
    depth = [0]

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        start = time.perf_counter()
        try:
            return call(self, *args, **kwargs)
        finally:
            depth[0] -= 1
            if not depth[0]:
                spent[0] += time.perf_counter() - start

    torch._ops.OpOverload.__call__ = timed  # type: ignore[method-assign]
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True, choices=("sim", "cuda"))
    parser.add_argument("--examples", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernel-share", action="store_true", help="sim only: time torch's calls")
    parser.add_argument(
        "--cpu-threads",
        type=int,
        help="run_campaign's cpu_threads (0: torch's own setting); left out: the engine's default, "
        "so that engines without the argument run too",
    )
    parser.add_argument(
        "--compiler-stack-first",
        action="store_true",
        help="import torch's compiler stack (torch._dynamo) before the campaign's clock starts, "
        "as in a process that has run a dispatch mode or a custom op before: the one-time import "
        "is then no part of any engine's campaign",
    )
    parser.add_argument("--seconds", type=float, help="a time budget instead of a count")
    parser.add_argument(
        "--workers", type=int, default=1, help="processes (this engine, with --seconds only)"
    )
    args = parser.parse_args()
    if args.workers > 1 and args.seconds is None:
        parser.error("--workers needs --seconds: helper campaigns share a time budget")
    if args.kernel_share and args.backend != "sim":
        parser.error("--kernel-share needs --backend sim: on cuda no Python sees each operation")

    import pytest_graphmode
    from pytest_graphmode.fuzz import run_campaign
    from pytest_graphmode.runtime.target import make_target

    if args.compiler_stack_first:
        import torch._dynamo  # noqa: F401
    kernel = time_operator_calls() if args.kernel_share else None
    extra: dict[str, Any] = (
        {} if args.cpu_threads is None else {"cpu_threads": args.cpu_threads or None}
    )
    if args.seconds is not None:
        extra["seconds"] = args.seconds
    campaign: Any = run_campaign
    if args.workers > 1:
        from pytest_graphmode.fuzz.helpers import run_with_helpers

        campaign = functools.partial(run_with_helpers, run_campaign, helpers=args.workers - 1)
    stats = campaign(
        make_target,
        backend=args.backend,
        max_examples=args.examples,
        max_steps=args.steps,
        seed=args.seed,
        **extra,
    )
    source = Path(pytest_graphmode.__file__).resolve().parent.parent
    print(
        json.dumps(
            {
                "source": str(source),
                "examples": stats.examples,
                "steps": stats.steps,
                "seconds": stats.seconds,
                "failures": len(stats.failures),
                "kernel_seconds": None if kernel is None else kernel[0],
            }
        )
    )


if __name__ == "__main__":  # helper campaigns start with `spawn`, which imports this module
    main()
