"""pytest entry point (`pytest11: graphmode`): options, markers, the built-in suite, the summary.

Imports neither torch nor CUDA at module level: pytest loads this plugin for every run, also in
projects that never fuzz anything. torch is imported only once `--graphmode-fuzz` asks for work.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from pytest_graphmode import fixtures
from pytest_graphmode.campaign_stats import SessionSummary
from pytest_graphmode.failure import GraphmodeFailure
from pytest_graphmode.loader import TargetError, check_twins
from pytest_graphmode.report import campaign_line, check_glossary, summary_lines, write_report
from pytest_graphmode.settings import (
    OPTIONS,
    SETTINGS_KEY,
    SUMMARY_KEY,
    WORKER_SEED,
    GraphmodeSettings,
    option_flag,
    report_path_problem,
    resolve,
    settings_of,
    summary_of,
    workers_per_campaign,
)
from pytest_graphmode.skipped import SkippedCampaigns, mark_if_skipped_campaign, skipped_lines

BUILTIN_SUITE = Path(__file__).parent / "_builtin" / "suite.py"
_WORKER_SUMMARY = "graphmode_summary"
CAMPAIGNS_PROPERTY = "graphmode_campaigns"
"""`user_properties` key of a test report: what the test's campaigns did (an xdist worker sends it
to the controller with the report, which prints a line for the test)."""
_RAN = pytest.StashKey[dict[str, Any]]()
_SKIPPED = "graphmode-skipped-campaigns"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphmode", "graph-mode fuzzing (pytest-graphmode)")
    group.addoption(
        "--graphmode-fuzz",
        action="store_true",
        default=False,
        help="run the graph-mode fuzz campaign against the configured target",
    )
    group.addoption(
        "--graphmode-fuzz-only",
        action="store_true",
        default=False,
        help="--graphmode-fuzz, and deselect every test that is not a graph-mode fuzz test "
        "(the project's own tests are collected but not run)",
    )
    for name, (metavar, text) in OPTIONS.items():
        flag = option_flag(name)
        group.addoption(flag, dest=f"graphmode_{name}", default=None, metavar=metavar, help=text)
        parser.addini(f"graphmode_{name}", f"{text} [{flag}]", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "graphmode_fuzz: a graph-mode fuzz test; runs only with --graphmode-fuzz"
    )
    config.addinivalue_line(
        "markers", "graphmode_cuda: needs a CUDA GPU; skipped where none is available"
    )
    settings = resolve(config)
    config.stash[SETTINGS_KEY] = settings
    config.stash[SUMMARY_KEY] = SessionSummary()
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and settings.fuzz and settings.backend_option != "sim":
        # Must happen before anything starts CUDA in this worker process.
        _pin_worker_gpu(str(workerinput["workerid"]))
    if settings.fuzz:
        try:
            settings.factory  # noqa: B018 - imported now, so a bad target is a usage error
        except TargetError as exc:
            raise pytest.UsageError(f"--graphmode-target / graphmode_target: {exc}") from exc
        if settings.backend_option == "cuda":
            _require_cuda()
    if not config.pluginmanager.is_registered(fixtures):
        config.pluginmanager.register(fixtures, "graphmode-fixtures")
    if config.pluginmanager.get_plugin(_SKIPPED) is None:
        config.pluginmanager.register(SkippedCampaigns(), _SKIPPED)
    if config.pluginmanager.hasplugin("benchmark"):
        # graphmode_benchmark builds on pytest-benchmark's fixture: offered where it is installed.
        from pytest_graphmode import benchmark

        if not config.pluginmanager.is_registered(benchmark):
            config.pluginmanager.register(benchmark, "graphmode-benchmark")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Reject what would fail every campaign before the first one starts: an unwritable report
    path, a target that breaks the contract or whose factory raises. Once per run: on the xdist
    controller, not on every worker. Where campaigns run in child processes (cuda), the twins are
    not made here: each campaign's child checks them first, and a target that breaks the contract
    fails that campaign's test."""
    config = session.config
    settings = settings_of(config)
    if not settings.fuzz or hasattr(config, "workerinput"):
        return
    if settings.report is not None:
        problem = report_path_problem(settings.report)
        if problem is not None:
            raise pytest.UsageError(f"--graphmode-report / graphmode_report: {problem}")
    try:
        if fixtures.twins_checked_in_child(settings):
            return  # the first campaign's child process checks them (`run_isolated`)
        check_twins(settings.factory, seed=settings.seed, backend=settings.backend)
    except TargetError as exc:
        raise pytest.UsageError(f"--graphmode-target={settings.target}: {exc}") from exc


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
        + (
            f"examples<={settings.examples} seconds={settings.seconds:g}"
            if settings.seconds
            else f"examples={settings.examples}"
        )
        + f" steps={settings.steps}"
        + (f" ranks={settings.ranks}" if settings.ranks > 1 else "")
        + ("" if settings.leading else " leading=off")
        # Only where a campaign can take helpers: a time budget, one rank.
        + (
            f" workers={workers_per_campaign(settings, settings.seconds)}"
            if settings.seconds and settings.ranks == 1
            else ""
        )
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
    if settings.fuzz_only:
        fuzz_items = [item for item in items if item.get_closest_marker("graphmode_fuzz")]
        others = [item for item in items if not item.get_closest_marker("graphmode_fuzz")]
        if others:
            config.hook.pytest_deselected(items=others)
            items[:] = fuzz_items
    if not settings.fuzz:
        off = pytest.mark.skip(reason="graph-mode fuzz test: run with --graphmode-fuzz")
        for item in items:
            if item.get_closest_marker("graphmode_fuzz"):
                item.add_marker(off)
    cuda_items = [item for item in items if item.get_closest_marker("graphmode_cuda")]
    if cuda_items and not _cuda_available():
        no_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
        for item in cuda_items:
            item.add_marker(no_gpu)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    mark_if_skipped_campaign(item, report)
    if call.when == "call" and _RAN in item.stash:
        report.user_properties.append((CAMPAIGNS_PROPERTY, item.stash[_RAN]))
    if call.excinfo is not None and report.failed:
        failure = call.excinfo.value
        if isinstance(failure, GraphmodeFailure):
            # The message already says what to act on (check, step, values, replay snippet);
            # the engine's traceback would only bury it.
            report.longrepr = str(failure)
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """xdist controller: a line per test that ran campaigns, since workers draw no progress line."""
    node: Any = getattr(report, "node", None)
    if node is None:  # not a report sent by an xdist worker
        return
    for key, ran in report.user_properties:
        if key != CAMPAIGNS_PROPERTY or not isinstance(ran, dict):
            continue
        reporter = node.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            if reporter._tw.width_of_current_line:  # after xdist's progress dots
                reporter.line("")
            reporter.write_line(f"[{node.gateway.id}] {campaign_line(report.nodeid, ran)}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Note what the test's campaigns did, for the line the xdist controller prints."""
    summary = summary_of(item.config)
    campaigns, before = summary.campaigns, summary.stats
    try:
        return (yield)
    finally:
        if hasattr(item.config, "workerinput") and summary.campaigns > campaigns:
            after = summary.stats
            item.stash[_RAN] = {
                "campaigns": summary.campaigns - campaigns,
                "examples": after.examples - before.examples,
                "steps": after.steps - before.steps,
                "failures": len(after.failures) - len(before.failures),
                "seconds": round(after.seconds - before.seconds, 3),
            }


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: every worker gets the same base seed."""
    node.workerinput[WORKER_SEED] = settings_of(node.config).seed


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
        write_report(settings.report, summary, _run_facts(settings), _skipped(config))
    if summary.stats.failures and session.exitstatus == pytest.ExitCode.OK:
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
    checks = _check_descriptions() if summary.campaigns else {}
    for line in summary_lines(summary, checks=tuple(checks), base_seed=settings.seed):
        terminalreporter.write_line(line)
    for line in skipped_lines(_skipped(config)):
        terminalreporter.write_line(line)
    for line in check_glossary(summary, checks, verbose=config.get_verbosity() > 0):
        terminalreporter.write_line(line)
    if settings.report is not None:
        terminalreporter.write_line(f"report: {settings.report}")


def _skipped(config: pytest.Config) -> dict[str, str]:
    collector = config.pluginmanager.get_plugin(_SKIPPED)
    return dict(collector.reasons) if isinstance(collector, SkippedCampaigns) else {}


def _check_descriptions() -> dict[str, str]:
    """Every check's name -> the first sentence of its oracle's docstring, in registry order;
    for the checks no oracle function judges, what they see."""
    from pytest_graphmode.fuzz import rank_checks, sampling_check
    from pytest_graphmode.fuzz.registry import CHECKS, NO_DEVICE_FAULT, ORACLE_MODULES

    judged_elsewhere = {
        # `sampling_independent`'s oracle, run on the greedy company twin under this name.
        sampling_check.COMPANY_INDEPENDENT: "A request's logits and argmax do not depend on its "
        "company, row or KV blocks, greedy or not (about half of the greedy requests run alone, "
        "in reverse order, from other blocks)",
        NO_DEVICE_FAULT: "The device never faulted and the campaign's process never died (an "
        "illegal memory access, a device-side assert, an abort), seen by the process that "
        "started it",
        rank_checks.RANKS_ARRIVE: "Every rank arrives at every collective the others wait in, "
        "within the timeout",
    }
    descriptions = {}
    for name in CHECKS:
        oracle = next((getattr(m, name) for m in ORACLE_MODULES if hasattr(m, name)), None)
        doc = " ".join((getattr(oracle, "__doc__", None) or "").split())
        described = doc.split(". ")[0].rstrip(".") or judged_elsewhere.get(name)
        descriptions[name] = described or "(no description)"
    return descriptions


def _run_facts(settings: GraphmodeSettings) -> dict[str, Any]:
    return {
        "target": settings.target,
        "backend": settings.backend,
        "profile": settings.profile,
        "seed": settings.seed,
        "examples_per_campaign": settings.examples,
        "seconds_per_campaign": settings.seconds,
        "steps_per_example": settings.steps,
        "ranks": settings.ranks,
        "shrink_seconds": settings.shrink_seconds,
        "isolate": settings.isolate_option,
        "cpu_threads": settings.cpu_threads,
        "leading": settings.leading,
        "workers": workers_per_campaign(settings, settings.seconds),
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
