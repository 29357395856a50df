"""Command line: `python -m pytest_graphmode.planner plan|replay|simulate ...`."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from pytest_graphmode.planner._files import (
    read_histogram,
    read_latency,
    read_sizes,
    read_trace,
    write_histogram,
)
from pytest_graphmode.planner._plan import CostModel, Plan, evaluate
from pytest_graphmode.planner._search import plan
from pytest_graphmode.planner._trace import replay
from pytest_graphmode.planner._traffic import decode_runs, halves, read_azure_trace
from pytest_graphmode.runtime.buckets import KINDS, BucketTable, schedule


def _sizes_argument(text: str) -> list[int]:
    try:
        return [int(token) for token in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 1,2,8; got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_graphmode.planner",
        description="Plan capture sizes for a histogram, replay traces, simulate traffic.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    planning = commands.add_parser("plan", help="the exact plan and the engines' schedules")
    planning.add_argument("--histogram", required=True, type=Path, help="CSV batch_size,count")
    planning.add_argument("--max-graphs", type=int, help="at most this many graphs")
    planning.add_argument(
        "--align",
        type=int,
        default=1,
        help="sizes below the top size must be multiples of M (the top size is always planned)",
    )
    planning.add_argument("--latency", type=Path, help="CSV size,latency: T per capture size")
    planning.add_argument("--max-size", type=int, help="top size (default: largest observed)")
    planning.add_argument("--include", type=_sizes_argument, default=[], help="sizes to keep")
    planning.add_argument("--graph-cost", type=float, default=0.0, help="lambda * M per graph")
    planning.add_argument("--judge", type=Path, help="histogram CSV to judge every set on")
    planning.add_argument("--sizes-out", type=Path, help="write the planned sizes to this file")

    replaying = commands.add_parser("replay", help="replay a batch-size trace on a schedule")
    replaying.add_argument("--trace", required=True, type=Path, help="sizes per line, or JSON")
    replaying.add_argument(
        "--schedule", required=True, help=f"one of {', '.join(KINDS)} or a file of sizes"
    )
    replaying.add_argument("--max-size", type=int, default=512, help="max size of a named kind")

    simulating = commands.add_parser("simulate", help="decode batch sizes from an Azure trace")
    simulating.add_argument("--trace", required=True, type=Path, help="Azure LLM trace CSV")
    simulating.add_argument("--out", required=True, type=Path, help="histogram CSV to write")
    simulating.add_argument("--half", choices=("all", "first", "second"), default="all")
    simulating.add_argument("--step-ms", type=float, default=30.0, help="time of one step")
    simulating.add_argument("--max-running", type=int, default=256, help="slots for requests")
    simulating.add_argument("--prefill-chunk", type=int, default=2048, help="prefill tokens/step")
    simulating.add_argument("--rate-scale", type=float, default=1.0, help="arrival speed-up")
    simulating.add_argument("--steps-out", type=Path, help="also write each step's batch size")
    return parser


def _row(result: Plan) -> str:
    return (
        f"{result.graphs:>6}  {result.expected_cost:>9.3f}  {result.expected_padded_rows:>11.3f}"
        f"  {result.padding_ratio:>7.2%}  {result.worst_rows:>10}  {result.worst_ratio:>7.1%}"
        f"  {result.eager_fraction:>6.2%}"
    )


def _print_plan(result: Plan, histogram: Path, steps: float) -> None:
    top = result.sizes[-1]
    print(
        f"plan: {result.graphs} graphs for batch sizes up to {top} ({histogram}, {steps:g} steps)"
    )
    print(f"sizes: {', '.join(map(str, result.sizes))}")
    print(
        f"expected cost/step {result.expected_cost:.3f}, padded rows/step"
        f" {result.expected_padded_rows:.3f} ({result.padding_ratio:.2%}), worst case"
        f" {result.worst_rows} rows / {result.worst_ratio:.1%} of a graph,"
        f" eager {result.eager_fraction:.2%}"
    )
    if result.graph_cost:
        print(f"objective {result.objective:.3f} = cost/step + graph cost {result.graph_cost:.3f}")
    print(f"{'interval':>11}  {'steps':>7}  {'padded/step':>11}  {'worst':>11}")
    for interval in result.intervals:
        span = f"{interval.low}..{interval.size}"
        worst_text = f"{interval.worst_rows} ({interval.worst_ratio:.1%})"
        print(
            f"{span:>11}  {interval.step_share:>7.2%}  {interval.padded_rows:>11.3f}"
            f"  {worst_text:>11}"
        )


def _run_plan(args: argparse.Namespace) -> int:
    histogram = read_histogram(args.histogram)
    cost: CostModel = read_latency(args.latency) if args.latency else None
    options = {
        "cost": cost,
        "graph_cost": args.graph_cost,
        "align": args.align,
        "include": args.include,
        "max_size": args.max_size,
    }
    result = plan(histogram, max_graphs=args.max_graphs, **options)
    _print_plan(result, args.histogram, sum(histogram.values()))
    if args.sizes_out:
        args.sizes_out.write_text(",".join(map(str, result.sizes)) + "\n")

    judge: Mapping[int, float] = read_histogram(args.judge) if args.judge else histogram
    top = result.sizes[-1]
    where = f"judged on {args.judge}" if args.judge else "same histogram"
    print()
    print(f"engine schedules at max size {top} vs plans with at most as many graphs ({where})")
    header = f"{'graphs':>6}  {'cost/step':>9}  {'padded/step':>11}  {'padding':>7}"
    header += f"  {'worst rows':>10}  {'worst %':>7}  {'eager':>6}"
    print(f"{'schedule':<10}  {header}")
    if args.judge:
        print(f"{'plan':<10}  {_row(evaluate(result.sizes, judge, cost=cost))}")
    for kind in KINDS:
        fixed = schedule(kind, top, align=args.align, clamp=True)
        unmeasured = [size for size in fixed if isinstance(cost, Mapping) and size not in cost]
        if unmeasured:
            print(f"{kind:<10}  {len(fixed):>6}  not compared: no latency for sizes {unmeasured}")
            continue
        equal = plan(histogram, max_graphs=len(fixed), **options)
        print(f"{kind:<10}  {_row(evaluate(fixed, judge, cost=cost))}")
        print(f"{'  plan':<10}  {_row(evaluate(equal.sizes, judge, cost=cost))}")
    return 0


def _run_replay(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    if args.schedule in KINDS:
        sizes = schedule(args.schedule, args.max_size)
        source = f"{args.schedule}, max {args.max_size}"
    elif Path(args.schedule).is_file():
        sizes = read_sizes(Path(args.schedule))
        source = args.schedule
    else:
        raise ValueError(
            f"--schedule {args.schedule!r} is neither a kind ({', '.join(KINDS)}) nor a file"
        )
    table = BucketTable(sizes)
    report = replay(trace, table)
    graph_steps = report.steps - report.eager_steps
    print(f"replay: {report.steps} steps on {len(table)} graphs ({source})")
    print(
        f"graph steps {graph_steps}, eager fallbacks {report.eager_steps}"
        f" ({report.eager_fraction:.2%}), padding ratio {report.padding_ratio:.2%}"
        f" ({report.padded_rows} padded rows / {report.valid_rows + report.padded_rows} executed)"
    )
    print(f"{'size':>6}  {'steps':>8}  {'share':>7}")
    for size, hits in report.hits.items():
        if hits:
            print(f"{size:>6}  {hits:>8}  {hits / report.steps:>7.2%}")
    unused = [size for size, hits in report.hits.items() if not hits]
    if unused:
        print(f"never hit ({len(unused)}): {', '.join(map(str, unused))}")
    return 0


def _run_simulate(args: argparse.Namespace) -> int:
    requests = read_azure_trace(args.trace)
    if args.half != "all":
        requests = halves(requests)[0 if args.half == "first" else 1]
    runs = list(
        decode_runs(
            requests,
            step_s=args.step_ms / 1000,
            max_running=args.max_running,
            prefill_chunk=args.prefill_chunk,
            rate_scale=args.rate_scale,
        )
    )
    histogram: Counter[int] = Counter()
    for batch, steps in runs:
        histogram[batch] += steps
    if not histogram:
        raise ValueError(f"{args.trace}: the simulation produced no decode step")
    write_histogram(args.out, histogram)
    if args.steps_out:
        args.steps_out.write_text("".join(f"{batch}\n" * steps for batch, steps in runs))
    steps = sum(histogram.values())
    mean = sum(size * count for size, count in histogram.items()) / steps
    print(
        f"simulated {len(requests)} requests ({args.half}): {steps} decode steps,"
        f" mean batch {mean:.1f}, max {max(histogram)} -> {args.out}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"plan": _run_plan, "replay": _run_replay, "simulate": _run_simulate}
    try:
        return commands[args.command](args)
    except BrokenPipeError:
        # The reader stopped early (`| head`): not an error. Point stdout at devnull so the
        # interpreter's final flush does not raise the same error again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
