"""Every document the code cites is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pytest_graphmode", "runtime", "strategies", "tests", "benchmarks")
# `docs/<name>.md`, or a bare file name such as `CONTRIBUTING.md` (meaning the repository root).
CITATION = re.compile(r"(?<![\w/.-])((?:docs/)?[A-Za-z][\w-]*\.md)\b")


def citations() -> dict[str, list[str]]:
    """document -> the source files citing it."""
    found: dict[str, list[str]] = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in CITATION.findall(path.read_text()):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_cited_document_exists() -> None:
    found = citations()
    assert "docs/bug-classes.md" in found
    missing = {name: where for name, where in found.items() if not (ROOT / name).is_file()}
    assert not missing, f"documents cited but not in the repository: {missing}"
