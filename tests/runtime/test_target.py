"""The default target: the contract over the reference decoder and the graph executor."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from runtime_helpers import TINY, assert_kv_match, assert_match, make_batch

from pytest_graphmode import Batch, GraphTarget
from pytest_graphmode.runtime.model import Decoder
from pytest_graphmode.runtime.target import make_target

BACKENDS = [
    "sim",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]

SCHEDULE = [
    ("full", make_batch([1, 1, 1], context=4, seeds=[5, None, 6])),
    ("full", make_batch([1, 1, 1, 1, 1], context=5, seeds=[None, 1, 2, 3, None])),
    ("full", make_batch([4, 4], context=6, seeds=[9, None])),  # speculative decoding, k = 3
    ("full", make_batch([1, 1], context=10, adapters=[2, 0])),
    ("full", make_batch([3, 3], context=0)),  # uniform prefill
    ("eager", make_batch([7, 1, 1], context=0)),  # mixed prefill + decode
    ("eager", make_batch([1] * 20, context=2)),  # above the largest capture size
]


def test_spec_describes_the_tiny_decoder_and_its_graphs() -> None:
    target = make_target("graph", seed=0, backend="sim")
    assert isinstance(target, GraphTarget)
    spec = target.spec
    assert spec.capture_sizes == (1, 2, 4, 8, 16)
    assert (spec.num_blocks, spec.block_size, spec.vocab_size) == (64, 4, 256)
    assert (spec.max_num_reqs, spec.max_num_tokens, spec.null_block) == (32, 128, 0)
    assert spec.features == {
        "decode",
        "spec_decode",
        "prefill",
        "sampling",
        "adapters",
        "weight_update",
    }
    assert target.state()["kv_cache"].shape[0] == spec.num_slots
    target.close()


@pytest.mark.parametrize("piecewise", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_and_eager_twins_agree_on_a_schedule(backend: str, piecewise: bool) -> None:
    graph = make_target("graph", seed=3, backend=backend, piecewise=piecewise)
    eager = make_target("eager", seed=3, backend=backend, piecewise=piecewise)
    for path, batch in SCHEDULE:
        result = graph.step(batch)
        assert result.path == ("piecewise" if piecewise and path == "eager" else path)
        expected = eager.step(batch)
        assert expected.path == "eager"
        assert_match(result, expected)
    assert_kv_match(graph.state()["kv_cache"], eager.state()["kv_cache"])
    graph.close()
    eager.close()


def test_poisoned_static_buffers_do_not_change_valid_results() -> None:
    graph, eager = (make_target(mode, seed=4, backend="sim") for mode in ("graph", "eager"))
    poison = torch.Generator().manual_seed(0)
    for _, batch in SCHEDULE[1::2]:  # full decode, full decode with adapters, eager mixed
        for tensor in graph.static_buffers().values():
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
            else:  # ids of live blocks and slots among them
                tensor.copy_(torch.randint(-3, 70, tensor.shape, generator=poison))
        assert_match(graph.step(batch), eager.step(batch))
    assert_kv_match(graph.state()["kv_cache"], eager.state()["kv_cache"])


def test_update_weights_in_place_keeps_graphs_and_twins_still_agree() -> None:
    graph, eager = (make_target(mode, seed=5, backend="sim") for mode in ("graph", "eager"))
    batch = make_batch([1, 1], context=3)
    before = graph.step(batch)
    eager.step(batch)
    captured = graph.executor.graphs
    for twin in (graph, eager):
        twin.update_weights(11)
    assert graph.executor.graphs == captured
    later = make_batch([1, 1], context=4)
    after = graph.step(later)
    assert (after.path, after.graph_key) == ("full", before.graph_key)
    assert_match(after, eager.step(later))
    assert not torch.allclose(after.logits, before.logits)
    stats = graph.executor.stats()
    assert (stats.captures, stats.invalidations) == (1, ())


def test_update_weights_that_move_a_weight_drops_the_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    graph, eager = (make_target(mode, seed=5, backend="sim") for mode in ("graph", "eager"))
    batch = make_batch([1, 1], context=3)
    graph.step(batch)
    eager.step(batch)
    for twin in (graph, eager):
        decoder = twin.decoder

        def rebound(seed: int, decoder: Decoder = decoder) -> None:
            fresh = Decoder(decoder.config, seed=seed, device=decoder.device)
            decoder._weights["lm_head"] = fresh.weights()["lm_head"]

        monkeypatch.setattr(decoder, "load_weights", rebound)
        twin.update_weights(11)
    assert graph.executor.graphs == ()
    assert graph.executor.stats().invalidations == ("weights replaced by seed 11 moved: lm_head",)
    later = make_batch([1, 1], context=4)
    # Recaptured, the graph reads the new lm_head; the old graph would have read the old one.
    after = graph.step(later)
    assert after.path == "full"
    assert_match(after, eager.step(later))


def test_eager_twin_never_captures() -> None:
    eager = make_target("eager", seed=0, backend="sim")
    result = eager.step(make_batch([1]))
    assert (result.path, result.graph_key) == ("eager", None)
    assert eager.executor.stats().captures == 0
    assert eager.address_views() == []


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="mode='replay'"):
        make_target("replay", seed=0, backend="sim")  # type: ignore[arg-type]


def test_more_requests_than_blocks_is_rejected() -> None:
    with pytest.raises(ValueError, match="every request needs a block"):
        make_target("graph", seed=0, backend="sim", max_num_reqs=64)


def test_static_buffers_are_the_executor_inputs() -> None:
    target = make_target("graph", seed=0, backend="sim")
    target.step(Batch(make_batch([1, 1]).requests))
    names = set(target.static_buffers())
    assert names == {
        "token_ids",
        "positions",
        "slot_mapping",
        "query_start",
        "seq_lens",
        "block_tables",
        "adapter_ids",
        "seeds",
        "temperatures",
    }
    assert target.static_buffers()["block_tables"].shape == (32, TINY.max_blocks_per_req)


def test_a_target_dropped_without_close_releases_its_descriptors() -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    make_target("graph", seed=1, backend="sim").step(make_batch([1]))  # first use loads libraries
    gc.collect()
    before = open_fds()
    for _ in range(3):
        make_target("graph", seed=1, backend="sim").step(make_batch([1, 1]))
    gc.collect()
    # At most as many: a descriptor something else in the process held (a finished child's
    # pipe) may close meanwhile, as one did in CI (17 after, 18 before).
    assert open_fds() <= before
