"""Class 1, padding rows not inert: padding rows get slot -1 ("skip this write"), but the cache
write is an indexed assignment, which wraps -1 around to the last slot of the KV cache.

Mirrors engines whose padding slot sentinel is -1 while one of their cache-write kernels (or a
fallback path written with advanced indexing) does not test for negative slots: every padding row
then writes its garbage K/V into the last block, which the allocator hands to live requests.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import Batch
from tests.runners import minimal

BUG_CLASS = 1
EXPECTED_CHECK = "states_match"
SKIP_SLOT = -1


def forward(
    model: minimal.TinyDecoder, inputs: minimal.StepInputs, kv: list[tuple[Tensor, Tensor]]
) -> Tensor:
    """`TinyDecoder.forward` with the cache write done by indexed assignment."""
    w = model.weights
    x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]  # [T, hidden]
    for i, (k_cache, v_cache) in enumerate(kv):
        h = minimal._rms(x)
        q, k, v = (h @ w[f"{n}{i}"] for n in "qkv")
        k_cache[inputs.slots] = k.view(-1, minimal.HEADS, minimal.HEAD_DIM)
        v_cache[inputs.slots] = v.view(-1, minimal.HEADS, minimal.HEAD_DIM)
        x = x + minimal._attention(q, k_cache, v_cache, inputs) @ w[f"o{i}"]
        x = x + torch.nn.functional.silu(minimal._rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
    if inputs.last is not None:
        x = x[inputs.last]  # [R, hidden]
    return minimal._rms(x) @ w["head"]  # [R, vocab]


class PaddingSlotWraps(minimal.MinimalRunner):
    def prepare(self, batch: Batch, size: int) -> None:
        super().prepare(batch, size)
        self.buffers["slots"][batch.num_reqs : size].fill_(SKIP_SLOT)

    def run_model(self, inputs: minimal.StepInputs) -> tuple[Tensor, Tensor]:
        logits = forward(self.model, inputs, self.kv)
        return logits, minimal.sample(logits, inputs)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> PaddingSlotWraps:
    return PaddingSlotWraps(mode, seed=seed, backend=backend)
