"""pytest entry point (`pytest11: graphmode`): options, markers, the built-in suite, the summary.

Imports neither torch nor CUDA at module level: pytest loads this plugin for every run, also in
projects that never fuzz anything. torch is imported only once `--graphmode-fuzz` asks for work.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from collections.abc import Generator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

from pytest_graphmode.loader import DEFAULT_TARGET, TargetError, load_factory
from pytest_graphmode.report import SessionSummary, summary_lines, write_report

BACKENDS = ("auto", "sim", "cuda")
# (examples, steps per example) of each profile; --graphmode-examples/-steps override them.
PROFILES = {"dev": (10, 8), "ci": (50, 12), "nightly": (500, 24)}
BUILTIN_SUITE = Path(__file__).parent / "_builtin" / "suite.py"
_WORKER_SUMMARY = "graphmode_summary"
_WORKER_SEED = "graphmode_seed"

# name -> (metavar, help); every `--graphmode-NAME` option has an ini twin `graphmode_NAME`.
_OPTIONS: dict[str, tuple[str, str]] = {
    "target": (
        "MODULE:FACTORY",
        f"runner under test (default {DEFAULT_TARGET})",
    ),
    "backend": ("{auto,sim,cuda}", "default auto: cuda when torch.cuda.is_available(), else sim"),
    "examples": ("N", "examples per campaign (default from the profile)"),
    "steps": ("N", "maximum steps per example (default from the profile)"),
    "seed": ("N", "base seed of campaigns and targets (default random, shown in the header)"),
    "report": ("PATH", "write the campaign report as JSON to PATH"),
    "profile": ("{dev,ci,nightly}", "examples and steps per campaign (default dev)"),
    "ranks": ("N", "data-parallel ranks, one process each (default 1; gloo on sim, NCCL on cuda)"),
}


@dataclass(frozen=True)
class GraphmodeSettings:
    """The resolved options of one run."""

    fuzz: bool
    target: str
    backend_option: str
    profile: str
    examples: int
    steps: int
    seed: int
    seed_given: bool
    report: Path | None
    ranks: int = 1

    @cached_property
    def backend(self) -> str:
        """`sim` or `cuda`; resolving `auto` imports torch, so only ask when there is work."""
        return resolve_backend(self.backend_option)


SETTINGS_KEY = pytest.StashKey[GraphmodeSettings]()
SUMMARY_KEY = pytest.StashKey[SessionSummary]()


def resolve_backend(option: str) -> str:
    """`auto` -> `cuda` where torch sees a GPU, else `sim`; `sim` and `cuda` stay as they are."""
    from pytest_graphmode.runtime.backends import resolve

    return str(resolve(option))


def settings_of(config: pytest.Config) -> GraphmodeSettings:
    return config.stash[SETTINGS_KEY]


def summary_of(config: pytest.Config) -> SessionSummary:
    return config.stash[SUMMARY_KEY]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphmode", "graph-mode fuzzing (pytest-graphmode)")
    group.addoption(
        "--graphmode-fuzz",
        action="store_true",
        default=False,
        help="run the graph-mode fuzz campaign against the configured target",
    )
    for name, (metavar, text) in _OPTIONS.items():
        group.addoption(f"--graphmode-{name}", default=None, metavar=metavar, help=text)
        parser.addini(f"graphmode_{name}", f"{text} [--graphmode-{name}]", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "graphmode_fuzz: a graph-mode fuzz test; runs only with --graphmode-fuzz"
    )
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped where none is available")
    settings = _resolve_settings(config)
    config.stash[SETTINGS_KEY] = settings
    config.stash[SUMMARY_KEY] = SessionSummary()
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and settings.fuzz and settings.backend_option != "sim":
        # Must happen before anything starts CUDA in this worker process.
        _pin_worker_gpu(str(workerinput["workerid"]))
    if settings.fuzz:
        try:
            load_factory(settings.target)
        except TargetError as exc:
            raise pytest.UsageError(f"--graphmode-target / graphmode_target: {exc}") from exc
        if settings.backend_option == "cuda":
            _require_cuda()
    from pytest_graphmode import fixtures

    if not config.pluginmanager.is_registered(fixtures):
        config.pluginmanager.register(fixtures, "graphmode-fixtures")
    if config.pluginmanager.hasplugin("benchmark"):
        # graph_benchmark builds on pytest-benchmark's fixture: offered only where it is installed.
        from pytest_graphmode import benchmark

        if not config.pluginmanager.is_registered(benchmark):
            config.pluginmanager.register(benchmark, "graphmode-benchmark")
    if settings.fuzz:
        fixtures.hypothesis_profile(settings.profile)


def pytest_report_header(config: pytest.Config) -> str | None:
    settings = settings_of(config)
    if not settings.fuzz:
        return None
    asked = (
        "" if settings.backend_option == settings.backend else f" (asked {settings.backend_option})"
    )
    seed_origin = "given" if settings.seed_given else "random; rerun with --graphmode-seed"
    return (
        f"graphmode: backend={settings.backend}{asked} target={settings.target} "
        f"seed={settings.seed} ({seed_origin}) profile={settings.profile} "
        f"examples={settings.examples} steps={settings.steps}"
        + (f" ranks={settings.ranks}" if settings.ranks > 1 else "")
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    settings = settings_of(config)
    if settings.fuzz and not any(item.get_closest_marker("graphmode_fuzz") for item in items):
        # A project without fuzz tests of its own gets the built-in suite; tryfirst so that -k
        # and -m can still deselect its items afterwards.
        items.extend(_builtin_items(session))
    if not settings.fuzz:
        off = pytest.mark.skip(reason="graph-mode fuzz test: run with --graphmode-fuzz")
        for item in items:
            if item.get_closest_marker("graphmode_fuzz"):
                item.add_marker(off)
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if cuda_items and not _cuda_available():
        no_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
        for item in cuda_items:
            item.add_marker(no_gpu)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    fuzz = sys.modules.get("pytest_graphmode.fuzz")  # loaded wherever a campaign could fail
    if fuzz is not None and call.excinfo is not None and report.failed:
        failure = call.excinfo.value
        if isinstance(failure, fuzz.GraphmodeFailure):
            # The message already says what to act on (check, step, values, replay snippet);
            # the engine's traceback would only bury it.
            report.longrepr = str(failure)
    return report


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: every worker gets the same base seed."""
    node.workerinput[_WORKER_SEED] = settings_of(node.config).seed


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """xdist controller: fold in a worker's campaigns."""
    data = getattr(node, "workeroutput", {}).get(_WORKER_SUMMARY)
    if data is not None:
        summary_of(node.config).merge(SessionSummary.from_json(data))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    summary = summary_of(config)
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[_WORKER_SUMMARY] = summary.to_json()
        return
    settings = settings_of(config)
    if settings.report is not None and (settings.fuzz or summary.campaigns):
        write_report(settings.report, summary, _run_facts(settings))
    if summary.failures and session.exitstatus == pytest.ExitCode.OK:
        # A gate: a failed check fails the run even where a test swallowed the exception.
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    settings = settings_of(config)
    summary = summary_of(config)
    if not (settings.fuzz or summary.campaigns) or hasattr(config, "workerinput"):
        return
    terminalreporter.write_sep("=", "graphmode fuzz summary")
    for line in summary_lines(summary):
        terminalreporter.write_line(line)
    if settings.report is not None:
        terminalreporter.write_line(f"report: {settings.report}")


