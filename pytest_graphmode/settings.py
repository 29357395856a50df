"""One home for a run's settings: the options, the profiles, where the plugin keeps its state, the
target factory, and the Hypothesis settings of every campaign.

The plugin, the fixtures, the built-in suite and `run_campaign` all read from here, so a setting
has one meaning whichever path starts a campaign. Imports neither torch nor Hypothesis at module
level: the plugin imports this module in every pytest run.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_graphmode.campaign_stats import SessionSummary
from pytest_graphmode.contract import TargetFactory
from pytest_graphmode.loader import DEFAULT_TARGET, load_factory

if TYPE_CHECKING:
    import hypothesis

BACKENDS = ("auto", "sim", "cuda")


@dataclass(frozen=True)
class Profile:
    """How long each campaign runs: at most `examples` examples of up to `steps` steps, and with
    `seconds`, no new example once that many seconds have passed."""

    examples: int
    steps: int
    seconds: float | None = None

    def describe(self) -> str:
        if self.seconds is not None:
            return f"examples for {self.seconds:g} s of up to {self.steps} steps"
        return f"{self.examples} examples of up to {self.steps} steps"


# --graphmode-examples/-steps/-seconds override them. dev, the default, is sized by time rather than
# by count, so that it runs as many examples as the machine and the target allow: the built-in
# suite's three sim campaigns take about a minute (docs/ci.md). Its example count only caps it.
PROFILES = {
    "dev": Profile(examples=10_000, steps=8, seconds=20.0),
    "ci": Profile(examples=50, steps=12),
    "nightly": Profile(examples=500, steps=24),
}
DEFAULT_SHRINK_SECONDS = 20.0
DEFAULT_CPU_THREADS = 1
"""torch's intra-op CPU threads during a campaign (fuzz/campaign_process.py says why 1)."""
ISOLATE = ("auto", "on", "off")
LEADING = ("on", "off")
WORKER_SEED = "graphmode_seed"
"""The xdist controller's base seed, handed to every worker in `workerinput`."""

# name -> (metavar, help); every option `--graphmode-NAME` (underscores written as dashes) has an
# ini twin `graphmode_NAME`.
OPTIONS: dict[str, tuple[str, str]] = {
    "target": (
        "MODULE:FACTORY",
        f"runner under test (default {DEFAULT_TARGET})",
    ),
    "backend": ("{auto,sim,cuda}", "default auto: cuda when torch.cuda.is_available(), else sim"),
    "examples": ("N", "examples per campaign (default from the profile)"),
    "steps": ("N", "maximum steps per example (default from the profile)"),
    "seed": ("N", "base seed of campaigns and targets (default random, shown in the header)"),
    "report": ("PATH", "write the campaign report as JSON to PATH"),
    "profile": (
        "{dev,ci,nightly}",
        "how long each campaign runs: "
        + ", ".join(f"{name} = {profile.describe()}" for name, profile in PROFILES.items())
        + " (default dev: the built-in suite takes about a minute on sim)",
    ),
    "seconds": (
        "S",
        "time budget of each campaign's examples: no new example starts once S seconds have "
        "passed (default from the profile; given --graphmode-examples, none; 0: none)",
    ),
    "ranks": ("N", "data-parallel ranks, one process each (default 1; gloo on sim, NCCL on cuda)"),
    "shrink_seconds": (
        "S",
        f"time limit on shrinking a failure, in seconds (default {DEFAULT_SHRINK_SECONDS:g}; 0: "
        "report the failure as found)",
    ),
    "cpu_threads": (
        "N",
        f"torch's intra-op CPU threads while a campaign runs (default {DEFAULT_CPU_THREADS}: a "
        "campaign's host "
        "tensors are tiny, and on a busy machine parallel kernels wait for cores; 0: leave "
        "torch's setting)",
    ),
    "workers": (
        "{auto,N}",
        "processes per campaign with a time budget: the campaign and N-1 helper campaigns in "
        "child processes, each with a seed of its own, until the same deadline (default auto: "
        "the CPUs this process may use, at most 4; 1 in a pytest-xdist worker, or for a target "
        "factory a child process cannot import). A campaign asked for a count of examples, or "
        "with --graphmode-ranks above 1, runs in one process",
    ),
    "leading": (
        "{on,off}",
        "run each campaign's leading examples, fixed schedules, before its drawn ones (default "
        "on; off: every example drawn, to see what drawn schedules reach on their own)",
    ),
    "isolate": (
        "{auto,on,off}",
        "run each campaign in a child process, so that a device fault is reported as a failure "
        "and the session goes on (default auto: on for cuda, off for sim)",
    ),
}


