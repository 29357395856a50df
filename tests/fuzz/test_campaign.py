"""run_campaign: passes a correct runner, shrinks a broken one to a short replayable schedule."""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import torch
from hypothesis import Phase, configuration

import pytest_graphmode.fuzz.campaign as campaign_module
from pytest_graphmode.contract import Batch, Request, StepResult
from pytest_graphmode.fuzz import CHECKS, CampaignStats, GraphmodeFailure, run_campaign
from pytest_graphmode.fuzz.isolation import NO_DEVICE_FAULT
from pytest_graphmode.fuzz.lockstep import key_text
from pytest_graphmode.fuzz.registry import RANK_CHECKS
from pytest_graphmode.strategies.leading import (
    LEADING_EXAMPLES,
    first_capture_on_long_contexts,
    first_front_departure,
    first_graph_stream_sweep,
    first_handover,
    first_pair,
    first_partial_bucket,
    first_phase_change,
    first_return_after_padded_steps,
    first_return_after_preemption,
    first_stale_tail,
    first_stream_sweep,
    first_tokens_past_the_largest_graph,
)
from pytest_graphmode.strategies.plans import Stress
from pytest_graphmode.strategies.schedules import DELAY_CYCLES
from tests.fuzz import out_of_memory_target, toy


def _drift_failure(**options: Any) -> GraphmodeFailure:
    """The failure a campaign of the drifting toy raises: 10 examples of up to 3 steps, seed 1,
    and `options`."""
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(toy.factory(["drift"]), max_examples=10, max_steps=3, seed=1, **options)
    return caught.value


def test_a_correct_runner_passes_and_every_check_but_the_rank_checks_runs():
    seen = []
    stats = run_campaign(
        toy.make_target,
        max_examples=10,  # each schedule switches about half the features off (swarm.py)
        max_steps=6,
        seed=2,
        progress=lambda s: seen.append(s.examples),
    )
    assert stats.examples == 10 and seen == list(range(1, 11))
    assert stats.steps >= 6 and stats.failures == []
    # no_device_fault is judged only by the parent of an isolated campaign (test_isolation.py).
    assert set(stats.checks_run) == set(CHECKS) - set(RANK_CHECKS) - {NO_DEVICE_FAULT}
    assert sum(stats.buckets_hit.values()) == stats.steps == sum(stats.paths.values())


def test_the_first_example_is_the_simplest_pipelined_pair_and_one_of_the_examples():
    seen: list[list[Batch | Stress]] = []
    stats = run_campaign(
        toy.make_target, max_examples=3, max_steps=4, seed=5, on_example=lambda _, e: seen.append(e)
    )
    assert stats.examples == len(seen) == 3
    pair = [Stress, Batch]
    assert [type(e) for e in seen[0]] == [Batch, *pair, Batch, *pair, Batch, *pair]
    # a prefill first: the first pair runs an eager step then a graph replay
    assert isinstance(seen[0][0], Batch) and seen[0][0].phase == "prefill"
    # delayed: on cuda the pair's first step is still in flight when the second is prepared,
    # its copies late in the first two pairs and its computation late in the last
    assert seen[0][1] == Stress(pipelined=True, delay_cycles=DELAY_CYCLES, late="copies")
    assert seen[0][4] == Stress(pipelined=True, delay_cycles=DELAY_CYCLES, late="copies")
    assert seen[0][7] == Stress(pipelined=True, delay_cycles=DELAY_CYCLES, late="compute")
    assert stats.pipelined_steps >= 6


def test_a_one_example_campaign_runs_the_pair_alone_and_lockstep_campaigns_never():
    seen: list[list[Batch | Stress]] = []
    alone = run_campaign(
        toy.make_target, max_examples=1, seed=5, on_example=lambda _, e: seen.append(e)
    )
    assert alone.examples == 1 and alone.pipelined_steps == 6
    lockstep = run_campaign(
        toy.make_target,
        max_examples=3,
        seed=5,
        pipelined=False,
        on_example=lambda _, e: seen.append(e),
    )
    assert lockstep.examples == 3 and lockstep.pipelined_steps == 0
    assert not any(isinstance(e, Stress) and e.pipelined for events in seen[1:] for e in events)