def _resolve_settings(config: pytest.Config) -> GraphmodeSettings:
    raw = {name: _raw_option(config, name) for name in _OPTIONS}
    backend = raw["backend"] or "auto"
    if backend not in BACKENDS:
        raise pytest.UsageError(
            f"--graphmode-backend / graphmode_backend: {backend!r} is not one of {BACKENDS}"
        )
    profile = raw["profile"] or "dev"
    if profile not in PROFILES:
        raise pytest.UsageError(
            f"--graphmode-profile / graphmode_profile: {profile!r} is not one of {tuple(PROFILES)}"
        )
    examples, steps = PROFILES[profile]
    workerinput = getattr(config, "workerinput", None)
    seed_given = raw["seed"] is not None
    if workerinput is not None and _WORKER_SEED in workerinput:
        seed = int(workerinput[_WORKER_SEED])
    elif raw["seed"] is not None:
        seed = _parse_int("seed", raw["seed"], minimum=0)
    else:
        seed = random.Random().getrandbits(32)
    return GraphmodeSettings(
        fuzz=bool(config.getoption("graphmode_fuzz")),
        target=raw["target"] or DEFAULT_TARGET,
        backend_option=backend,
        profile=profile,
        examples=examples if raw["examples"] is None else _parse_int("examples", raw["examples"]),
        steps=steps if raw["steps"] is None else _parse_int("steps", raw["steps"]),
        seed=seed,
        seed_given=seed_given,
        report=None if raw["report"] is None else Path(raw["report"]),
        ranks=1 if raw["ranks"] is None else _parse_int("ranks", raw["ranks"]),
    )


def _raw_option(config: pytest.Config, name: str) -> str | None:
    """The command line wins over the ini file; empty means unset."""
    value = config.getoption(f"graphmode_{name}")
    if value is None:
        value = config.getini(f"graphmode_{name}")
    text = str(value).strip()
    return text or None


def _parse_int(name: str, text: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise pytest.UsageError(
            f"--graphmode-{name} / graphmode_{name}: {text!r} is not an integer >= {minimum}"
        )
    return value


def _run_facts(settings: GraphmodeSettings) -> dict[str, Any]:
    return {
        "target": settings.target,
        "backend": settings.backend,
        "profile": settings.profile,
        "seed": settings.seed,
        "examples_per_campaign": settings.examples,
        "steps_per_example": settings.steps,
        "ranks": settings.ranks,
    }


def _builtin_items(session: pytest.Session) -> list[pytest.Item]:
    # genitems reports the collection like any other file's, so counts and errors show as usual.
    return list(session.genitems(pytest.Module.from_parent(session, path=BUILTIN_SUITE)))


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _require_cuda() -> None:
    if not _cuda_available():
        raise pytest.UsageError(
            "--graphmode-backend=cuda but torch.cuda.is_available() is False: run on a GPU "
            "machine with a CUDA build of torch, or use --graphmode-backend=sim (or auto)"
        )


def _pin_worker_gpu(workerid: str) -> None:
    """Give xdist worker gwN the N-th visible GPU (round robin), indexing into any list already
    set in CUDA_VISIBLE_DEVICES, so workers on a multi-GPU runner do not share one device."""
    index = int(workerid.removeprefix("gw"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        devices = _gpu_indices()
    if devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[index % len(devices)]


def _gpu_indices() -> list[str]:
    """GPU indices from nvidia-smi: asking torch would start CUDA before the device is pinned."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    done = subprocess.run(
        [smi, "--query-gpu=index", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise pytest.UsageError(
            f"nvidia-smi failed ({done.stderr.strip()}); set CUDA_VISIBLE_DEVICES to the GPUs "
            "the xdist workers may use, e.g. CUDA_VISIBLE_DEVICES=0,1"
        )
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]
