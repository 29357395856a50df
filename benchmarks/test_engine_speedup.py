"""Issue 16's figure: steps/s of the default target's campaign, this engine against previous
releases, measured side by side in one run.

`GRAPHMODE_BASELINES` names source checkouts of earlier releases (comma-separated directories,
for example made with `git archive <ref> | tar -x -C DIR`); each is installed once into a private
directory (`pip install --no-deps --target`, no network needed) and put first on `PYTHONPATH` of
a child process. Every engine runs the same campaign (examples, steps, seed) in a fresh process,
in alternating order round after round, and the medians are compared. Without baselines the test
measures this engine alone.

The campaign is the size of what `pytest --graphmode-fuzz` runs by default (40 examples of up to 8
steps: about what fits in the default profile's 20 s on sim), not the suite's CI budget: a campaign
of 5 examples is mostly the process's first-use costs (torch's lazy imports at the first capture,
the first twins' warm-ups), the same for every engine. `GRAPHMODE_ENGINE_EXAMPLES` and
`GRAPHMODE_ENGINE_STEPS` change it. `GRAPHMODE_ENGINE_SEEDS` (comma-separated, default 0) runs
each engine's campaign once per seed in every round, and its rate is the steps of all of them over
their seconds: one seed's 40 examples draw a few hundred steps, and which steps they are moves the
rate as much as many an engine change. `GRAPHMODE_ENGINE_COMPILER_STACK=first` starts every engine's
campaign with torch's compiler stack imported (`engine_campaign.py --compiler-stack-first`).

`GRAPHMODE_ENGINE_WORKERS=N` (N > 1) adds two runs of this engine under the time budget
`GRAPHMODE_ENGINE_SECONDS` (default 20, the dev profile's) instead of the example count: one in one
process and one on N processes (`fuzz/helpers.py`), the second timed on the wall clock with its
helpers' process starts. Their ratio is what the helpers add; both compare with the other engines'
count-bounded campaigns only roughly (a longer campaign spreads its first captures over more steps).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROUNDS = int(os.environ.get("GRAPHMODE_ENGINE_ROUNDS", "3"))
EXAMPLES = int(os.environ.get("GRAPHMODE_ENGINE_EXAMPLES", "40"))
STEPS = int(os.environ.get("GRAPHMODE_ENGINE_STEPS", "8"))
SEEDS = tuple(int(seed) for seed in os.environ.get("GRAPHMODE_ENGINE_SEEDS", "0").split(","))
SCRIPT = Path(__file__).with_name("engine_campaign.py")
# "first": every engine's campaign starts with torch's compiler stack imported (see
# engine_campaign.py, --compiler-stack-first); left out, each pays the import where it happens.
COMPILER_STACK_FIRST = os.environ.get("GRAPHMODE_ENGINE_COMPILER_STACK", "") == "first"
WORKERS = int(os.environ.get("GRAPHMODE_ENGINE_WORKERS", "1"))
BUDGET = os.environ.get("GRAPHMODE_ENGINE_SECONDS", "20")


def _baselines() -> list[Path]:
    raw = os.environ.get("GRAPHMODE_BASELINES", "")
    dirs = [Path(p).resolve() for p in raw.split(",") if p.strip()]
    for d in dirs:
        if not (d / "pyproject.toml").is_file():
            raise pytest.UsageError(f"GRAPHMODE_BASELINES: {d} is not a source checkout")
    return dirs


@pytest.fixture(scope="session")
def baseline_sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    sites = {}
    for source in _baselines():
        site = tmp_path_factory.mktemp(f"baseline-{source.name}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
             "--no-index", "--target", str(site), str(source)],
            check=True,
        )  # fmt: skip
        sites[source.name] = site
    return sites


def _campaign(
    site: Path | None, backend: str, seed: int, extra: Sequence[str] = ()
) -> dict[str, Any]:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", backend,
         "--examples", str(EXAMPLES), "--steps", str(STEPS), "--seed", str(seed),
         *(["--compiler-stack-first"] if COMPILER_STACK_FIRST else []), *extra],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the campaign of engine {site or 'current'} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if site is not None and not result["source"].startswith(str(site)):
        raise RuntimeError(f"the baseline in {site} was shadowed by {result['source']}")
    return result


def test_engine_speedup(
    benchmark: Any, graphmode_backend: Any, baseline_sites: dict[str, Path]
) -> None:
    # name -> (installed baseline or None for this checkout, extra arguments). "torch threads":
    # this engine with torch's own CPU thread count, to show what the campaign's one thread gives.
    engines: dict[str, tuple[Path | None, tuple[str, ...]]] = {
        "current": (None, ()),
        "current, torch threads": (None, ("--cpu-threads", "0")),
        **{name: (site, ()) for name, site in baseline_sites.items()},
    }
    if WORKERS > 1:
        timed = ("--seconds", BUDGET, "--examples", "10000")
        engines[f"current, {BUDGET} s"] = (None, timed)
        engines[f"current, {BUDGET} s, {WORKERS} workers"] = (
            None,
            (*timed, "--workers", str(WORKERS)),
        )
    rates: dict[str, list[float]] = {name: [] for name in engines}

    def one_round() -> None:
        order = list(engines.items())
        if len(rates["current"]) % 2:
            order.reverse()  # alternate, so drift of the machine does not favour one engine
        for name, (site, extra) in order:
            results = [_campaign(site, graphmode_backend.name, seed, extra) for seed in SEEDS]
            for result in results:
                assert result["failures"] == 0, (name, result)
            steps = sum(result["steps"] for result in results)
            rates[name].append(steps / sum(result["seconds"] for result in results))

    benchmark.pedantic(one_round, rounds=ROUNDS)
    benchmark.group = "16 engine speedup"
    medians = {name: statistics.median(r) for name, r in rates.items()}
    benchmark.extra_info.update(
        examples=EXAMPLES,
        steps_per_example=STEPS,
        seeds=list(SEEDS),
        compiler_stack_first=COMPILER_STACK_FIRST,
        steps_per_s=medians,
        steps_per_s_each_round=rates,
        speedup_over={
            name: medians["current"] / rate for name, rate in medians.items() if name != "current"
        },
    )
    if WORKERS > 1:
        helped = medians[f"current, {BUDGET} s, {WORKERS} workers"]
        benchmark.extra_info["workers"] = WORKERS
        # The N-process campaign's rate over each other engine's, its one-process twin included.
        benchmark.extra_info["workers_speedup_over"] = {
            name: helped / rate for name, rate in medians.items() if "workers" not in name
        }
