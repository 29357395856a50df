"""`Decoder.forward` against the dense reference, for every batch shape, with one code path."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from pytest_graphmode.runtime.model import Decoder, DecoderInputs, make_inputs, reference_forward
from tests.model.model_scenarios import (
    CONFIG,
    KINDS,
    ONE_PREFILL,
    Scenario,
    fresh_decoder,
    prepare,
    scenarios,
)

ATOL = 1e-4


def _reference(decoder: Decoder, scenario: Scenario, *, use_adapters: bool) -> torch.Tensor:
    return reference_forward(
        CONFIG, decoder.weights(), scenario.sequences, scenario.adapters, use_adapters=use_adapters
    )


@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_forward_matches_dense_reference(kind: str, data: st.DataObject) -> None:
    scenario = data.draw(scenarios(kind))
    decoder = fresh_decoder()
    logits = decoder.forward(prepare(decoder, scenario))
    expected = _reference(decoder, scenario, use_adapters=False)
    torch.testing.assert_close(logits[: scenario.num_reqs], expected, atol=ATOL, rtol=ATOL)


@given(scenario=scenarios("mixed", adapters=True))
def test_forward_with_adapters_matches_dense_reference(scenario: Scenario) -> None:
    decoder = fresh_decoder()
    logits = decoder.forward(prepare(decoder, scenario, use_adapters=True), use_adapters=True)
    expected = _reference(decoder, scenario, use_adapters=True)
    torch.testing.assert_close(logits[: scenario.num_reqs], expected, atol=ATOL, rtol=ATOL)


@given(scenario=scenarios("mixed"))
def test_adapter_zero_equals_running_without_adapters(scenario: Scenario) -> None:
    decoder = fresh_decoder()
    inputs = prepare(decoder, scenario)
    cache = decoder.kv_cache.clone()
    without = decoder.forward(inputs)
    decoder.kv_cache.copy_(cache)
    with_base_adapter = decoder.forward(inputs, use_adapters=True)
    torch.testing.assert_close(with_base_adapter, without, atol=0, rtol=0, equal_nan=True)


def test_adapters_change_the_logits() -> None:
    decoder = fresh_decoder()
    scenario = Scenario(
        sequences=((5, 6, 7),) * (CONFIG.num_adapters + 1),
        context_lens=(0,) * (CONFIG.num_adapters + 1),
        block_ids=tuple((b,) for b in range(1, CONFIG.num_adapters + 2)),
        adapters=tuple(range(CONFIG.num_adapters + 1)),
        history_chunk=1,
        pad_tokens=0,
        pad_reqs=0,
    )
    logits = decoder.forward(prepare(decoder, scenario, use_adapters=True), use_adapters=True)
    for adapter in range(1, CONFIG.num_adapters + 1):
        assert (logits[adapter] - logits[0]).abs().max() > 0.1, f"adapter {adapter} has no effect"


def test_use_adapters_needs_a_config_with_adapters() -> None:
    config = dataclasses.replace(CONFIG, num_adapters=0)
    decoder = Decoder(config, seed=0, device="cpu")
    inputs = make_inputs(config, ONE_PREFILL, device="cpu")
    with pytest.raises(ValueError, match="num_adapters >= 1"):
        decoder.forward(inputs, use_adapters=True)


def test_forward_calls_the_given_attention_once_per_layer() -> None:
    decoder = fresh_decoder()
    inputs = make_inputs(CONFIG, ONE_PREFILL, device="cpu")
    calls: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def recording(
        layer: int, q: Tensor, k: Tensor, v: Tensor, step_inputs: DecoderInputs, kv_cache: Tensor
    ) -> Tensor:
        assert step_inputs is inputs and kv_cache is decoder.kv_cache
        calls.append((layer, tuple(q.shape), tuple(k.shape)))
        return decoder.attention(layer, q, k, v, step_inputs, kv_cache)

    decoder.forward(inputs, attention=recording)
    q_shape = (inputs.num_tokens, CONFIG.heads, CONFIG.head_dim)
    kv_shape = (inputs.num_tokens, CONFIG.kv_heads, CONFIG.head_dim)
    assert calls == [(layer, q_shape, kv_shape) for layer in range(CONFIG.layers)]