def test_the_same_seed_gives_the_same_campaign():
    first = run_campaign(toy.make_target, max_examples=3, max_steps=4, seed=5)
    second = run_campaign(toy.make_target, max_examples=3, max_steps=4, seed=5)
    assert (first.steps, first.buckets_hit) == (second.steps, second.buckets_hit)


def test_a_broken_runner_fails_with_stats_attached():
    no_shrink = hypothesis.settings(
        max_examples=20, deadline=None, database=None, phases=[Phase.generate]
    )
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(toy.factory(["drift"]), settings=no_shrink, seed=1)
    stats = caught.value.stats
    assert stats is not None and stats.failures == [caught.value.failure]
    assert caught.value.failure.check == "replay_matches_eager"


def test_a_zero_shrink_budget_reports_the_failure_as_found():
    heard: list[tuple[int, str | None, bool]] = []
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(
            toy.factory(["drift"]),
            max_examples=10,
            max_steps=4,
            seed=1,
            shrink_seconds=0,
            pipelined=False,  # else the leading pair fails, which is never shrunk
            progress=lambda s: heard.append((s.examples, s.first_failure_check, s.shrinking)),
        )
    stats = caught.value.stats
    assert stats is not None
    # No input ran after the first failing one, and the final replay still failed (no Flaky).
    assert stats.examples == stats.first_failure_example
    assert stats.first_failure_check == caught.value.failure.check == "replay_matches_eager"
    assert stats.first_failure_seconds is not None
    assert (stats.shrink_stopped_by_budget, stats.shrinking) == (True, False)
    assert (stats.shrink_budget_seconds, stats.planned_examples) == (0, 10)
    assert "shrinking stopped at its budget of 0 s" in caught.value.failure.message
    # The failure was announced while shrinking, before the campaign ended.
    assert (stats.examples, "replay_matches_eager", True) in heard


