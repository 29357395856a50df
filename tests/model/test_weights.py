"""Weights are a pure function of the seed and `load_weights` rewrites them in place."""

import dataclasses

import torch

from pytest_graphmode import Request
from pytest_graphmode.runtime.model import Decoder, make_inputs, weight_shapes
from tests.model.model_scenarios import CONFIG, fresh_decoder


def test_same_seed_gives_identical_weights() -> None:
    first, second = fresh_decoder(seed=3).weights(), fresh_decoder(seed=3).weights()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_different_seeds_give_different_weights() -> None:
    first, second = fresh_decoder(seed=3).weights(), fresh_decoder(seed=4).weights()
    assert all(not torch.equal(first[name], second[name]) for name in first)


def test_weights_have_the_documented_names_and_shapes() -> None:
    weights = fresh_decoder().weights()
    assert {name: tuple(w.shape) for name, w in weights.items()} == weight_shapes(CONFIG)
    assert all(w.dtype == CONFIG.torch_dtype for w in weights.values())


def test_adapter_zero_is_the_base_model() -> None:
    weights = fresh_decoder().weights()
    tables = [w for name, w in weights.items() if "adapter" in name]
    assert tables and all(not table[0].any() and table[1:].abs().sum() > 0 for table in tables)


def test_load_weights_writes_in_place() -> None:
    decoder = fresh_decoder(seed=1)
    addresses = {name: w.data_ptr() for name, w in decoder.weights().items()}
    decoder.load_weights(seed=2)
    assert {name: w.data_ptr() for name, w in decoder.weights().items()} == addresses


def test_load_weights_gives_the_weights_of_that_seed() -> None:
    decoder = fresh_decoder(seed=1)
    decoder.load_weights(seed=2)
    expected = fresh_decoder(seed=2).weights()
    assert all(torch.equal(w, expected[name]) for name, w in decoder.weights().items())


def test_logits_have_a_healthy_top2_margin() -> None:
    """Most greedy choices must survive round-off, or graph and eager twins disagree by chance."""
    decoder = fresh_decoder()
    requests = [
        Request(req_id=i, tokens=(i, 3 * i + 1), context_len=0, block_ids=(i + 1,))
        for i in range(32)
    ]
    logits = decoder.forward(make_inputs(CONFIG, requests, device="cpu"))
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05


def test_bfloat16_decoder_holds_the_same_weights_rounded() -> None:
    config = dataclasses.replace(CONFIG, dtype="bfloat16")
    low = Decoder(config, seed=0, device="cpu").weights()
    full = fresh_decoder(seed=0).weights()
    assert all(torch.equal(low[name], full[name].to(torch.bfloat16)) for name in full)