@dataclass(frozen=True)
class GraphmodeSettings:
    """The resolved options of one run."""

    fuzz: bool
    fuzz_only: bool
    target: str
    backend_option: str
    profile: str
    examples: int
    steps: int
    seed: int
    seed_given: bool
    report: Path | None
    shrink_seconds: float
    isolate_option: str
    # the time budget of each campaign's examples (None: none)
    seconds: float | None = None
    # torch's intra-op CPU threads during a campaign (None: torch's own setting)
    cpu_threads: int | None = DEFAULT_CPU_THREADS
    ranks: int = 1
    # processes per time-budgeted campaign (None: auto, `auto_workers`)
    workers: int | None = None
    # the run's campaigns are spread over pytest-xdist workers (on the controller or a worker)
    distributed: bool = False
    # each campaign runs its leading examples (fixed schedules) before the drawn ones
    leading: bool = True

    @cached_property
    def backend(self) -> str:
        """`sim` or `cuda`; resolving `auto` imports torch, so only ask when there is work."""
        return resolve_backend(self.backend_option)

    @cached_property
    def factory(self) -> TargetFactory:
        """The target factory, imported once per run; raises `TargetError` when it cannot be."""
        return load_factory(self.target)


SETTINGS_KEY = pytest.StashKey[GraphmodeSettings]()
SUMMARY_KEY = pytest.StashKey[SessionSummary]()
FAILED_CAMPAIGN_KEY = pytest.StashKey[str]()
"""Set by the first campaign of this process that fails: what failed, for the later ones' skip
reason. Per process: on xdist every worker stops after its own first failure."""
TWINS_CHECKED_KEY = pytest.StashKey[bool]()
"""Set once an isolated campaign's child has checked the configured target's twins."""


def settings_of(config: pytest.Config) -> GraphmodeSettings:
    """The run's settings (set when the plugin configures pytest)."""
    return config.stash[SETTINGS_KEY]


def summary_of(config: pytest.Config) -> SessionSummary:
    """Every campaign of this process so far (on the xdist controller: of all workers)."""
    return config.stash[SUMMARY_KEY]


def resolve_backend(option: str) -> str:
    """`auto` -> `cuda` where torch sees a GPU, else `sim`; `sim` and `cuda` stay as they are."""
    from pytest_graphmode.runtime.backends import resolve

    return str(resolve(option))


def hypothesis_settings(max_examples: int) -> hypothesis.settings:
    """The Hypothesis settings of every campaign, whichever way it is started.

    No per-example deadline: the first steps of an example capture graphs, slow by design. Not
    derandomized: a campaign is reproducible through its seed (it keeps the constants of the
    project's loaded modules out of its draws: `fuzz.hypothesis_scope`). No database: a failure
    is reproduced from its replay snippet, not from a local cache. No `explain` phase: it re-runs
    hundreds of variants of the shrunk schedule, and the replay snippet already is the
    explanation.
    """
    from hypothesis import HealthCheck, Phase, settings

    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=False,
        database=None,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    )


def resolve(config: pytest.Config) -> GraphmodeSettings:
    """Read the run's options (command line over ini file); a bad value is a usage error."""
    raw = {name: _raw_option(config, name) for name in OPTIONS}
    backend = _choice("backend", raw["backend"], BACKENDS)
    profile = _choice("profile", raw["profile"], tuple(PROFILES))
    isolate = _choice("isolate", raw["isolate"], ISOLATE)
    leading = _choice("leading", raw["leading"], LEADING)
    chosen = PROFILES[profile]
    # A count asked for is a count run: the profile's time budget then no longer applies.
    seconds = chosen.seconds if raw["examples"] is None else None
    if raw["seconds"] is not None:
        seconds = _parse_seconds("seconds", raw["seconds"]) or None
    workerinput = getattr(config, "workerinput", None)
    seed_given = raw["seed"] is not None
    if workerinput is not None and WORKER_SEED in workerinput:
        seed = int(workerinput[WORKER_SEED])
    elif raw["seed"] is not None:
        seed = _parse_int("seed", raw["seed"], minimum=0)
    else:
        seed = random.Random().getrandbits(32)
    fuzz_only = bool(config.getoption("graphmode_fuzz_only"))
    ranks = 1 if raw["ranks"] is None else _parse_int("ranks", raw["ranks"])
    return GraphmodeSettings(
        fuzz=fuzz_only or bool(config.getoption("graphmode_fuzz")),
        fuzz_only=fuzz_only,
        target=raw["target"] or DEFAULT_TARGET,
        backend_option=backend,
        profile=profile,
        examples=chosen.examples
        if raw["examples"] is None
        else _parse_int("examples", raw["examples"]),
        steps=chosen.steps if raw["steps"] is None else _parse_int("steps", raw["steps"]),
        seconds=seconds,
        seed=seed,
        seed_given=seed_given,
        report=None if raw["report"] is None else Path(raw["report"]),
        shrink_seconds=_parse_seconds("shrink_seconds", raw["shrink_seconds"]),
        isolate_option=isolate,
        ranks=ranks,
        cpu_threads=_cpu_threads(raw["cpu_threads"]),
        workers=_workers(raw["workers"], seconds, ranks),
        distributed=workerinput is not None or bool(getattr(config.option, "numprocesses", None)),
        leading=leading == "on",
    )