class _Clock:
    """A stand-in for the campaign module's `time`: a second passes with every example."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def tick(self, *_: object) -> None:
        self.now += 1.0


def test_a_time_budget_ends_a_passing_campaign_once_spent(monkeypatch: pytest.MonkeyPatch):
    clock = _Clock()
    monkeypatch.setattr(campaign_module, "time", clock)
    stats = run_campaign(
        toy.make_target, max_examples=50, max_steps=3, seed=2, seconds=3.5, on_example=clock.tick
    )
    # Examples start at 0, 1, 2 and 3 s; at 4 s the budget is spent and no fifth one starts.
    assert (stats.examples, stats.failures) == (4, [])
    assert (stats.time_budget_seconds, stats.stopped_by_time_budget) == (3.5, True)
    assert stats.planned_examples == 0  # the count is only a cap: no "N of M"


def test_the_example_count_still_caps_a_time_budgeted_campaign():
    stats = run_campaign(toy.make_target, max_examples=3, max_steps=3, seed=2, seconds=3600)
    assert (stats.examples, stats.stopped_by_time_budget) == (3, False)


def test_a_time_budget_runs_hypothesis_in_rounds_with_the_leading_examples_once():
    seen: list[list[Batch | Stress]] = []
    rounds = campaign_module.ROUND_EXAMPLES
    stats = run_campaign(
        toy.make_target,
        max_examples=rounds + 5,
        max_steps=2,
        seed=3,
        seconds=3600,
        on_example=lambda _, e: seen.append(e),
    )
    assert stats.examples == len(seen) == rounds + 5 and not stats.stopped_by_time_budget
    # Only the first round starts with the twelve leading examples; later rounds draw as a fresh
    # ci-sized run.
    for i in range(len(LEADING_EXAMPLES)):
        assert [j for j, events in enumerate(seen) if events == seen[i]] == [i]
    assert sum(isinstance(e, Batch) for e in seen[1]) == len(first_phase_change(toy.SPEC))
    assert sum(isinstance(e, Batch) for e in seen[2]) == len(first_partial_bucket(toy.SPEC))
    assert sum(isinstance(e, Batch) for e in seen[3]) == len(first_front_departure(toy.SPEC))
    assert sum(isinstance(e, Batch) for e in seen[4]) == len(first_stale_tail(toy.SPEC))
    assert sum(isinstance(e, Batch) for e in seen[5]) == len(first_handover(toy.SPEC))
    assert sum(isinstance(e, Batch) for e in seen[6]) == len(first_stream_sweep(toy.SPEC))
    past = first_tokens_past_the_largest_graph(toy.SPEC)
    assert sum(isinstance(e, Batch) for e in seen[7]) == len(past) > 0
    long = first_capture_on_long_contexts(toy.SPEC)
    assert sum(isinstance(e, Batch) for e in seen[8]) == len(long) > 0
    sweep = first_graph_stream_sweep(toy.SPEC)
    assert sum(isinstance(e, Batch) for e in seen[9]) == len(sweep) > 0
    assert [e.held_stream for e in seen[9] if isinstance(e, Stress)] == [0, 1, 2]
    back = first_return_after_preemption(toy.SPEC)
    assert sum(isinstance(e, Batch) for e in seen[10]) == len(back) > 0
    padded = first_return_after_padded_steps(toy.SPEC)
    assert sum(isinstance(e, Batch) for e in seen[11]) == len(padded) > 0


def test_the_capture_on_long_contexts_starts_on_fresh_twins_where_an_example_before_is_left_out():
    # Without speculative decoding the eighth leading example is empty, and the capture on long
    # contexts moves forward to the eighth: twins kept since the first would serve it.
    features = toy.SPEC.features - {"spec_decode"}
    assert (
        first_tokens_past_the_largest_graph(dataclasses.replace(toy.SPEC, features=features)) == []
    )
    running = [-1]  # the example running, from 0
    made_during: list[int] = []

    def counting(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
        made_during.append(running[0])
        return toy.make_target(mode, seed=seed, backend=backend)

    def started(_: int, events: Sequence[Batch | Stress]) -> None:
        running[0] += 1

    stats = run_campaign(
        counting, max_examples=10, max_steps=3, seed=0, features=features, on_example=started
    )
    assert stats.failures == []
    # twins made for the first example and for the eighth, the long contexts' (FRESH_EVERY would
    # have made them for the ninth), none for any other
    assert sorted({e for e in made_during if e >= 0}) == [0, 7]


def test_a_failure_is_shrunk_and_reported_though_the_time_budget_is_spent():
    # seconds: spent before the second example could start
    failed = _drift_failure(pipelined=False, seconds=1e-9)
    stats = failed.stats
    assert stats is not None and not stats.stopped_by_time_budget
    assert stats.examples > stats.first_failure_example  # shrinking ran on
    assert "; shrinking finished in " in failed.failure.message


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan")])
def test_a_time_budget_must_be_positive(seconds: float):
    with pytest.raises(ValueError, match="must be a number of seconds > 0"):
        run_campaign(toy.make_target, max_examples=2, seconds=seconds)


def test_an_unbounded_shrink_says_it_finished():
    failed = _drift_failure(pipelined=False)
    stats = failed.stats
    assert stats is not None and stats.first_failure_example is not None
    assert stats.examples > stats.first_failure_example  # shrinking ran more examples
    # every example after the first failing one was Hypothesis shrinking it
    assert stats.shrink_examples == stats.examples - stats.first_failure_example
    assert not stats.shrink_stopped_by_budget and stats.shrink_budget_seconds is None
    assert "; shrinking finished in " in failed.failure.message
    assert "(the steps above are the shrunk schedule's)" in failed.failure.message


@pytest.mark.parametrize("pipelined", [True, False])
def test_shrinking_leaves_a_single_step_of_batch_literals(pipelined: bool):
    """With pipelined pairs, the leading example finds the bug at its first step, and its replay
    ends with the pair that step is in; without, Hypothesis shrinks a drawn schedule down to one
    step."""
    failed = _drift_failure(pipelined=pipelined)
    snippet = failed.failure.replay_snippet
    namespace: dict[str, object] = {}
    exec(snippet.split("replay(events")[0], namespace)
    kept = [Batch, Stress, Batch] if pipelined else [Batch]
    assert [type(e) for e in namespace["events"]] == kept
    assert failed.failure.step == 0
    leading = "shrinking skipped: this is one of the campaign's leading examples"
    assert (leading in failed.failure.message) == pipelined
    # the report names the leading example it was found in: the first is the simplest pair
    named = "first failing example: 1 (the leading example first_pair), at its step 0, found after"
    assert (named in failed.failure.message) == pipelined
    # and the step of the example as found, which a shrunk schedule's own step need not be
    assert ", at its step " in failed.failure.message.splitlines()[-1]
    # the counts say so too, from the moment it is found: no shrinking to wait for
    stats = failed.stats
    assert stats is not None
    assert stats.first_failure_leading == ("first_pair" if pipelined else None)
    assert stats.to_json()["first_failure_leading"] == stats.first_failure_leading


@pytest.mark.parametrize("leading", [True, False])
def test_leading_false_draws_every_example(leading: bool):
    """The bug the first leading example finds is found by a drawn example without them."""
    seen: list[list[Batch | Stress]] = []
    failed = _drift_failure(leading=leading, on_example=lambda _, events: seen.append(events))
    stats = failed.stats
    assert stats is not None
    assert stats.first_failure_leading == ("first_pair" if leading else None)
    assert ("leading example" in failed.failure.message) == leading
    # the first example is the simplest pipelined pair, or drawn: Hypothesis starts a run with
    # the smallest schedule it can draw, a single step
    assert sum(isinstance(e, Batch) for e in seen[0]) == (
        len(first_pair(toy.SPEC)) if leading else 1
    )


def test_a_failure_in_a_leading_example_is_never_counted_as_shrinking():
    seen: list[tuple[str | None, bool]] = []

    def progress(stats: CampaignStats) -> None:
        if stats.first_failure_check is not None:
            seen.append((stats.first_failure_leading, stats.shrinking))

    _drift_failure(progress=progress)
    assert seen and set(seen) == {("first_pair", False)}


def test_a_failure_drawn_from_the_global_generator_replays_with_the_same_values():
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(toy.factory(["global_noise"]), max_examples=5, max_steps=3, seed=4)
    failure = caught.value.failure
    torch.rand(5)  # the global generator has moved on since the campaign
    snippet = failure.replay_snippet.replace("make_target", "toy.factory(['global_noise'])")
    with pytest.raises(GraphmodeFailure) as again:
        exec(snippet, {"toy": toy})
    assert "differs from eager" in failure.message
    # The campaign's message adds one last line, on how the failure was found and shrunk.
    found, shrunk = failure.message.rsplit("\n", 1)
    assert shrunk.startswith("first failing example: ")
    assert again.value.failure.message == found


def interrupted_after(graph_steps: int):
    """The correct toy, whose graph-mode twins raise KeyboardInterrupt after `graph_steps` steps."""
    taken = [0]

    def make(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
        target = toy.make_target(mode, seed=seed, backend=backend)
        if mode == "graph":
            step = target.step

            def interrupted(batch: Batch):
                taken[0] += 1
                if taken[0] > graph_steps:
                    raise KeyboardInterrupt
                return step(batch)

            target.step = interrupted  # type: ignore[method-assign]
        return target

    return make


def test_an_interrupted_campaign_leaves_its_counts_in_the_stats_passed_in():
    stats = CampaignStats()
    with pytest.raises(KeyboardInterrupt):
        run_campaign(interrupted_after(6), max_examples=20, max_steps=3, seed=1, stats=stats)
    # Two graph-mode twins step per step: the seventh call is the fourth step's, submitted
    # before the third is read, so two steps were read and judged.
    assert stats.steps == 2
    assert stats.checks_run["replay_matches_eager"] == 2 and stats.seconds > 0


def test_a_campaign_puts_the_users_hypothesis_storage_back(tmp_path: Path):
    configuration.set_hypothesis_home_dir(tmp_path / "mine")
    try:
        run_campaign(toy.make_target, max_examples=2, max_steps=2, seed=1)
        assert configuration.storage_directory().path == tmp_path / "mine"
    finally:
        configuration.set_hypothesis_home_dir(None)


def test_features_restrict_what_schedules_use():
    requests: list[Request] = []

    def collect(seed: int, events: Sequence[Batch | Stress]) -> None:
        requests.extend(r for e in events if isinstance(e, Batch) for r in e.requests)

    stats = run_campaign(
        toy.make_target,
        max_examples=4,
        max_steps=4,
        seed=3,
        features=frozenset({"decode"}),
        on_example=collect,
    )
    assert stats.steps > 0 and requests
    assert all(r.seed is None and len(r.tokens) == 1 for r in requests)  # greedy, no prefill


def test_a_greedy_only_campaign_runs_greedy_requests_in_other_company():
    greedy_only = frozenset({"decode", "prefill"})
    stats = run_campaign(toy.make_target, max_examples=4, max_steps=4, seed=3, features=greedy_only)
    assert stats.failures == [] and stats.checks_run["company_independent"] > 0
    assert stats.checks_run["sampling_independent"] == 0
    # a per-row value keyed by the row: the graph and eager twins keep the same rows, so only
    # the greedy company twin, which runs some of the requests in other rows, sees it
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(
            toy.factory(["row_bias"]),
            max_examples=4,
            max_steps=4,
            seed=3,
            features=greedy_only,
            shrink_seconds=0,
        )
    assert caught.value.failure.check == "company_independent"


def test_features_the_target_lacks_are_refused():
    with pytest.raises(ValueError, match="does not support"):
        run_campaign(toy.make_target, features=frozenset({"decode", "multimodal"}))


def test_a_campaign_freezes_the_heap_it_found_while_it_runs_and_only_then():
    frozen: list[int] = []
    run_campaign(
        toy.make_target,
        max_examples=2,
        seed=1,
        on_example=lambda *_: frozen.append(gc.get_freeze_count()),
    )
    assert min(frozen) > 1000 and gc.get_freeze_count() == 0


FROZEN_AT_START = """
import gc
gc.freeze()  # as a Python whose start-up froze its first few hundred objects
gc.disable()  # no automatic collection: what is freed below, the test's own collection frees
import json, weakref
from pytest_graphmode.fuzz import run_campaign
from tests.fuzz import toy

