"""Read a `--benchmark-json` file of the suite and print its figures against the targets.

    python benchmarks/summary.py bench.json

The targets are reported, never asserted: a benchmark measures, the reader judges.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Entry = dict[str, Any]
MIB = 1024 * 1024


def load_entries(path: Path) -> list[Entry]:
    """The `benchmarks` list of a pytest-benchmark JSON file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"cannot read benchmark JSON {path}: {error}") from error
    if not isinstance(data, dict) or "benchmarks" not in data:
        raise SystemExit(f"{path} is not pytest-benchmark output: write it with --benchmark-json")
    return list(data["benchmarks"])


def function_of(entry: Entry) -> str:
    return str(entry["name"]).split("[")[0]


def entries_of(entries: list[Entry], test: str) -> Iterator[Entry]:
    return (e for e in entries if function_of(e) == test)


def sweeps(entries: list[Entry]) -> list[dict[str, Any]]:
    """The capture sweeps' records (strategy, order, sizes, bytes after each capture)."""
    return [e["extra_info"] for e in entries_of(entries, "test_capture_sweep")]


def _ratios(entries: list[Entry], test: str, key: str) -> dict[int, float]:
    return {
        int(e["extra_info"]["batch_size"]): float(e["extra_info"][key])
        for e in entries_of(entries, test)
        if key in e["extra_info"]
    }


def _fmt(ratios: dict[int, float]) -> str:
    return ", ".join(f"bs{bs} {ratio:.2f}x" for bs, ratio in sorted(ratios.items())) or "not run"


def summary_lines(entries: list[Entry]) -> list[str]:
    lines = []
    speedups = {
        (e["extra_info"]["phase"], int(e["extra_info"]["batch_size"])): e["extra_info"]["speedup"]
        for e in entries_of(entries, "test_replay_vs_eager")
        if "speedup" in e["extra_info"]
    }
    for phase in ("decode", "spec"):
        row = {bs: s for (p, bs), s in speedups.items() if p == phase}
        lines.append(f"replay speedup over eager, {phase} (target >= 4x at bs1): {_fmt(row)}")
    overhead = _ratios(entries, "test_executor_step_vs_raw_replay", "executor_over_replay")
    lines.append(f"executor step / raw replay (target <= 1.10x): {_fmt(overhead)}")
    for peer in ("compile_cudagraphs", "graphed_callables"):
        row = _ratios(entries, "test_executor_vs_peers", f"executor_over_{peer}")
        lines.append(f"executor step / {peer} (target <= 1.00x): {_fmt(row)}")
    for e in entries_of(entries, "test_packed_copy_vs_copy_per_field"):
        info = e["extra_info"]
        if e["params"]["candidate"] == "packed_copy" and "per_field_over_packed" in info:
            lines.append(
                f"staging {info['staged_bytes']} B: {info['fields']} copies take "
                f"{info['per_field_over_packed']:.2f}x one packed copy"
            )
    lines += _memory_lines(entries)
    for e in entries_of(entries, "test_fuzz_campaign_throughput"):
        info = e["extra_info"]
        lines.append(
            f"fuzz: {info['examples_per_s']:.2f} examples/s, {info['steps_per_s']:.1f} steps/s "
            f"({info['examples']} examples, {info['steps']} steps)"
        )
    for e in entries_of(entries, "test_engine_speedup"):
        info = e["extra_info"]
        rates = ", ".join(f"{name} {rate:.2f}" for name, rate in info["steps_per_s"].items())
        over = ", ".join(
            f"{ratio:.2f}x over {name}" for name, ratio in info["speedup_over"].items()
        )
        lines.append(f"engine steps/s (median): {rates}; current {over or 'alone'}")
    return lines


def _memory_lines(entries: list[Entry]) -> list[str]:
    lines = []
    records = sweeps(entries)
    largest_alone = next(
        (r["physical_bytes"][0] for r in records if r["strategy"] == "separate"), None
    )
    for r in records:
        lines.append(
            f"capture {len(r['size'])} sizes, {r['strategy']} {r['order']}: "
            f"{r['capture_total_s']:.2f} s, physical {r['physical_bytes'][-1] / MIB:.1f} MiB, "
            f"virtual {r['virtual_bytes'][-1] / MIB:.1f} MiB"
        )
    shared_first = next(
        (r for r in records if r["strategy"] == "shared" and r["order"] == "largest_first"), None
    )
    if largest_alone is not None:
        for r in records:
            if r["strategy"] == "vmm":
                if shared_first is not None:
                    lines.append(
                        f"vmm {r['order']} / shared largest_first physical: "
                        f"{r['physical_bytes'][-1] / shared_first['physical_bytes'][-1]:.2f}x "
                        "(target below 1)"
                    )
                excess = r["physical_bytes"][-1] - largest_alone
                verdict = "within" if excess <= r["granularity"] else "beyond"
                lines.append(
                    f"vmm {r['order']}: {excess / MIB:+.1f} MiB over the largest shape alone, "
                    f"{verdict} one {r['granularity'] / MIB:.0f} MiB chunk (target: within)"
                )
    latency = {
        e["extra_info"]["strategy"]: e["stats"]["median"]
        for e in entries_of(entries, "test_replay_latency_by_strategy")
    }
    if "vmm" in latency and "shared" in latency:
        change = latency["vmm"] / latency["shared"] - 1
        lines.append(f"vmm step latency vs shared: {change:+.1%} (target within +3%)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmark_json", type=Path)
    args = parser.parse_args()
    for line in summary_lines(load_entries(args.benchmark_json)):
        print(line)


if __name__ == "__main__":
    main()
