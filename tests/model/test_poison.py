"""Valid rows are bit-identical whatever padding rows, unused table entries and free slots hold."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from pytest_graphmode.runtime.model import DecoderInputs
from tests.model.model_scenarios import CONFIG, Scenario, fresh_decoder, prepare, scenarios


def _garbage(shape: tuple[int, ...], live_blocks: list[int], generator: torch.Generator) -> Tensor:
    """Integers a stale or hostile buffer might hold: live block ids, edges, far out of range."""
    choices = torch.tensor([*live_blocks, -(10**12), -1, 0, CONFIG.num_blocks, 10**12])
    return choices[torch.randint(len(choices), shape, generator=generator)]


def _poison_inputs(inputs: DecoderInputs, scenario: Scenario, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    live = [b for blocks in scenario.block_ids for b in blocks]
    pad_tokens = slice(scenario.num_tokens, None)
    pad_reqs = slice(scenario.num_reqs, None)
    inputs.token_ids[pad_tokens] = _garbage((scenario.pad_tokens,), live, generator)
    inputs.positions[pad_tokens] = _garbage((scenario.pad_tokens,), live, generator)
    inputs.seq_lens[pad_reqs] = _garbage((scenario.pad_reqs,), live, generator)
    inputs.adapter_ids[pad_reqs] = _garbage((scenario.pad_reqs,), live, generator)
    for row in range(inputs.num_reqs):
        used = len(scenario.block_ids[row]) if row < scenario.num_reqs else 0
        unused = inputs.block_tables.shape[1] - used
        inputs.block_tables[row, used:] = _garbage((unused,), live, generator)


def _fill_free_slots(cache: Tensor, scenario: Scenario, value: float) -> None:
    """Every slot except the cached context: null block, unused and about-to-be-written slots."""
    context = cache[scenario.context_slots()].clone()
    cache.fill_(value)
    cache[scenario.context_slots()] = context


@pytest.mark.parametrize("use_adapters", [False, True], ids=["base", "adapters"])
@given(scenario=scenarios("mixed", adapters=True, padded=True), seed=st.integers(0, 2**16))
def test_valid_rows_are_bit_identical_under_poison(
    use_adapters: bool, scenario: Scenario, seed: int
) -> None:
    decoder = fresh_decoder()
    inputs = prepare(decoder, scenario, use_adapters=use_adapters)
    context = decoder.kv_cache.clone()

    _fill_free_slots(decoder.kv_cache, scenario, 0.0)
    clean = decoder.forward(inputs, use_adapters=use_adapters)
    clean_cache = decoder.kv_cache.clone()

    decoder.kv_cache.copy_(context)
    _fill_free_slots(decoder.kv_cache, scenario, float("nan"))
    decoder.kv_cache[CONFIG.null_block * CONFIG.block_size] = 1e30  # huge, not only NaN
    _poison_inputs(inputs, scenario, seed)
    poisoned = decoder.forward(inputs, use_adapters=use_adapters)

    valid = scenario.context_slots() + scenario.step_slots()
    assert torch.equal(poisoned[: scenario.num_reqs], clean[: scenario.num_reqs])
    assert torch.equal(decoder.kv_cache[valid], clean_cache[valid])