class Cycle:
    def __init__(self):
        self.me = self

before = gc.get_freeze_count()
garbage = weakref.ref(Cycle())  # unreachable: must not stay frozen for good
frozen = []
run_campaign(toy.make_target, max_examples=2, seed=1,
             on_example=lambda *_: frozen.append(gc.get_freeze_count()))
after = gc.get_freeze_count()
gc.collect()
print(json.dumps([before, min(frozen), after, garbage() is None]))
"""


def _child_result(code: str) -> list:
    """Run `code` in a fresh interpreter at the project root; the JSON it printed last."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parents[2], capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_campaign_freezes_the_heap_also_where_a_part_of_it_was_frozen_and_unfreezes_it():
    before, during, after, garbage_collected = _child_result(FROZEN_AT_START)
    assert during > before + 50_000  # torch and the rest were frozen all the same
    assert after == 0  # and nothing stays frozen, so no reference cycle is kept for good
    assert garbage_collected


COMPILER_STACK = """
import gc, json, sys
import torch
from pytest_graphmode.fuzz.campaign_process import long_lived_objects_frozen

before = "torch._dynamo" in sys.modules
with long_lived_objects_frozen():
    import torch._dynamo
    tracked = {id(o) for o in gc.get_objects()}  # the frozen heap is tracked no more
    frozen = id(torch._dynamo.disable) not in tracked and id(vars(torch._dynamo)) not in tracked
print(json.dumps([before, frozen]))
"""


