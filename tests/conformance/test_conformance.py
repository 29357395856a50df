"""Each conformance case on each backend: CUDA's outcome, or sim's documented deliberate one.

Cases the sim cannot show yet are strict xfails on sim: once the sim shows CUDA's outcome they fail
as XPASS, and the mark must go.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_graphmode.runtime import backends
from tests.conformance.case import Case, outcome_of, settle
from tests.conformance.catalog import all_cases


def _params() -> list[Any]:
    params = []
    for backend in ("cuda", "sim"):
        for c in all_cases():
            marks: list[Any] = [pytest.mark.graphmode_cuda] if backend == "cuda" else []
            if backend == "sim" and c.pending:
                marks.append(pytest.mark.xfail(strict=True, reason=c.pending))
            params.append(pytest.param(backend, c, marks=marks, id=f"{backend}-{c.name}"))
    return params


@pytest.mark.parametrize(("backend", "conformance_case"), _params())
def test_case_shows_the_cuda_outcome(backend: str, conformance_case: Case) -> None:
    with backends.get(backend).active() as be:
        settle(be)
        result = outcome_of(be, conformance_case)
    expected = conformance_case.expected(backend)
    assert result.outcome == expected, (
        f"{conformance_case.name} on {backend}: {result.outcome!r}, expected {expected!r}"
        + (f" ({result.detail})" if result.detail else "")
    )
