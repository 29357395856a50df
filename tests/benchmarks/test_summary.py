"""`benchmarks/summary.py`: the figures it reads out of a suite's benchmark JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SUMMARY = Path(__file__).parents[2] / "benchmarks" / "summary.py"


@pytest.fixture(scope="module")
def summary() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_summary", SUMMARY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _entry(name: str, candidate: str | None, median: float, **info: Any) -> dict[str, Any]:
    params = None if candidate is None else {"candidate": candidate}
    return {"name": name, "params": params, "stats": {"median": median}, "extra_info": info}


def _sweep(strategy: str, order: str, physical: list[int]) -> dict[str, Any]:
    info = {
        "strategy": strategy,
        "order": order,
        "granularity": 2 << 20,
        "capture_total_s": 1.0,
        "size": list(range(len(physical))),
        "physical_bytes": physical,
        "virtual_bytes": physical,
    }
    return _entry(f"test_capture_sweep[{strategy}-{order}]", None, 1.0, **info)


def test_speedup_per_batch_size_is_reported(summary: ModuleType) -> None:
    info = {"phase": "decode", "batch_size": 1, "speedup": 4.5}
    entries = [
        _entry("test_replay_vs_eager[decode-bs1-eager]", "eager", 9.0, **info),
        _entry("test_replay_vs_eager[decode-bs1-replay]", "replay", 2.0, **info),
    ]
    assert "replay speedup over eager, decode (target >= 4x at bs1): bs1 4.50x" in (
        summary.summary_lines(entries)
    )


def test_vmm_beyond_one_chunk_over_the_largest_shape_is_called_out(summary: ModuleType) -> None:
    mib = 1 << 20
    entries = [
        _sweep("separate", "largest_first", [10 * mib, 15 * mib]),
        _sweep("vmm", "ascending", [2 * mib, 14 * mib]),
    ]
    lines = summary.summary_lines(entries)
    assert "vmm ascending: +4.0 MiB over the largest shape alone, beyond one 2 MiB chunk" in (
        " ".join(lines)
    )


def test_a_file_without_benchmarks_is_refused(summary: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"results": []}))
    with pytest.raises(SystemExit, match="not pytest-benchmark output"):
        summary.load_entries(path)
