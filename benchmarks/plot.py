"""Plot the suite's results into docs/: latency vs batch size, graph memory vs captured shapes.

    python benchmarks/plot.py bench.json [--memory memory.json] [--out docs]

Needs matplotlib (`pip install pytest-graphmode[plot]`). The memory table comes from
`--memory` (written by `--graph-memory-json`) or else from the sweeps' `extra_info` in the
benchmark JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from summary import MIB, Entry, function_of, load_entries, sweeps

# Entries whose median is a step latency at a batch size, and how to name their series.
LATENCY_TESTS = {
    "test_replay_vs_eager": lambda info, candidate: f"{info['phase']} {candidate}",
    "test_executor_step_vs_raw_replay": lambda info, candidate: candidate,
    "test_executor_vs_peers": lambda info, candidate: candidate,
}


def latency_series(entries: list[Entry]) -> dict[str, list[tuple[int, float]]]:
    """Series name -> sorted (batch size, median seconds); one series per candidate."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for entry in entries:
        name = LATENCY_TESTS.get(function_of(entry))
        candidate = (entry.get("params") or {}).get("candidate")
        if name is None or candidate is None:
            continue
        info = entry["extra_info"]
        series[name(info, candidate)][int(info["batch_size"])] = float(entry["stats"]["median"])
    return {label: sorted(points.items()) for label, points in sorted(series.items())}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a GPU machine
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit(
            "plot.py needs matplotlib: pip install 'pytest-graphmode[plot]'"
        ) from error
    return plt


def plot_latency(entries: list[Entry], path: Path) -> None:
    series = latency_series(entries)
    if not series:
        raise SystemExit("no latency entries in the benchmark JSON: run benchmarks/ first")
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 5))
    for label, points in series.items():
        sizes, medians = zip(*points, strict=True)
        axes.plot(sizes, [m * 1e6 for m in medians], marker="o", label=label)
    axes.set(xscale="log", yscale="log", xlabel="batch size (requests)", ylabel="median step (us)")
    axes.set_title("Step latency: eager, graph replay, executor and peers")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_memory(records: list[dict[str, Any]], path: Path) -> None:
    if not records:
        raise SystemExit("no capture sweeps found: run benchmarks/test_graph_memory.py first")
    plt = _pyplot()
    figure, (physical, virtual) = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    for record in records:
        label = f"{record['strategy']} {record['order'].replace('_', '-')}"
        shapes = range(1, len(record["size"]) + 1)
        physical.plot(shapes, [b / MIB for b in record["physical_bytes"]], marker=".", label=label)
        virtual.plot(shapes, [b / MIB for b in record["virtual_bytes"]], marker=".", label=label)
    physical.set(xlabel="captured shapes", ylabel="physical MiB", title="Physical graph memory")
    virtual.set(xlabel="captured shapes", ylabel="virtual MiB", title="Virtual address space")
    for axes in (physical, virtual):
        axes.grid(True, alpha=0.3)
    physical.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmark_json", type=Path)
    parser.add_argument("--memory", type=Path, help="the --graph-memory-json file")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder for the PNGs")
    args = parser.parse_args()
    entries = load_entries(args.benchmark_json)
    records = json.loads(args.memory.read_text()) if args.memory else sweeps(entries)
    args.out.mkdir(parents=True, exist_ok=True)
    plot_latency(entries, args.out / "bench-latency.png")
    plot_memory(records, args.out / "bench-memory.png")
    print(f"wrote {args.out / 'bench-latency.png'} and {args.out / 'bench-memory.png'}")


if __name__ == "__main__":
    main()
