"""Replay snippets import exactly the names their events use."""

import ast

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.fuzz.snippet import replay_snippet
from pytest_graphmode.strategies.plans import Stress
from tests.plugin.toy_target import make_target

BATCH = Batch((Request(req_id=0, tokens=(1,), context_len=1, block_ids=(1,)),))


def imported_and_used(source: str) -> tuple[set[str], set[str]]:
    tree = ast.parse(source)
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    return imported, used


def test_a_snippet_without_stressors_imports_no_stress() -> None:
    source = replay_snippet([BATCH], factory=make_target, backend="sim", seed=3)
    imported, used = imported_and_used(source)
    assert imported == {"Batch", "Request", "replay", "make_target"}
    assert imported <= used


def test_a_snippet_with_stressors_imports_stress() -> None:
    source = replay_snippet([Stress(churn=2), BATCH], factory=make_target, backend="sim", seed=3)
    imported, used = imported_and_used(source)
    assert imported == {"Batch", "Request", "Stress", "replay", "make_target"}
    assert imported <= used
    compile(source, "<snippet>", "exec")
