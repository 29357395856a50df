"""Where `paged_attention` writes: the step's valid slots, and for padding only the null block."""

import torch
from hypothesis import given
from torch import Tensor

from pytest_graphmode.runtime.model import DecoderInputs
from tests.model.model_scenarios import CONFIG, Scenario, fresh_decoder, prepare, scenarios

NULL_SLOTS = set(
    range(CONFIG.null_block * CONFIG.block_size, (CONFIG.null_block + 1) * CONFIG.block_size)
)


def _changed_slots(before: Tensor, after: Tensor) -> set[int]:
    same = (before == after) | (before.isnan() & after.isnan())
    return set(torch.where(~same.flatten(1).all(dim=1))[0].tolist())


def _randomise(cache: Tensor, keep: list[int]) -> None:
    """Random values everywhere except the cached context, so every write is visible."""
    kept = cache[keep].clone()
    cache.normal_(generator=torch.Generator().manual_seed(1))
    cache[keep] = kept


@given(scenario=scenarios("mixed"))
def test_kv_writes_land_only_in_valid_slots_and_the_null_block(scenario: Scenario) -> None:
    decoder = fresh_decoder()
    inputs = prepare(decoder, scenario)
    _randomise(decoder.kv_cache, scenario.context_slots())
    before = decoder.kv_cache.clone()
    decoder.forward(inputs)
    changed = _changed_slots(before, decoder.kv_cache)
    assert set(scenario.step_slots()) <= changed
    assert changed - set(scenario.step_slots()) <= NULL_SLOTS


@given(scenario=scenarios("mixed"))
def test_valid_slots_hold_the_step_keys_and_values(scenario: Scenario) -> None:
    decoder = fresh_decoder()
    inputs = prepare(decoder, scenario)
    written: dict[int, tuple[Tensor, Tensor]] = {}

    def recording(
        layer: int, q: Tensor, k: Tensor, v: Tensor, step_inputs: DecoderInputs, kv_cache: Tensor
    ) -> Tensor:
        written[layer] = (k.clone(), v.clone())
        return decoder.attention(layer, q, k, v, step_inputs, kv_cache)

    decoder.forward(inputs, attention=recording)
    slots = torch.tensor(scenario.step_slots())
    for layer, (k, v) in written.items():
        valid = slice(0, scenario.num_tokens)
        assert torch.equal(decoder.kv_cache[slots, layer, 0], k[valid]), f"layer {layer} keys"
        assert torch.equal(decoder.kv_cache[slots, layer, 1], v[valid]), f"layer {layer} values"


@given(scenario=scenarios("mixed", padded=True))
def test_out_of_range_padding_slots_write_only_the_null_block(scenario: Scenario) -> None:
    decoder = fresh_decoder()
    inputs = prepare(decoder, scenario)
    padding = slice(scenario.num_tokens, None)
    garbage = torch.tensor([-1, -7, CONFIG.num_slots, 10**15, -(10**15)])
    inputs.slot_mapping[padding] = garbage[
        torch.arange(inputs.num_tokens - scenario.num_tokens) % 5
    ]
    _randomise(decoder.kv_cache, scenario.context_slots())
    before = decoder.kv_cache.clone()
    decoder.forward(inputs)
    changed = _changed_slots(before, decoder.kv_cache)
    assert changed - set(scenario.step_slots()) <= NULL_SLOTS
