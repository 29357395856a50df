"""Run every conformance case on every available backend and print the comparison table.

    python -m tests.conformance.table [--out PATH] [--only SUBSTRING]

One process, cuda first (when a GPU is present), then sim. A case that raises is recorded with its
exception as the outcome; after each case the device is settled (synchronized, default stream
current, cache emptied), so one case cannot change the next one's result.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pytest_graphmode.runtime import backends
from tests.conformance.case import Case, Result, outcome_of, settle
from tests.conformance.catalog import all_cases, available_backends


def measure(names: list[str], cases: list[Case]) -> dict[str, dict[str, Result]]:
    """backend name -> case name -> result."""
    results: dict[str, dict[str, Result]] = {}
    for name in names:
        with backends.get(name).active() as be:
            settle(be)
            results[name] = {}
            for c in cases:
                start = time.perf_counter()
                try:
                    results[name][c.name] = outcome_of(be, c)
                except Exception as exc:  # settling the device afterwards failed: keep going
                    results[name][c.name] = Result(
                        f"crashed ({type(exc).__name__})", str(exc)[:200]
                    )
                elapsed = time.perf_counter() - start
                if elapsed > 1.0:
                    print(f"slow: {c.name} on {name} took {elapsed:.1f} s", file=sys.stderr)
    return results


def _verdict(c: Case, measured: dict[str, Result]) -> str:
    """With both backends: do they agree (or differ exactly as documented)? With one: does it
    show the outcome the case expects of it?"""
    if "cuda" in measured and "sim" in measured:
        cuda, sim = measured["cuda"].outcome, measured["sim"].outcome
        if c.deliberate and cuda == c.cuda and sim == c.sim:
            return "deliberate"
        return "yes" if cuda == sim else "no"
    if all(r.outcome == c.expected(name) for name, r in measured.items()):
        return "deliberate" if c.deliberate and "sim" in measured else "yes (as expected)"
    return "no"


def _note(c: Case, measured: dict[str, Result], verdict: str) -> str:
    parts = [c.note]
    cuda = measured.get("cuda")
    if cuda is not None and cuda.outcome != c.cuda:
        parts.append(f"cuda differs from the declared {c.cuda!r}")
    if verdict == "no" or (cuda is not None and cuda.outcome != c.cuda):
        parts += [f"{n}: {r.detail}" for n, r in measured.items() if r.detail]
    return "; ".join(p for p in parts if p).replace("|", "/")


def render(names: list[str], cases: list[Case], results: dict[str, dict[str, Result]]) -> str:
    """The markdown table. With cuda and sim, `agree?` compares the two (a deliberate difference
    agrees when both show their documented outcome); with one backend, its outcomes are compared
    with those the cases declare."""
    declared = "cuda" not in names
    head = ["case", "topic", *(["cuda (expected)"] if declared else []), *names, "agree?", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    agree = 0
    for c in cases:
        measured = {name: results[name][c.name] for name in names}
        verdict = _verdict(c, measured)
        agree += verdict != "no"
        row = [f"`{c.name}`", c.topic, *([c.cuda] if declared else [])]
        row += [measured[name].outcome for name in names]
        row += [verdict, _note(c, measured, verdict)]
        lines.append("| " + " | ".join(row) + " |")
    summary = "agree" if not declared else "as expected"
    lines += ["", f"{agree} of {len(cases)} cases {summary} on {', '.join(names)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = parser.parse_args(argv)
    cases = [c for c in all_cases() if args.only in c.name]
    names = available_backends()
    table = render(names, cases, measure(names, cases))
    print(table, end="")
    if args.out is not None:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
