"""The check registry: one ordered list, each name written once in the harness."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest_graphmode
from pytest_graphmode.fuzz import CHECKS
from pytest_graphmode.fuzz.registry import RANK_CHECKS, REGISTRY

HARNESS = Path(pytest_graphmode.__file__).parent


def test_checks_lists_the_registry_in_order_then_the_rank_checks_without_repeats() -> None:
    assert (*(check.name for check in REGISTRY), *RANK_CHECKS) == CHECKS
    assert len(set(CHECKS)) == len(CHECKS)


def test_each_check_name_is_written_once_in_the_harness() -> None:
    written: Counter[str] = Counter()
    for path in HARNESS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and node.value in CHECKS:
                written[f"{node.value}"] += 1
    assert {name: written[name] for name in CHECKS} == dict.fromkeys(CHECKS, 1)
