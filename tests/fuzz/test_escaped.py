"""What escapes the harness's work around a step: a runner method's exception is a failed check
naming the twin and the method; the harness's own is a `HarnessError`, reported at once and not
as the runner's failure."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, Literal

import pytest
import torch

from pytest_graphmode.campaign_stats import CampaignStats, SessionSummary
from pytest_graphmode.fuzz import GraphmodeFailure, run_campaign
from pytest_graphmode.fuzz.checks import REPLAY_MATCHES_EAGER
from pytest_graphmode.fuzz.escaped import HarnessError, is_runner_module
from pytest_graphmode.fuzz.kv_checks import STATES_MATCH
from pytest_graphmode.fuzz.lockstep import Lockstep
from pytest_graphmode.report import summary_lines
from tests.fuzz import toy


@pytest.mark.parametrize(
    ("module", "runner"),
    [
        ("pytest_graphmode.fuzz.lockstep", False),
        ("pytest_graphmode.strategies.stressors", False),
        ("pytest_graphmode", False),
        ("pytest_graphmode.runtime.target", True),  # the shipped runner
        ("pytest_graphmode.runtime.backends.sim.device", True),  # where the runner's ops run
        ("pytest_graphmode.hf.target", True),
        ("tests.runners.minimal", True),
        ("vllm.v1.worker.gpu_model_runner", True),
        ("torch.nn.functional", False),
        ("hypothesis.core", False),
        ("json.decoder", False),
    ],
)
def test_runner_code_is_every_module_but_the_harness_and_the_libraries(module, runner):
    assert is_runner_module(module) is runner


class _Wrapped:
    """A toy target with some of its methods replaced; `_stepped` says whether it has stepped."""

    def __init__(self, target: Any) -> None:
        self._target, self._stepped = target, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def step(self, batch: Any) -> Any:
        self._stepped = True
        return self._target.step(batch)


def _twins(wrapper: type[_Wrapped], graph_only: bool = True) -> Callable[..., Any]:
    """A factory of toy twins wrapped in `wrapper` (the graph twin alone with `graph_only`)."""

    def make(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> Any:
        made = toy.make_target(mode, seed=seed, backend=backend)
        return wrapper(made) if mode == "graph" or not graph_only else made

    return make


class _StaticBuffersRaise(_Wrapped):
    """A toy target whose graph twin's `static_buffers()` raises once it has stepped: the harness
    calls it to poison the buffers before every step of the graph twin, outside the step."""

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        if self._stepped:
            raise ValueError("staging map lost its buffers")
        return self._target.static_buffers()  # type: ignore[no-any-return]


_static_buffers_raise = _twins(_StaticBuffersRaise)


def test_a_runner_method_raising_outside_the_step_fails_a_check_naming_twin_and_method():
    stats = CampaignStats()
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(_static_buffers_raise, max_examples=5, max_steps=4, seed=0, stats=stats)
    failure = caught.value.failure
    assert failure.check == REPLAY_MATCHES_EAGER == stats.first_failure_check
    assert failure.step >= 1  # the first step ran: poisoning before the next one raised
    assert "graph_raised: the graph twin's static_buffers raised" in failure.message
    assert "ValueError: staging map lost its buffers" in failure.message
    assert "replay(events" in failure.message and failure.replay_snippet
    assert stats.failures == [failure] and stats.harness_error is None


def test_the_harness_raising_in_its_own_code_is_a_harness_error_reported_at_once(monkeypatch):
    # A harness bug: the step's count called with arguments a builtin rejects, from the harness's
    # own frame (no runner code on the way).
    monkeypatch.setattr(Lockstep, "_count", staticmethod(int))
    stats = CampaignStats()
    with pytest.raises(HarnessError) as caught:
        run_campaign(toy.make_target, max_examples=5, max_steps=4, seed=0, stats=stats)
    message = str(caught.value)
    assert message.startswith("pytest-graphmode's own code raised TypeError")
    assert "at step 0 (seed" in message and "lockstep.py" in message
    assert "replay(events" in message
    assert isinstance(caught.value.__cause__, TypeError)
    # Not the runner's failure, not shrunk: the campaign ended at the first example.
    assert stats.failures == [] and stats.first_failure_check is None
    assert stats.examples == 1
    assert stats.harness_error == message.splitlines()[0]
    summary = SessionSummary()
    summary.add_campaign(stats)
    assert summary.stats.harness_error == stats.harness_error
    assert (
        f"harness error (not a finding about the target): {stats.harness_error}"
        in summary_lines(summary)
    )
    assert CampaignStats.from_json(stats.to_json()).harness_error == stats.harness_error


class _StateRaisesAtReset(_Wrapped):
    """A toy target whose `state()` raises when the harness restores the kept twins for the next
    example (a `Reset`), and only then: the restore runs outside any step."""

    def state(self) -> Mapping[str, torch.Tensor]:
        if _called_from_lockstep_reset(sys._getframe(1)):
            raise RuntimeError("cache pages were handed back to the pool")
        return self._target.state()  # type: ignore[no-any-return]


_state_raises_at_reset = _twins(_StateRaisesAtReset)


def _called_from_lockstep_reset(frame: FrameType | None) -> bool:
    """Whether `frame` or one of its callers is `Lockstep.reset` (a walk, not `inspect.stack()`,
    which reads every frame's source lines at each of the campaign's `state()` calls)."""
    while frame is not None:
        if frame.f_code.co_name == "reset" and "lockstep" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def test_a_runner_method_raising_while_the_kept_twins_are_restored_fails_the_next_example():
    stats = CampaignStats()
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(_state_raises_at_reset, max_examples=5, max_steps=4, seed=0, stats=stats)
    failure = caught.value.failure
    assert failure.check == REPLAY_MATCHES_EAGER and failure.step == 0
    assert "example 2 on twins made with it, Reset(seed=" in failure.message
    assert "restoring the kept twins' state() before the example's first step" in failure.message
    assert "graph_raised: the graph twin's state raised" in failure.message
    assert "RuntimeError: cache pages were handed back to the pool" in failure.message
    assert "Reset(" in failure.replay_snippet
    assert stats.failures == [failure] and stats.harness_error is None


class _StateGrowsAKey(_Wrapped):
    """A toy target whose `state()` gains a tensor once it has stepped (a cache made lazily):
    the kept twins' saved copy lacks it."""

    def state(self) -> Mapping[str, torch.Tensor]:
        state = dict(self._target.state())
        if self._stepped:
            state["late"] = self.__dict__.setdefault("_late", torch.zeros(toy.SPEC.num_slots))
        return state


_state_grows_a_key = _twins(_StateGrowsAKey, graph_only=False)


def test_state_keys_changed_since_the_twins_were_made_fail_states_match_at_the_next_example():
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(_state_grows_a_key, max_examples=5, max_steps=4, seed=0)
    failure = caught.value.failure
    assert failure.check == STATES_MATCH and failure.step == 0
    assert "a twin's state() keys changed since it was made" in failure.message
    assert "'late'" in failure.message
