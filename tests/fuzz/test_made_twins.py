"""The twins start identical: what a twin's construction breaks is reported before step 0, as
its construction's doing, and its snippet makes the twins again to show it."""

from __future__ import annotations

import pytest
import torch

from pytest_graphmode.contract import TargetFactory
from pytest_graphmode.failure import MADE_TWINS
from pytest_graphmode.fuzz import GraphmodeFailure, replay, run_campaign
from pytest_graphmode.runtime import backends
from tests.fuzz import toy

BLOCK_ONE = toy.SPEC.block_size  # the first slot of block 1, a block requests may own


class WarmsUpIntoBlockOne(toy.ToyTarget):
    """Graph mode runs a warm-up at construction that writes slot 4 (block 1, not the null block)."""

    def __init__(self, mode: str, *, seed: int, backend: str) -> None:
        super().__init__(mode, seed=seed, backend=backend)
        if mode == "graph":
            self.kv[BLOCK_ONE] += 1.0


class WarmsUpIntoTheNullBlock(toy.ToyTarget):
    """Graph mode's warm-up at construction writes only the null block (block 0): allowed."""

    def __init__(self, mode: str, *, seed: int, backend: str) -> None:
        super().__init__(mode, seed=seed, backend=backend)
        if mode == "graph":
            self.kv[: toy.SPEC.block_size] = float("nan")


class UploadsUnordered(toy.ToyTarget):
    """Every twin allocates a device buffer on the current stream and fills it on a side stream
    that does not wait for the allocation's zeroing: a race the sim sees at construction."""

    def __init__(self, mode: str, *, seed: int, backend: str) -> None:
        super().__init__(mode, seed=seed, backend=backend)
        be = backends.get(backend)
        self.staged = torch.zeros(8, device=be.device)
        side = be.Stream()
        with be.stream(side):
            self.staged.fill_(1.0)
        be.current_stream().wait_stream(side)


