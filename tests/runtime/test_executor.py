"""The executor: graph twin == eager twin, fallbacks with reasons, failed captures, invalidation."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_helpers import TINY, assert_kv_match, assert_match, make_batch

from pytest_graphmode import Batch
from pytest_graphmode.runtime import backends
from pytest_graphmode.runtime.dispatch import CAPTURE_FAILED, OVERSIZED
from pytest_graphmode.runtime.executor import GraphExecutor
from pytest_graphmode.runtime.keys import GraphKey
from pytest_graphmode.runtime.model import Decoder, DecoderInputs

SIZES = [1, 2, 4, 8, 16]
BACKENDS = [
    "sim",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


def executor(
    backend: Any,
    sizes: list[int],
    *,
    decoder: Decoder | None = None,
    seed: int = 1,
    max_query_len: int = 4,
    piecewise: bool = False,
) -> GraphExecutor:
    decoder = decoder or Decoder(TINY, seed=seed, device=backend.device)
    return GraphExecutor(
        decoder,
        backend,
        capture_sizes=sizes,
        max_query_len=max_query_len,
        piecewise=piecewise,
        max_num_reqs=24,
        max_num_tokens=64,
    )


def twins(backend: Any, sizes: list[int] = SIZES) -> tuple[GraphExecutor, GraphExecutor]:
    return executor(backend, sizes), executor(backend, [])


@pytest.fixture(scope="module")
def sim_twins(sim: Any) -> tuple[GraphExecutor, GraphExecutor]:
    return twins(sim)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("query_len", [1, 2, 4])
def test_graph_twin_matches_eager_twin_in_every_bucket(backend_name: str, query_len: int) -> None:
    graph, eager = twins(backends.get(backend_name))
    for smaller, size in itertools.pairwise([0, *SIZES]):
        if size * query_len > max(SIZES):
            continue
        for num_reqs in sorted({smaller + 1, size}):  # the least and most padding of this bucket
            batch = make_batch(
                [query_len] * num_reqs,
                context=size % 5 + 2,
                seeds=[r if r % 2 else None for r in range(num_reqs)],
            )
            result = graph.step(batch)
            assert result.path == "full", result.reason
            assert result.graph_key == GraphKey(
                "full", size * query_len, size, query_len, "decode", False
            )
            assert_match(result, eager.step(batch))
    assert_kv_match(graph.decoder.kv_cache, eager.decoder.kv_cache)
    graph.close()
    eager.close()


@settings(max_examples=12)  # each example runs both twins; new shapes also capture
@given(
    query_len=st.sampled_from([1, 2, 4]),
    num_reqs=st.integers(1, 16),
    context=st.integers(1, 8),  # 16 requests x 3 blocks fit the tiny cache
    sampled=st.lists(st.booleans(), min_size=16, max_size=16),
    adapter=st.sampled_from([0, 1, 2]),
)
def test_graph_twin_matches_eager_twin_on_random_decode_steps(
    sim_twins: tuple[GraphExecutor, GraphExecutor],
    query_len: int,
    num_reqs: int,
    context: int,
    sampled: list[bool],
    adapter: int,
) -> None:
    graph, eager = sim_twins
    batch = make_batch(
        [query_len] * num_reqs,
        context=context,
        seeds=[1000 + r if sampled[r] else None for r in range(num_reqs)],
        adapters=[adapter if r % 2 else 0 for r in range(num_reqs)],
    )
    result = graph.step(batch)
    bucket = min(size for size in SIZES if size >= num_reqs)
    assert result.path == ("full" if bucket * query_len <= max(SIZES) else "eager")
    assert_match(result, eager.step(batch))
    assert_kv_match(graph.decoder.kv_cache, eager.decoder.kv_cache)


def test_oversized_batch_falls_back_to_eager_with_its_reason(sim: Any) -> None:
    graph, eager = twins(sim)
    batch = make_batch([1] * 17, context=2)
    result = graph.step(batch)
    assert (result.path, result.graph_key) == ("eager", None)
    assert result.reason is not None
    assert "batch of 17 tokens exceeds the largest capture size 16" in result.reason
    assert graph.stats().fallbacks == {OVERSIZED: 1}
    assert graph.graphs == ()
    assert_match(result, eager.step(batch))


class HostReadingDecoder(Decoder):
    """A decoder whose body reads a value back to the host: fine eagerly, not capturable."""

    def hidden(self, inputs: DecoderInputs, **options: Any) -> torch.Tensor:
        if int(inputs.seq_lens.max().item()) < 0:
            raise AssertionError("sequence lengths are never negative")
        return super().hidden(inputs, **options)


def test_failed_capture_falls_back_to_eager_with_the_capture_error_as_reason(sim: Any) -> None:
    broken = executor(sim, [1, 2, 4], decoder=HostReadingDecoder(TINY, seed=1, device=sim.device))
    graph, eager = twins(sim, [1, 2, 4])
    batch = make_batch([1, 1, 1], context=4)
    result = broken.step(batch)
    key = GraphKey("full", 4, 4, 1, "decode", False)
    assert (result.path, result.graph_key) == ("eager", None)
    assert result.reason is not None
    assert result.reason.startswith(f"capture of {key} failed: CaptureError")
    assert broken.graphs == () and list(broken.failed) == [key]
    assert_match(result, eager.step(batch))
    graph.step(batch)
    for name, tensor in graph.inputs.tensors().items():  # the failure left the staged inputs
        assert torch.equal(tensor, broken.inputs.tensors()[name]), name


def test_a_failed_key_is_not_captured_again(sim: Any) -> None:
    broken = executor(sim, [1, 2, 4], decoder=HostReadingDecoder(TINY, seed=1, device=sim.device))
    for context in (3, 4, 5):
        assert broken.step(make_batch([1, 1, 1], context=context)).path == "eager"
    stats = broken.stats()
    assert (stats.failed_captures, stats.captures) == (1, 0)
    assert stats.fallbacks == {CAPTURE_FAILED: 3}


def test_replay_after_a_weight_change_equals_eager_with_the_new_weights(sim: Any) -> None:
    graph, eager = twins(sim)
    batch = make_batch([1, 1, 1], context=3)
    assert_match(graph.step(batch), eager.step(batch))
    for twin in (graph, eager):
        twin.decoder.load_weights(seed=77)
    graph.invalidate("weights replaced")
    assert graph.graphs == ()
    later = make_batch([1, 1, 1], context=4)
    result = graph.step(later)
    assert result.path == "full"
    assert_match(result, eager.step(later))
    stats = graph.stats()
    assert (stats.captures, stats.invalidations) == (2, ("weights replaced",))


def test_results_stay_valid_after_the_next_replay(sim: Any) -> None:
    graph, _ = twins(sim)
    first = graph.step(make_batch([1, 1, 1], context=3))
    kept = first.logits.clone(), first.next_tokens.clone()
    second = graph.step(make_batch([1, 1, 1, 1], context=7, first_block=30))
    assert second.graph_key == first.graph_key
    assert torch.equal(first.logits, kept[0]) and torch.equal(first.next_tokens, kept[1])


def test_capture_all_captures_largest_first_and_later_steps_hit(sim: Any) -> None:
    graph = executor(sim, [1, 2], max_query_len=2)
    graph.capture_all()
    tokens = [key.num_tokens for key in graph.graphs]
    assert tokens == sorted(tokens, reverse=True)
    assert len(graph.graphs) == 6  # (R=2, q=1), (R=1, q=1), (R=1, q=2); with and without adapters
    graph.step(make_batch([1, 1]))
    graph.step(make_batch([2], adapters=[1]))
    stats = graph.stats()
    assert (stats.captures, stats.hits) == (6, 2)


def test_only_an_executors_first_capture_warms_up(
    sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_graphmode.runtime import captured_steps

    graph, eager = executor(sim, [1, 2], max_query_len=2, piecewise=True), executor(sim, [])
    captures_before_each_warm_up = []
    real = captured_steps.warm_up

    def counted(backend: Any, run: Any) -> None:
        captures_before_each_warm_up.append(graph.stats().captures)
        real(backend, run)

    monkeypatch.setattr(captured_steps, "warm_up", counted)
    graph.capture_all()
    for batch in (make_batch([1, 1]), make_batch([3, 2])):  # a FULL graph, then a piecewise one
        assert_match(graph.step(batch), eager.step(batch))
    assert graph.stats().captures == 7
    assert captures_before_each_warm_up == [0]  # one warm-up, before the first capture


def test_stats_report_padding_of_graph_steps(sim: Any) -> None:
    graph = executor(sim, [4])
    graph.step(make_batch([1, 1, 1]))
    graph.step(make_batch([1, 1]))
    graph.step(make_batch([1] * 5))
    stats = graph.stats()
    assert stats.steps == {"full": 2, "eager": 1}
    assert (stats.graph_tokens, stats.padded_tokens) == (5, 8)
    assert stats.padding_ratio == pytest.approx(3 / 8)


def test_a_closed_executor_refuses_to_step(sim: Any) -> None:
    graph = executor(sim, [1])
    graph.step(make_batch([1]))
    graph.close()
    assert graph.graphs == ()
    with pytest.raises(RuntimeError, match="closed"):
        graph.step(make_batch([1]))


def test_decoder_and_backend_must_share_a_device(sim: Any) -> None:
    decoder = Decoder(TINY, seed=1, device="meta")
    with pytest.raises(ValueError, match=r"device=backend\.device"):
        GraphExecutor(decoder, sim, capture_sizes=[1])


def test_an_empty_batch_is_rejected(sim: Any) -> None:
    with pytest.raises(ValueError, match="at least one request"):
        executor(sim, [1]).step(Batch(()))


PIECEWISE_BATCHES = [
    pytest.param(make_batch([7, 1, 1], context=0), 16, id="prefill-and-first-tokens"),
    pytest.param(make_batch([3, 1], context=4, adapters=[1, 2]), 4, id="mixed-adapters"),
    pytest.param(make_batch([2, 5, 1, 1], context=2, seeds=[1, None, 2, 3]), 16, id="mixed"),
    pytest.param(make_batch([1] * 20, context=1), 32, id="above-largest-full-graph"),
]


@pytest.mark.parametrize(("batch", "tokens"), PIECEWISE_BATCHES)
def test_piecewise_graph_matches_eager_for_batches_no_full_graph_serves(
    sim: Any, batch: Batch, tokens: int
) -> None:
    graph, eager = executor(sim, SIZES, piecewise=True), executor(sim, [])
    for _ in range(2):  # capture, then replay the cached graph
        result = graph.step(batch)
        assert result.path == "piecewise", result.reason
        assert result.graph_key == GraphKey(
            "piecewise", tokens, None, None, None, any(r.adapter for r in batch.requests)
        )
        assert_match(result, eager.step(batch))
    assert_kv_match(graph.decoder.kv_cache, eager.decoder.kv_cache)
    assert graph.stats().hits == 1


def test_failed_piecewise_capture_falls_back_to_eager(sim: Any) -> None:
    decoder = HostReadingDecoder(TINY, seed=1, device=sim.device)
    broken = executor(sim, SIZES, decoder=decoder, piecewise=True)
    result = broken.step(make_batch([3, 1]))
    assert result.path == "eager"
    assert result.reason is not None
    assert result.reason.startswith("capture of piecewise[T=4] failed: CaptureError")
    assert broken.graphs == ()


def test_vmm_memory_gives_each_graph_its_own_view_over_one_physical_pool(sim: Any) -> None:
    decoder = Decoder(TINY, seed=1, device=sim.device)
    graph = GraphExecutor(decoder, sim, capture_sizes=[1, 2, 4], memory="vmm")
    eager = executor(sim, [])
    for num_reqs in (1, 2, 3):
        batch = make_batch([1] * num_reqs)
        assert_match(graph.step(batch), eager.step(batch))
    views = graph.address_views()
    assert sorted(v.graph_key.num_reqs for v in views) == [1, 2, 4]
    ranges = sorted((v.base, v.end) for v in views)
    assert all(end <= base for (_, end), (base, _) in itertools.pairwise(ranges))
    assert graph.stats().pool_bytes < sum(v.size for v in views)
    graph.invalidate("configuration changed")
    assert graph.address_views() == []


def test_a_requests_sample_does_not_depend_on_its_bucket_or_company(sim: Any) -> None:
    graph = executor(sim, SIZES)
    company = make_batch([1] * 7, context=6, seeds=[3] * 7, first_block=20)
    alone = Batch(
        (dataclasses.replace(make_batch([1], context=6, seeds=[3]).requests[0], req_id=1),)
    )
    crowded = graph.step(Batch(alone.requests + company.requests))  # row 0 of bucket 8
    single = graph.step(alone)  # row 0 of bucket 1
    assert (crowded.graph_key.num_reqs, single.graph_key.num_reqs) == (8, 1)  # type: ignore[union-attr]
    torch.testing.assert_close(single.logits[0], crowded.logits[0], atol=1e-5, rtol=1e-5)
    assert single.next_tokens[0] == crowded.next_tokens[0]
