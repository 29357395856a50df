"""The sim changes torch only while it is active, and gives it back exactly afterwards."""

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from pytest_graphmode.fuzz.campaign import run_campaign
from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.target import make_target

PLAIN_TOLIST = torch.Tensor.tolist


def _assert_plain_torch() -> None:
    assert torch.Tensor.tolist is PLAIN_TOLIST
    assert _get_current_dispatch_mode_stack() == []
    assert _get_current_function_mode_stack() == []
    assert torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None
    # a device argument reaches torch as written again: without a GPU, torch refuses it (a CPU
    # build names CUDA, a CUDA build on a machine without a GPU the missing driver)
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError), match=r"CUDA|NVIDIA driver"):
            torch.zeros(2, device="cuda")


def test_getting_the_sim_changes_nothing():
    backends.get("sim")
    _assert_plain_torch()


def test_activation_nests_and_the_last_deactivate_restores_torch():
    sim = backends.get("sim")
    with sim.active():
        assert torch.Tensor.tolist is not PLAIN_TOLIST
        assert len(_get_current_dispatch_mode_stack()) == 1
        assert len(_get_current_function_mode_stack()) == 1
        with sim.active():
            assert len(_get_current_dispatch_mode_stack()) == 1
            assert len(_get_current_function_mode_stack()) == 1
        assert sim.is_active
    assert not sim.is_active
    _assert_plain_torch()
    with pytest.raises(RuntimeError, match="without a matching activate"):
        sim.deactivate()


def test_capturing_on_an_inactive_sim_is_refused():
    sim = backends.get("sim")
    g = sim.Graph()
    with pytest.raises(RuntimeError, match="not active"), sim.graph(g):
        torch.ones(2) * 2


def test_a_sim_tensor_outside_the_sim_is_a_cpu_tensor_to_torch():
    sim = backends.get("sim")
    with sim.active():
        x = torch.ones(2, device=sim.device)
    assert x.device == sim.device  # what it reports does not change
    assert torch.equal(x * 2, torch.full((2,), 2.0))  # but plain torch computes with it


def test_a_closed_sim_target_leaves_plain_torch():
    target = make_target("graph", seed=0, backend="sim", capture_sizes=[1, 2])
    assert backends.get("sim").is_active
    target.close()
    target.close()  # closing twice deactivates once
    _assert_plain_torch()


def test_a_sim_campaign_leaves_plain_torch():
    run_campaign(make_target, backend="sim", max_examples=2, max_steps=3, seed=1)
    _assert_plain_torch()
