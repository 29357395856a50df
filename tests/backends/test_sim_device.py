"""The sim device: device tensors apart from host tensors, and CUDA's rules between them."""

import pytest
import torch

from pytest_graphmode.runtime.backends.sim.device import SimDeviceTensor


def test_device_tensors_report_the_sim_device_and_host_tensors_the_cpu(sim):
    x = torch.arange(4.0, device=sim.device)
    assert sim.device == torch.device("cuda", 0)
    assert (x.device, x.is_cuda, x.get_device()) == (sim.device, True, 0)
    assert isinstance(x * 2, SimDeviceTensor)
    assert isinstance(x[1:], SimDeviceTensor)  # a view of device memory is device memory
    assert isinstance(torch.zeros_like(x), SimDeviceTensor)
    assert isinstance(torch.zeros(2, device="cuda"), SimDeviceTensor)
    host = torch.arange(4.0)
    assert host.device == torch.device("cpu") and not isinstance(host * 2, SimDeviceTensor)
    assert not isinstance(x.new_zeros(2, device="cpu"), SimDeviceTensor)


def test_a_device_op_refuses_a_host_tensor_operand(sim):
    x = torch.ones(4, device=sim.device)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(4)


def test_a_0_dim_host_tensor_is_a_kernel_argument(sim):
    x = torch.ones(4, device=sim.device)
    assert torch.equal((x * torch.tensor(3.0)).cpu(), torch.full((4,), 3.0))


def test_a_0_dim_host_operand_of_queued_work_is_read_when_it_is_issued(sim):
    x = torch.ones(4, device=sim.device)
    scale = torch.tensor(2.0)
    side = sim.Stream()
    with sim.stream(side):
        y = x * scale  # queued: runs later
    scale.fill_(5.0)
    sim.synchronize()
    assert torch.equal(y.cpu(), torch.full((4,), 2.0))


def test_moving_between_host_and_device(sim):
    host = torch.arange(3.0)
    for moved in (
        host.cuda(),
        host.to(sim.device),
        host.to("cuda"),
        host.to(torch.ones(1, device=sim.device)),
    ):
        assert isinstance(moved, SimDeviceTensor) and torch.equal(moved.cpu(), host)
    x = torch.arange(3.0, device=sim.device)
    for back in (x.cpu(), x.to("cpu"), x.to(host)):
        assert type(back) is torch.Tensor and torch.equal(back, host)
    assert x.cuda() is x and x.to(sim.device) is x
    assert isinstance(x.to(torch.float64), SimDeviceTensor)
    assert torch.equal(torch.tensor([1, 2], device=sim.device).cpu(), torch.tensor([1, 2]))


def test_a_blocking_download_waits_for_the_work_queued_before_it(sim):
    x = torch.zeros(4, device=sim.device)
    side = sim.Stream()
    for seed in range(8):
        sim.set_scheduler_seed(seed)
        x.zero_()
        with sim.stream(side):
            x.add_(seed + 1)  # queued on the side stream
            seen = x.cpu()  # a blocking copy on that stream: the add has run
        assert torch.equal(seen, torch.full((4,), float(seed + 1)))


def test_a_non_blocking_download_lands_in_pinned_memory(sim):
    x = torch.ones(4, device=sim.device)
    host = x.to("cpu", non_blocking=True)
    sim.synchronize()
    assert host.is_pinned() and torch.equal(host, torch.ones(4))


def test_pinned_host_memory(sim):
    assert sim.empty_pinned(2).is_pinned()
    assert torch.empty(2, pin_memory=True).is_pinned()
    pageable = torch.ones(2)
    assert not pageable.is_pinned()
    pinned = pageable.pin_memory()
    assert pinned.is_pinned() and torch.equal(pinned, pageable)
    assert not torch.ones(2, device=sim.device).is_pinned()
    with pytest.raises(RuntimeError, match="only host memory can be pinned"):
        torch.ones(2, device=sim.device).pin_memory()


def test_a_non_blocking_upload_from_pageable_memory_is_staged_at_once(sim):
    # CUDA copies pageable memory to a staging buffer before the call returns: a later host
    # write cannot reach the device.
    host, x = torch.ones(4), torch.zeros(4, device=sim.device)
    side = sim.Stream()
    with sim.stream(side):
        x.copy_(host, non_blocking=True)
    host.fill_(7.0)
    sim.synchronize()
    assert torch.equal(x.cpu(), torch.ones(4))


def test_host_work_in_a_capture_runs_at_once_and_is_not_recorded(sim):
    x = torch.ones(4, device=sim.device)
    counter = torch.zeros(1)
    g = sim.Graph()
    with sim.graph(g):
        counter.add_(1)
        y = x * 2
    g.replay()
    g.replay()
    sim.synchronize()
    assert counter.item() == 1.0 and torch.equal(y.cpu(), torch.full((4,), 2.0))


def test_new_tensor_of_a_device_tensor_is_uploaded(sim):
    x = torch.zeros(2, dtype=torch.int64, device=sim.device)
    made = x.new_tensor([3, 4])
    assert isinstance(made, SimDeviceTensor) and made.dtype == torch.int64
    assert torch.equal(made.cpu(), torch.tensor([3, 4]))
    assert type(torch.zeros(1).new_tensor([1.0])) is torch.Tensor
