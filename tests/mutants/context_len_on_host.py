"""Class 4, host values frozen at capture: attention reads keys only up to the batch's longest
sequence, a Python int computed on the host and passed to the kernel.

Mirrors attention calls given `max_seq_len` (or a number of KV splits derived from it) as a host
scalar: the graph records the value of the capture batch (one key: all rows were padding), and
every replay attends to that many keys, whatever the sequences have grown to.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import Batch, StepResult
from tests.runners import minimal

BUG_CLASS = 4
EXPECTED_CHECK = "replay_matches_eager"


def attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: minimal.StepInputs, keys: int
) -> Tensor:
    """`minimal._attention` over the first `keys` positions of each block table only."""
    size = minimal.SPEC.block_size
    offsets = torch.arange(size, device=q.device)
    context = (inputs.tables[:, :, None] * size + offsets).flatten(1)[:, :keys]  # [T, keys]
    k, v = k_cache[context], v_cache[context]  # [T, keys, heads, dim]
    visible = torch.arange(keys, device=q.device)[None, :] <= inputs.positions[:, None]
    scores = torch.einsum("thd,tchd->thc", q.view(-1, minimal.HEADS, minimal.HEAD_DIM), k)
    probs = (scores / math.sqrt(minimal.HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
    v = torch.where(visible[:, :, None, None], v, torch.zeros((), device=q.device))
    return torch.einsum("thc,tchd->thd", probs.softmax(-1), v).flatten(1)  # [T, hidden]


class ContextLenOnHost(minimal.MinimalRunner):
    max_seq_len = 1

    def step(self, batch: Batch) -> StepResult:
        self.max_seq_len = max(r.seq_len for r in batch.requests)
        return super().step(batch)

    def run_model(self, inputs: minimal.StepInputs) -> tuple[Tensor, Tensor]:
        w, keys = self.model.weights, self.max_seq_len
        x = w["embed"][inputs.tokens] + w["pos"][inputs.positions]  # [T, hidden]
        for i, (k_cache, v_cache) in enumerate(self.kv):
            h = minimal._rms(x)
            q, k, v = (h @ w[f"{n}{i}"] for n in "qkv")
            k_cache.index_copy_(0, inputs.slots, k.view(-1, minimal.HEADS, minimal.HEAD_DIM))
            v_cache.index_copy_(0, inputs.slots, v.view(-1, minimal.HEADS, minimal.HEAD_DIM))
            x = x + attention(q, k_cache, v_cache, inputs, keys) @ w[f"o{i}"]
            x = x + torch.nn.functional.silu(minimal._rms(x) @ w[f"up{i}"]) @ w[f"down{i}"]
        if inputs.last is not None:
            x = x[inputs.last]  # [R, hidden]
        logits = minimal._rms(x) @ w["head"]  # [R, vocab]
        return logits, minimal.sample(logits, inputs)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> ContextLenOnHost:
    return ContextLenOnHost(mode, seed=seed, backend=backend)