def test_torchs_compiler_stack_is_frozen_with_the_heap_though_torch_imports_it_lazily():
    # torch imports torch._dynamo the first time a dispatch mode or a custom op runs: inside a
    # campaign, where every full collection would walk its few hundred thousand objects.
    imported_before, frozen = _child_result(COMPILER_STACK)
    assert not imported_before and frozen


CAUGHT_UP = """
import gc, json, sys
import torch
from pytest_graphmode.fuzz.campaign_process import long_lived_objects_frozen

with long_lived_objects_frozen("cuda") as heap:
    left_out = "torch._dynamo" not in sys.modules
    import torch._dynamo
    tracked = {id(o) for o in gc.get_objects()}
    walked_before = id(vars(torch._dynamo)) in tracked
    heap.catch_up()
    tracked = {id(o) for o in gc.get_objects()}
    frozen_after = id(vars(torch._dynamo)) not in tracked
print(json.dumps([left_out, walked_before, frozen_after]))
"""


def test_on_cuda_the_compiler_stack_is_left_out_and_frozen_once_something_imports_it():
    # A cuda campaign of a runner that neither compiles nor runs custom ops never needs it.
    left_out, walked_before, frozen_after = _child_result(CAUGHT_UP)
    assert left_out and walked_before and frozen_after


def test_a_campaign_catches_its_frozen_heap_up_before_every_example(monkeypatch):
    calls: list[str] = []

    class Heap:
        def catch_up(self) -> None:
            calls.append("catch_up")

    @contextmanager
    def frozen(backend: str) -> Iterator[Heap]:
        calls.append(backend)
        yield Heap()

    monkeypatch.setattr(campaign_module, "long_lived_objects_frozen", frozen)
    stats = run_campaign(toy.make_target, backend="auto", max_examples=3, seed=2)
    concrete = "cuda" if torch.cuda.is_available() else "sim"
    assert calls == [concrete] + ["catch_up"] * stats.examples