def report_path_problem(path: Path) -> str | None:
    """Why the report cannot be written to `path` (None: it can), asked before any campaign runs
    so that a typo does not cost a whole campaign. Creates the missing parent folders, as writing
    the report would."""
    if path.is_dir():
        return f"{path} is a directory; give a file name, e.g. {path / 'graphmode-report.json'}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the folder {path.parent}: {exc.strerror or exc}"
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK):
        return f"{target} is not writable"
    return None


def _raw_option(config: pytest.Config, name: str) -> str | None:
    """The command line wins over the ini file; empty means unset."""
    value = config.getoption(f"graphmode_{name}")
    if value is None:
        value = config.getini(f"graphmode_{name}")
    text = str(value).strip()
    return text or None


MAX_AUTO_WORKERS = 4
"""`auto_workers` uses at most this many processes per campaign: past it, process starts and
shared memory bandwidth eat what more cores would add, and each cuda process holds a context of
its own on the GPU."""


def auto_workers() -> int:
    """Processes per time-budgeted campaign where none were asked for: the CPUs this process may
    run on, at most `MAX_AUTO_WORKERS`; 1 inside a pytest-xdist worker or a process it started
    (its siblings use the other cores already)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return 1
    return max(1, min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0))))


def workers_per_campaign(settings: GraphmodeSettings, seconds: float | None) -> int:
    """Processes per campaign of the run with the time budget `seconds`: `--graphmode-workers`,
    else `auto_workers()`, or 1 where pytest-xdist spreads the campaigns over the cores already;
    1 without a time budget or with ranks."""
    if seconds is None or settings.ranks > 1:
        return 1
    if settings.workers is not None:
        return settings.workers
    return 1 if settings.distributed else auto_workers()


def option_flag(name: str) -> str:
    """The command-line spelling of option `name`."""
    return f"--graphmode-{name.replace('_', '-')}"


def _choice(name: str, text: str | None, choices: tuple[str, ...]) -> str:
    """Option `name`'s value, one of `choices`; unset, the first of them (its default)."""
    value = text or choices[0]
    if value not in choices:
        raise pytest.UsageError(
            f"{option_flag(name)} / graphmode_{name}: {value!r} is not one of {choices}"
        )
    return value


def _parse_seconds(name: str, text: str | None) -> float:
    if text is None:
        return DEFAULT_SHRINK_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise pytest.UsageError(
            f"{option_flag(name)} / graphmode_{name}: {text!r} is not a number of seconds >= 0"
        )
    return value


def _workers(text: str | None, seconds: float | None, ranks: int) -> int | None:
    """--graphmode-workers: None for auto; a count above 1 only where campaigns can use it."""
    if text is None or text == "auto":
        return None
    workers = _parse_int("workers", text)
    if workers > 1 and seconds is None:
        raise pytest.UsageError(
            f"--graphmode-workers / graphmode_workers: {workers} processes need a time budget "
            "(the dev profile, or --graphmode-seconds): a campaign of a count of examples runs "
            "that count in one process"
        )
    if workers > 1 and ranks > 1:
        raise pytest.UsageError(
            f"--graphmode-workers / graphmode_workers: {workers} processes cannot be combined "
            "with --graphmode-ranks above 1 (each rank is a process already)"
        )
    return workers


def _cpu_threads(text: str | None) -> int | None:
    """--graphmode-cpu-threads: the default when unset, None (torch's own setting) for 0."""
    if text is None:
        return DEFAULT_CPU_THREADS
    return _parse_int("cpu_threads", text, minimum=0) or None


def _parse_int(name: str, text: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise pytest.UsageError(
            f"{option_flag(name)} / graphmode_{name}: {text!r} is not an integer >= {minimum}"
        )
    return value
