"""One fuzz campaign of the default target, as a child process of `test_engine_speedup.py`.

It imports `pytest_graphmode` from wherever `sys.path` finds it first, so the same script measures
this checkout and a previous release installed into a directory put first on `PYTHONPATH`. Prints
one JSON line: the engine's version, examples, steps and the campaign's own seconds (imports and
process start excluded).

    python benchmarks/engine_campaign.py --backend sim --examples 10 --steps 8 --seed 0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True, choices=("sim", "cuda"))
    parser.add_argument("--examples", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import pytest_graphmode
    from pytest_graphmode.fuzz import run_campaign
    from pytest_graphmode.runtime.target import make_target

    stats = run_campaign(
        make_target,
        backend=args.backend,
        max_examples=args.examples,
        max_steps=args.steps,
        seed=args.seed,
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
            }
        )
    )


if __name__ == "__main__":
    main()
