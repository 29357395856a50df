"""The independent minimal runner: graph replay matches eager, padding is inert, the harness passes."""

from collections.abc import Iterator

import pytest
import torch

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.fuzz import run_campaign
from pytest_graphmode.runtime.backends import get as get_backend
from tests.runners.minimal import SPEC, MinimalRunner, make_target

NULL = slice(SPEC.null_block * SPEC.block_size, (SPEC.null_block + 1) * SPEC.block_size)
PROMPTS = Batch(
    (
        Request(1, (5, 6, 7), 0, (1,)),
        Request(2, (9,), 0, (2,), seed=11, temperature=0.8),
        Request(3, (3, 3), 0, (3,)),
    )
)
DECODE = Batch(
    (
        Request(1, (8,), 3, (1,)),
        Request(2, (4,), 1, (2,), seed=11, temperature=0.8),
        Request(3, (2,), 2, (3,)),
    )
)


@pytest.fixture
def twins() -> Iterator[tuple[MinimalRunner, MinimalRunner]]:
    with get_backend("sim").active():
        graph, eager = (
            make_target("graph", seed=3, backend="sim"),
            make_target("eager", seed=3, backend="sim"),
        )
        for target in (graph, eager):
            target.step(PROMPTS)
        yield graph, eager
        graph.close()
        eager.close()


def test_decode_batch_replays_the_padded_capture_size(
    twins: tuple[MinimalRunner, MinimalRunner],
) -> None:
    result = twins[0].step(DECODE)
    assert (result.path, result.graph_key, result.reason) == ("full", ("decode", 4), None)


def test_prefill_runs_eagerly_with_its_reason(twins: tuple[MinimalRunner, MinimalRunner]) -> None:
    result = twins[0].step(Batch((Request(4, (1, 2), 0, (4,)),)))
    assert (result.path, result.graph_key, result.reason) == ("eager", None, "prefill batch")


def test_replay_matches_eager_and_poisoned_padding_changes_nothing_outside_the_null_block(
    twins: tuple[MinimalRunner, MinimalRunner],
) -> None:
    graph, eager = twins
    for buffer in graph.static_buffers().values():
        buffer.fill_(float("nan") if buffer.is_floating_point() else 2)  # 2 = a live block id
    replayed, expected = graph.step(DECODE), eager.step(DECODE)
    torch.testing.assert_close(replayed.logits, expected.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(replayed.next_tokens, expected.next_tokens)
    for name, tensor in graph.state().items():
        outside = torch.ones(tensor.shape[0], dtype=torch.bool)
        outside[NULL] = False
        torch.testing.assert_close(tensor[outside], eager.state()[name][outside], msg=name)


def test_results_do_not_change_with_the_next_replay(
    twins: tuple[MinimalRunner, MinimalRunner],
) -> None:
    first = twins[0].step(DECODE)
    kept = first.logits.clone()
    twins[0].step(Batch((Request(1, (1,), 4, (1, 4)),)))
    assert torch.equal(first.logits, kept)


def test_a_sampled_request_draws_the_same_token_alone_and_in_company() -> None:
    seeded = Request(7, (9,), 0, (5,), seed=123, temperature=1.5)
    with get_backend("sim").active():
        alone = make_target("eager", seed=3, backend="sim").step(Batch((seeded,)))
        crowd = make_target("eager", seed=3, backend="sim").step(
            Batch((PROMPTS.requests[0], seeded))
        )
        torch.testing.assert_close(alone.logits[0], crowd.logits[1])
        assert alone.next_tokens[0] == crowd.next_tokens[1]


def test_minimal_runner_passes_the_harness() -> None:
    stats = run_campaign(make_target, backend="sim", max_examples=10, max_steps=8, seed=0)
    assert stats.failures == []
    assert stats.paths["full"] > 0