def warms_up_into_block_one(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
    return WarmsUpIntoBlockOne(mode, seed=seed, backend=backend)


def warms_up_into_the_null_block(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
    return WarmsUpIntoTheNullBlock(mode, seed=seed, backend=backend)


def uploads_unordered(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
    return UploadsUnordered(mode, seed=seed, backend=backend)


def _failure_of(factory: TargetFactory) -> GraphmodeFailure:
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(factory, max_examples=5, max_steps=3, seed=0)
    return caught.value


def test_a_state_write_at_construction_is_reported_before_step_0_as_the_graph_twins() -> None:
    failure = _failure_of(warms_up_into_block_one).failure
    assert failure.check == "states_match", failure.message
    assert (failure.step, failure.where) == (MADE_TWINS, "before step 0 (when the twins were made)")
    first_line = failure.message.splitlines()[0]
    assert "failed before step 0, when the twins were made" in first_line
    assert f"differs at slot {BLOCK_ONE} (block 1, before any request was sent)" in failure.message
    assert "the graph twin and the eager twin" in failure.message
    assert "shrinking skipped: the twins' construction failed" in failure.message
    assert "events = [\n]" in failure.replay_snippet
    with pytest.raises(GraphmodeFailure) as replayed:
        exec(failure.replay_snippet, {})
    assert replayed.value.failure.check == "states_match"
    assert "when the twins were made" in replayed.value.failure.message


def test_a_null_block_write_at_construction_is_no_failure() -> None:
    stats = run_campaign(warms_up_into_the_null_block, max_examples=5, max_steps=3, seed=0)
    assert stats.examples == 5 and stats.steps > 0


def test_a_stream_race_at_construction_is_reported_before_step_0_on_sim() -> None:
    failure = _failure_of(uploads_unordered).failure
    assert failure.check == "no_stream_races", failure.message
    assert "failed before step 0, when the twins were made" in failure.message
    assert "a stream race while the twins were made" in failure.message
    assert "fill_" in failure.message


class CaptureRefusedAtStartUp(toy.ToyTarget):
    """Graph mode captures at construction something a capture refuses (as CUDA refuses work on a
    stream outside the capture that allocates); `broken_in_both` raises in eager mode too."""

    broken_in_both = False

    def __init__(self, mode: str, *, seed: int, backend: str) -> None:
        if mode == "graph" or self.broken_in_both:
            raise RuntimeError(f"capture at start-up refused ({mode} twin)")
        super().__init__(mode, seed=seed, backend=backend)


class RefusedInBothModes(CaptureRefusedAtStartUp):
    broken_in_both = True


def capture_refused_at_start_up(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
    return CaptureRefusedAtStartUp(mode, seed=seed, backend=backend)


def refused_in_both_modes(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
    return RefusedInBothModes(mode, seed=seed, backend=backend)


def test_a_graph_twin_whose_construction_raises_is_a_failure_before_step_0() -> None:
    failure = _failure_of(capture_refused_at_start_up).failure
    assert (failure.check, failure.step) == ("replay_matches_eager", MADE_TWINS), failure.message
    assert "failed before step 0, when the twins were made" in failure.message
    assert "graph_raised: the graph twin's construction raised, the eager twin's did not" in (
        failure.message
    )
    assert "capture at start-up refused (graph twin)" in failure.message
    assert "shrinking skipped: the twins' construction failed" in failure.message
    with pytest.raises(GraphmodeFailure) as replayed:
        exec(failure.replay_snippet, {})
    assert replayed.value.failure.check == "replay_matches_eager"


def test_twins_that_both_raise_while_made_show_both_errors() -> None:
    with pytest.raises(GraphmodeFailure) as caught:
        replay([], factory=refused_in_both_modes, seed=0)
    failure = caught.value.failure
    assert (failure.check, failure.step) == ("replay_matches_eager", MADE_TWINS), failure.message
    assert "both twins raised while they were made" in failure.message
    assert "(graph twin)" in failure.message and "(eager twin)" in failure.message


def test_a_campaign_of_a_factory_that_cannot_make_an_eager_target_says_so() -> None:
    with pytest.raises(RuntimeError, match="the factory raised making an eager target") as caught:
        run_campaign(refused_in_both_modes, max_examples=5, max_steps=3, seed=0)
    assert "capture at start-up refused (eager twin)" in str(caught.value.__cause__)


class StateCopied(toy.ToyTarget):
    """`state()` hands out a copy of the cache, made at each call: the harness's marks, poison and
    restores would land in the copy."""

    def state(self) -> dict[str, torch.Tensor]:
        return {key: value.clone() for key, value in super().state().items()}


class StateViewedAnew(toy.ToyTarget):
    """`state()` makes a new view of the cache at each call: the same memory, so it is the state."""

    def state(self) -> dict[str, torch.Tensor]:
        return {key: value.view(value.shape) for key, value in super().state().items()}


def state_copied(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
    return StateCopied(mode, seed=seed, backend=backend)


def state_viewed_anew(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
    return StateViewedAnew(mode, seed=seed, backend=backend)


def test_a_state_that_is_a_copy_is_refused_before_step_0():
    with pytest.raises(ValueError, match=r"state\(\)\['kv'\] is another tensor at every call"):
        run_campaign(state_copied, backend="sim", max_examples=2, max_steps=2, seed=0)


def test_a_state_viewed_anew_at_each_call_is_the_state():
    stats = run_campaign(state_viewed_anew, backend="sim", max_examples=2, max_steps=2, seed=0)
    assert stats.failures == [] and stats.steps > 0


def _needs_a_cuda_binding(mode: str, *, seed: int, backend: str) -> toy.ToyTarget:
    # What torch.cuda's own code raises on a CPU build where the drop-in stands in for nothing.
    raise AttributeError("module 'torch._C' has no attribute '_cuda_someBinding'")


def test_a_factory_stopped_by_a_missing_cuda_binding_is_reported_as_the_sims_limit() -> None:
    with pytest.raises(RuntimeError, match="the factory raised making an eager target") as caught:
        run_campaign(_needs_a_cuda_binding, backend="sim", max_examples=2, max_steps=2, seed=0)
    message = str(caught.value)
    assert message.startswith("sim_unsupported: the sim cannot run a call this runner makes")
    assert "_cuda_someBinding" in message.splitlines()[1]
