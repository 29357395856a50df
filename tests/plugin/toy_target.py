"""A few-line target for plugin tests: a lookup-table "model" with a slot-major KV tensor.

The tests copy this file into pytester's directory as `graphmode_toy.py`. `make_target` is correct;
`make_broken_target` is the same runner whose graph twin adds 1 to every logit, the smallest bug the
`replay_matches_eager` check must report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from pytest_graphmode.contract import AddressView, Batch, StepResult, TargetSpec

SPEC = TargetSpec(
    num_blocks=16,
    block_size=4,
    max_blocks_per_req=4,
    vocab_size=16,
    max_num_reqs=4,
    max_num_tokens=8,
    capture_sizes=(1, 2, 4),
    features=frozenset({"decode"}),
)


class ToyTarget:
    def __init__(self, mode: str, seed: int, logit_offset: float) -> None:
        self.spec = SPEC
        self._mode = mode
        self._offset = logit_offset
        generator = torch.Generator().manual_seed(seed)
        self._table = torch.randn(SPEC.vocab_size, SPEC.vocab_size, generator=generator)
        self._kv = torch.zeros(SPEC.num_slots, SPEC.vocab_size)

    def step(self, batch: Batch) -> StepResult:
        size = SPEC.block_size
        rows = []
        for request in batch.requests:
            for i, token in enumerate(request.tokens):
                position = request.context_len + i
                slot = request.block_ids[position // size] * size + position % size
                self._kv[slot] = self._table[token]
            rows.append(self._table[request.tokens[-1]] + self._offset)
        logits = torch.stack(rows)
        graph = self._mode == "graph" and batch.num_tokens in SPEC.capture_sizes
        return StepResult(
            logits=logits,
            next_tokens=logits.argmax(dim=-1),
            path="full" if graph else "eager",
            graph_key=batch.num_tokens if graph else None,
            reason=None if graph else "not a capture size",
        )

    def state(self) -> Mapping[str, torch.Tensor]:
        return {"kv": self._kv}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self._table.copy_(torch.randn(self._table.shape, generator=generator))

    def close(self) -> None:
        return None


def make_target(mode: str, *, seed: int, backend: str) -> ToyTarget:
    return ToyTarget(mode, seed, logit_offset=0.0)


def make_broken_target(mode: str, *, seed: int, backend: str) -> ToyTarget:
    return ToyTarget(mode, seed, logit_offset=1.0 if mode == "graph" else 0.0)


def make_target_broken_in_children(mode: str, *, seed: int, backend: str) -> ToyTarget:
    """Correct in the process pytest runs in, broken in its child processes: only a helper
    campaign can find the bug."""
    import multiprocessing

    in_child = multiprocessing.parent_process() is not None
    return (make_broken_target if in_child else make_target)(mode, seed=seed, backend=backend)


# Broken targets, each rejected before any campaign starts.


class NoStep:
    """Everything but `step()`."""

    def __init__(self) -> None:
        self.spec = SPEC

    def state(self) -> Mapping[str, torch.Tensor]:
        return {}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return {}

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        return None

    def close(self) -> None:
        return None


def make_target_without_step(mode: str, *, seed: int, backend: str) -> NoStep:
    return NoStep()


def make_target_with_too_many_blocks(mode: str, *, seed: int, backend: str) -> ToyTarget:
    """The spec claims 32 blocks; the KV tensor has the 16 blocks' rows of `SPEC`."""
    target = ToyTarget(mode, seed, logit_offset=0.0)
    target.spec = dataclasses.replace(SPEC, num_blocks=32)
    return target


def make_raising_target(mode: str, *, seed: int, backend: str) -> ToyTarget:
    raise RuntimeError("cannot open the model weights")


def make_target_failing_capture(mode: str, *, seed: int, backend: str) -> ToyTarget:
    if mode == "graph":
        raise RuntimeError("the captured forward read a host tensor")
    return ToyTarget(mode, seed, logit_offset=0.0)


def make_target_without_eager_twin(mode: str, *, seed: int, backend: str) -> ToyTarget:
    if mode == "eager":
        raise NotImplementedError("eager mode")
    return ToyTarget(mode, seed, logit_offset=0.0)