@pytest.mark.parametrize(("asked", "inside"), [(1, 1), (3, 3), (None, 2)])
def test_a_campaign_runs_with_the_cpu_threads_asked_and_restores_torchs(asked, inside):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[int] = []
        run_campaign(
            toy.make_target,
            max_examples=2,
            seed=1,
            cpu_threads=asked,
            on_example=lambda *_: seen.append(torch.get_num_threads()),
        )
        assert seen == [inside, inside] and torch.get_num_threads() == 2
        with pytest.raises(GraphmodeFailure):
            run_campaign(toy.factory(["drift"]), max_examples=3, seed=1, cpu_threads=asked)
        assert torch.get_num_threads() == 2  # restored after a failure too
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("count", [0, -1, 1.5, True])
def test_cpu_threads_must_be_a_count_of_at_least_one(count):
    with pytest.raises(ValueError, match="must be a number of threads >= 1, or None"):
        run_campaign(toy.make_target, max_examples=1, cpu_threads=count)


def test_running_out_of_device_memory_outside_a_step_ends_the_campaign_with_that_error():
    # The graph twin cannot be made: no runner's step failed, so nothing is shrunk or reported as
    # a failed check; the error is the allocator's, as raised.
    stats = CampaignStats()
    with pytest.raises(torch.OutOfMemoryError, match="no room left for these twins"):
        run_campaign(out_of_memory_target.graph_twins, max_examples=20, seed=0, stats=stats)
    assert stats.examples == 1
    assert stats.failures == [] and stats.first_failure_check is None and not stats.shrinking


class _InferenceModeToy(toy.ToyTarget):
    """The toy made and stepped in inference mode, as serving engines run: its cache and static
    buffers are inference tensors, which torch refuses to update outside the mode."""

    def __init__(self, mode: str, *, seed: int, backend: str) -> None:
        with torch.inference_mode():
            super().__init__(mode, seed=seed, backend=backend)

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepResult:
        return super().step(batch)

    @torch.inference_mode()
    def update_weights(self, seed: int) -> None:
        super().update_weights(seed)


def test_a_runner_made_in_inference_mode_is_poisoned_marked_and_restored():
    # The harness's writes into the twins' tensors (poison, marks, a kept twin's restored state)
    # pass as the runner's own writes inside the mode do.
    stats = run_campaign(_InferenceModeToy, max_examples=12, max_steps=4, seed=0)
    assert stats.failures == [] and stats.examples == 12
    assert stats.checks_run["kv_writes_land"] > 0


def test_the_capture_on_long_contexts_follows_a_rejected_draft_where_drafts_are_proposed():
    kinds = [(p.kind, p.spec_k, p.accepted) for p in first_capture_on_long_contexts(toy.SPEC)]
    first_decode = kinds.index(("decode", 1, 0))
    assert kinds[first_decode - 1] == ("spec", 1, 0)  # one draft a row, none accepted
    assert all(kind == "prefill" for kind, _, _ in kinds[: first_decode - 1])
    without = dataclasses.replace(toy.SPEC, features=toy.SPEC.features - {"spec_decode"})
    assert "spec" not in [p.kind for p in first_capture_on_long_contexts(without)]


def test_the_stats_count_the_steps_each_graph_key_replayed() -> None:
    stats = run_campaign(toy.make_target, max_examples=3, max_steps=4, seed=5)
    replayed = stats.paths["full"] + stats.paths["piecewise"]
    assert sum(stats.graph_keys.values()) == replayed > 0


def test_a_dataclass_graph_key_shows_the_fields_that_hold_something() -> None:
    @dataclasses.dataclass(frozen=True)
    class Key:
        mode: str
        num_tokens: int
        num_reqs: int | None = None
        extra: tuple[int, ...] = ()

    assert key_text(Key("full", 8)) == "(mode='full', num_tokens=8)"
    assert (
        key_text(Key("full", 8, 4, (1,))) == "(mode='full', num_tokens=8, num_reqs=4, extra=(1,))"
    )
    assert key_text(("decode", 4)) == "('decode', 4)"
