"""The comparison table: one row per case, a verdict that flags every unexpected outcome."""

from __future__ import annotations

from tests.conformance.case import Case, Result
from tests.conformance.catalog import all_cases
from tests.conformance.table import render


def _case(name: str, **kw: str) -> Case:
    return Case(name, "topic", lambda be: "", **kw)


def _row(table: str, name: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| `{name}`"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_suite_covers_at_least_sixty_semantics() -> None:
    cases = all_cases()
    assert len(cases) >= 60
    assert len({c.name for c in cases}) == len(cases)


def test_disagreement_between_backends_is_flagged_with_details() -> None:
    c = _case("k", cuda="captured")
    results = {
        "cuda": {"k": Result("captured", "")},
        "sim": {"k": Result("raises CaptureError", "aten.nonzero cannot be captured")},
    }
    row = _row(render(["cuda", "sim"], [c], results), "k")
    assert row == [
        "`k`",
        "topic",
        "captured",
        "raises CaptureError",
        "no",
        "sim: aten.nonzero cannot be captured",
    ]


def test_deliberate_difference_is_not_a_disagreement() -> None:
    c = _case("k", cuda="replayed", sim="raises UseAfterFreeError", why="sim reports it")
    results = {
        "cuda": {"k": Result("replayed", "")},
        "sim": {"k": Result("raises UseAfterFreeError", "freed")},
    }
    row = _row(render(["cuda", "sim"], [c], results), "k")
    assert row[-2:] == ["deliberate", "deliberate: sim reports it"]


def test_sim_alone_is_compared_with_the_declared_cuda_outcome() -> None:
    ok = _case("ok", cuda="stale")
    pending = _case("pending", cuda="stale", pending="sim device: replay is synchronous")
    results = {"sim": {"ok": Result("stale", ""), "pending": Result("fresh", "")}}
    table = render(["sim"], [ok, pending], results)
    assert _row(table, "ok") == ["`ok`", "topic", "stale", "stale", "yes (as expected)", ""]
    assert _row(table, "pending")[-2:] == ["no", "sim device: replay is synchronous"]
    assert table.rstrip().endswith("1 of 2 cases as expected on sim.")


def test_cuda_outcome_unlike_the_declared_one_is_noted_even_when_sim_agrees() -> None:
    c = _case("k", cuda="raises CaptureError")
    results = {
        "cuda": {"k": Result("raises RuntimeError", "CUDA graphs must be captured on a ...")},
        "sim": {"k": Result("raises RuntimeError", "")},
    }
    row = _row(render(["cuda", "sim"], [c], results), "k")
    assert row[-2] == "yes"
    assert row[-1] == (
        "cuda differs from the declared 'raises CaptureError'; "
        "cuda: CUDA graphs must be captured on a ..."
    )
