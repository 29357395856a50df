"""Replay snippets import exactly the names their events use."""

import ast

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.fuzz.snippet import replay_snippet
from pytest_graphmode.strategies.plans import Reset, Stress
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


def test_each_batch_line_names_its_step_as_the_failure_message_counts_them() -> None:
    events = [BATCH, Stress(churn=2), BATCH, Reset(seed=5), BATCH]
    source = replay_snippet(events, factory=make_target, backend="sim", seed=3)
    batch_lines = [line for line in source.splitlines() if line.lstrip().startswith("Batch(")]
    assert [line.rsplit("# ", 1)[1] for line in batch_lines] == ["step 0", "step 1", "step 0"]
    namespace: dict[str, object] = {}
    exec(source.split("replay(events")[0], namespace)
    assert namespace["events"] == events
