"""SDPA on the sim: CUDA's choice of kernel decides which calls run (sim/attention.py); the
conformance cases (tests/conformance/cases_attention.py) compare the outcomes with a GPU's."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pytest_graphmode.runtime.backends.sim.device import SimDeviceTensor


def _qkv(sim, dtype=torch.float16, head_size=64):
    return [torch.randn(1, 2, n, head_size, device=sim.device).to(dtype) for n in (1, 4, 4)]


def test_no_kernel_left_raises_cuda_s_error_after_a_reason_for_each_kernel(sim):
    q, k, v = _qkv(sim)
    mask = torch.ones(1, 1, 1, 4, dtype=torch.bool, device=sim.device)
    with warnings.catch_warnings(record=True) as seen, sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="No available kernel"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    said = [str(w.message) for w in seen]
    assert "Flash attention kernel not used because:" in said
    assert "Flash Attention does not support non-null attn_mask." in said
    assert "Memory Efficient attention has been runtime disabled." in said


def test_a_host_mask_is_refused_as_a_host_operand_of_device_work(sim):
    q, k, v = _qkv(sim, torch.float32)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(1, 1, 1, 4, dtype=torch.bool))


def test_math_s_inner_tensors_are_device_memory_and_host_attention_keeps_the_cpu_s_rules(sim):
    q, k, v = _qkv(sim, torch.float32)
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k[:, :, :1], v[:, :, :1], is_causal=True)
    assert isinstance(out, SimDeviceTensor)
    torch.testing.assert_close(out.cpu(), v[:, :, :1].cpu())  # one key: its value, whatever q
    host = [t.cpu() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # the CPU's flash takes float32; a GPU's not
        assert not isinstance(F.scaled_dot_product_attention(*host), SimDeviceTensor)
