"""A packed cache (two float4 codes a byte) in `state()` is judged through its bytes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from pytest_graphmode.fuzz import GraphmodeFailure, run_campaign
from pytest_graphmode.fuzz.packed_state import PACKED, packed_state_as_bytes
from tests.fuzz import toy

pytestmark = pytest.mark.skipif(not PACKED, reason="this torch has no packed float4 type")
FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)


class KeepsPackedCodes(toy.ToyTarget):
    """The toy, also keeping each key as packed float4 codes, as an NVFP4 cache keeps them; with
    `wrong_slot`, graph mode writes them one slot further."""

    def __init__(self, *args: Any, wrong_slot: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.codes = torch.zeros(toy.SPEC.num_slots, toy.HIDDEN, dtype=torch.uint8).view(FLOAT4)
        self.wrong_slot = wrong_slot and self.mode == "graph"

    def state(self) -> Mapping[str, torch.Tensor]:
        return {**super().state(), "codes": self.codes}

    def _forward(self, token_ids, positions, adapters, slots, *args: Any, rows: int) -> Any:
        values = self.emb[token_ids] * (1 + positions[:, None] / 100)
        nibbles = (values.abs() * 4).clamp(0, 7).to(torch.uint8)
        target = (slots + 1 if self.wrong_slot else slots).remainder(toy.SPEC.num_slots)
        self.codes.view(torch.uint8).index_copy_(0, target, nibbles * 17)  # both halves alike
        return super()._forward(token_ids, positions, adapters, slots, *args, rows=rows)


def keeps_packed_codes(mode: str, *, seed: int, backend: str) -> KeepsPackedCodes:
    return KeepsPackedCodes(mode, seed=seed, backend=backend)


def writes_packed_codes_one_slot_off(mode: str, *, seed: int, backend: str) -> KeepsPackedCodes:
    return KeepsPackedCodes(mode, seed=seed, backend=backend, wrong_slot=True)


def test_the_harness_sees_a_packed_tensor_as_its_bytes_and_nothing_else_changes() -> None:
    packed = packed_state_as_bytes(keeps_packed_codes("graph", seed=0, backend="sim"))
    state = packed.state()
    assert state["codes"].dtype == torch.uint8 and state["kv"].dtype == torch.float32
    plain = toy.make_target("graph", seed=0, backend="sim")
    assert packed_state_as_bytes(plain) is plain


def test_a_runner_with_a_packed_cache_is_fuzzed_and_its_bug_is_caught() -> None:
    stats = run_campaign(keeps_packed_codes, max_examples=4, max_steps=6, seed=1)
    assert stats.failures == [] and stats.paths["full"] > 0
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(
            writes_packed_codes_one_slot_off, max_examples=10, max_steps=6, seed=1, shrink_seconds=0
        )
    assert caught.value.failure.check in {"kv_writes_confined", "kv_writes_land", "states_match"}
