"""A step captured on the sim backend replays any other batch of the same row counts like eager."""

from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.model import make_inputs, sample
from tests.model.model_scenarios import CONFIG, Scenario, fresh_decoder, prepare, scenarios

NUM_REQS = 6


@given(
    captured=scenarios("mixed", adapters=True),
    replayed=scenarios("mixed", adapters=True),
    use_adapters=st.booleans(),
)
def test_replay_of_a_captured_step_equals_eager(
    captured: Scenario, replayed: Scenario, use_adapters: bool
) -> None:
    with backends.get("sim").active() as sim:
        _check_replay_equals_eager(sim, captured, replayed, use_adapters)


def _check_replay_equals_eager(
    sim: Any, captured: Scenario, replayed: Scenario, use_adapters: bool
) -> None:
    decoder = fresh_decoder(device=sim.device)
    num_tokens = max(captured.num_tokens, replayed.num_tokens) + 1
    fresh = prepare(
        decoder, replayed, use_adapters=use_adapters, num_tokens=num_tokens, num_reqs=NUM_REQS
    )
    static = make_inputs(
        CONFIG,
        captured.step_requests(),
        device=sim.device,
        num_tokens=num_tokens,
        num_reqs=NUM_REQS,
    )
    seeds = torch.arange(NUM_REQS, device=sim.device) * 7
    temperatures = torch.ones(NUM_REQS, device=sim.device)
    graph = sim.Graph()
    with sim.graph(graph):
        logits = decoder.forward(static, use_adapters=use_adapters)
        tokens = sample(logits, seeds, temperatures, static.seq_lens)

    cache = decoder.kv_cache.clone()
    eager = decoder.forward(fresh, use_adapters=use_adapters)
    eager_tokens = sample(eager, seeds, temperatures, fresh.seq_lens)
    eager_cache = decoder.kv_cache.clone()
    decoder.kv_cache.copy_(cache)
    for name, tensor in static.tensors().items():
        tensor.copy_(fresh.tensors()[name])
    graph.replay()

    valid, written = replayed.num_reqs, replayed.step_slots()
    assert torch.equal(logits[:valid], eager[:valid])
    assert torch.equal(tokens[:valid], eager_tokens[:valid])
    assert torch.equal(decoder.kv_cache[written], eager_cache[written])
