"""Token-wise building blocks shared by the paged decoder and the dense reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

RMS_EPS = 1e-6


def rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    """RMSNorm over the last dimension, computed in float32 and returned in `x`'s dtype."""
    x32 = x.float()
    scale = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + RMS_EPS)
    return (x32 * scale * weight.float()).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str) -> Tensor:
    """[head_dim // 2] float32 rotation frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return (1.0 / theta**exponents).to(device)


def rope_angles(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [T, 1, head_dim] of each token's rotation, shared by every layer, laid out for
    `apply_rope`: cos repeated over both halves, sin negated over the first half.

    Angles come from the positions on the device, never from a host table, so any position value
    (including a padding row's garbage) is safe.
    """
    angles = positions.to(torch.float32).view(-1, 1) * inv_freq.view(1, -1)
    cos, sin = torch.cos(angles), torch.sin(angles)
    return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` [T, heads, head_dim], pairing element i with element i + head_dim // 2:
    (a, b) -> (a cos - b sin, b cos + a sin), with the halves swapped by one roll and the sign in
    `sin` (from `rope_angles`). The same bits as the two-halves form (`a + b * -s` is `a - b * s`
    in IEEE arithmetic), in three tensor operations per call instead of eight."""
    x32 = x.float()
    return (x32 * cos + x32.roll(x32.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


def silu_mlp(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    gate, up = (x @ gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down


def adapter_delta(x: Tensor, adapter_ids: Tensor, table_a: Tensor, table_b: Tensor) -> Tensor:
    """Per-row low-rank delta `x @ A[id] @ B[id]`; `adapter_ids` [T] must already be in range.

    x [T, in], table_a [num_adapters + 1, in, rank], table_b [num_adapters + 1, rank, out].
    """
    down = torch.bmm(x[:, None, :], table_a.index_select(0, adapter_ids))  # [T, 1, rank]
    return torch.bmm(down, table_b.index_select(0, adapter_ids))[:, 0, :]  # [T, out]
