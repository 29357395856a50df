"""Piecewise graphs: pieces between attention calls replay; attention runs eagerly in between."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_graphmode import Request
from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.model import Decoder, DecoderConfig, DecoderInputs, make_inputs
from pytest_graphmode.runtime.piecewise import (
    AddressContractError,
    AttentionRunner,
    PiecewiseGraph,
    capture_piecewise,
)

CONFIG = dataclasses.replace(
    DecoderConfig.tiny(), block_size=16, num_blocks=40, max_blocks_per_req=8
)
TOKENS = 128
MAX_REQS = 8


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.graphmode_cuda)])
def be(request: pytest.FixtureRequest) -> Iterator[object]:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("cuda backend: no CUDA GPU on this machine")
    backend = backends.get(request.param)
    yield backend
    backend.synchronize()


class Twins:
    """A piecewise graph over static inputs, and an eager decoder with the same weights."""

    def __init__(self, be: object, runner_factory: object = AttentionRunner) -> None:
        device = be.device  # type: ignore[attr-defined]
        self.device = device
        self.graph_decoder = Decoder(CONFIG, seed=7, device=device)
        self.eager_decoder = Decoder(CONFIG, seed=7, device=device)
        placeholder = [Request(0, (1,), 0, (1,))]  # the capture batch: replay uses others
        first = make_inputs(
            CONFIG, placeholder, device=device, num_tokens=TOKENS, num_reqs=MAX_REQS
        )
        self.static = {name: t.clone() for name, t in first.tensors().items()}
        inputs = self.inputs(MAX_REQS)
        self.graph_decoder.hidden(inputs)  # warm-up, mirrored on the eager twin
        self.eager_decoder.hidden(inputs)
        self.graph = capture_piecewise(
            be,
            inputs,
            lambda attention: self.graph_decoder.hidden(inputs, attention=attention),
            self.graph_decoder.attention,
            pool=be.graph_pool_handle(),  # type: ignore[attr-defined]
            runner_factory=runner_factory,  # type: ignore[arg-type]
        )

    def inputs(self, num_reqs: int) -> DecoderInputs:
        s = self.static
        return DecoderInputs(
            token_ids=s["token_ids"],
            positions=s["positions"],
            slot_mapping=s["slot_mapping"],
            query_start=s["query_start"][: num_reqs + 1],
            seq_lens=s["seq_lens"][:num_reqs],
            block_tables=s["block_tables"][:num_reqs],
            adapter_ids=s["adapter_ids"][:num_reqs],
        )

    def step(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        fresh = make_inputs(CONFIG, requests, device=self.device, num_tokens=TOKENS)
        for name, tensor in fresh.tensors().items():
            self.static[name][: tensor.shape[0]].copy_(tensor)
        inputs = self.inputs(len(requests))
        hidden = self.graph.replay(inputs, self.graph_decoder.kv_cache)
        graph_logits = self.graph_decoder.logits(hidden, inputs)
        eager_logits = self.eager_decoder.forward(fresh)
        return graph_logits, eager_logits


def _prefill(lengths: list[int], first_block: int = 1) -> list[Request]:
    requests, block = [], first_block
    for index, length in enumerate(lengths):
        blocks = tuple(range(block, block + -(-length // CONFIG.block_size)))
        block += len(blocks)
        tokens = tuple((31 * index + 7 * t) % CONFIG.vocab_size for t in range(length))
        requests.append(Request(index, tokens, 0, blocks))
    return requests


def test_piecewise_graph_splits_at_every_attention_call(be):
    twins = Twins(be)
    assert len(twins.graph.runners) == CONFIG.layers
    assert len(twins.graph.pieces) == CONFIG.layers + 1


@pytest.mark.parametrize("split", [[64, 64], [32] * 4, [16] * 8])
def test_one_graph_serves_128_tokens_in_any_composition(be, split):
    twins = Twins(be)
    graph_logits, eager_logits = twins.step(_prefill(split))
    torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        twins.graph_decoder.kv_cache[CONFIG.block_size :],
        twins.eager_decoder.kv_cache[CONFIG.block_size :],
    )


def test_compositions_replay_back_to_back_on_one_graph(be):
    twins = Twins(be)
    for split in ([64, 64], [32] * 4, [16] * 8, [100, 20, 8]):
        graph_logits, eager_logits = twins.step(_prefill(split))
        torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)


@st.composite
def _mixed_steps(draw: st.DrawFn) -> list[list[Request]]:
    """Two steps over the same requests: a first chunk (prefill), then a second chunk or a decode."""
    count = draw(st.integers(1, 4))
    first = draw(st.lists(st.integers(1, 24), min_size=count, max_size=count))
    second = draw(st.lists(st.integers(1, 24), min_size=count, max_size=count))
    steps: list[list[Request]] = [[], []]
    block = 1
    for index in range(count):
        total = first[index] + second[index]
        blocks = tuple(range(block, block + -(-total // CONFIG.block_size)))
        block += len(blocks)
        tokens = [(13 * index + 5 * t + 3) % CONFIG.vocab_size for t in range(total)]
        steps[0].append(Request(index, tuple(tokens[: first[index]]), 0, blocks))
        steps[1].append(Request(index, tuple(tokens[first[index] :]), first[index], blocks))
    return steps


# The backend fixture holds no per-example state, so sharing it across examples is safe.
@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=_mixed_steps())
def test_piecewise_matches_eager_for_prefill_chunked_and_mixed_batches(be, steps):
    twins = Twins(be)
    for requests in steps:
        graph_logits, eager_logits = twins.step(requests)
        torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)


class _ReallocatingRunner(AttentionRunner):
    """A runner that returns attention's fresh output instead of writing the captured buffer."""

    def run(self, inputs: DecoderInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        self.out = self.attention(self.layer, self.q, self.k, self.v, inputs, kv_cache)
        return self.out


def test_runner_that_reallocates_its_output_breaks_the_address_contract(be):
    twins = Twins(be, runner_factory=_ReallocatingRunner)
    with pytest.raises(
        AddressContractError, match=r"piece 1 reads the attention output of layer 0"
    ):
        twins.step(_prefill([64, 64]))


def test_staging_into_other_buffers_breaks_the_address_contract(be):
    twins = Twins(be)
    inputs = dataclasses.replace(twins.inputs(2), token_ids=twins.static["token_ids"].clone())
    with pytest.raises(AddressContractError, match="static input 'token_ids'"):
        twins.graph.replay(inputs, twins.graph_decoder.kv_cache)


def test_a_failed_piecewise_capture_leaves_no_pieces(be):
    decoder = Decoder(CONFIG, seed=1, device=be.device)
    inputs = make_inputs(CONFIG, [Request(0, (1,), 0, (1,))], device=be.device, num_tokens=16)
    captured: list[PiecewiseGraph] = []

    def body(attention):
        hidden = decoder.hidden(inputs, attention=attention)
        hidden.sum().item()  # a host read inside the last piece
        return hidden

    decoder.hidden(inputs, attention=decoder.attention)  # warm-up: cuBLAS cannot start in a capture
    with pytest.raises(be.CaptureError):
        captured.append(
            capture_piecewise(be, inputs, body, decoder.attention, pool=be.graph_pool_handle())
        )
    assert captured == []
