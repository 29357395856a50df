"""transformers' continuous batching behind the contract, on sim: its own graphs captured and replayed
by the sim through the drop-in."""

from collections.abc import Iterator

import pytest
import torch

from pytest_graphmode.contract import Batch, Request, kv_slot
from pytest_graphmode.fuzz import GraphmodeFailure, run_campaign
from pytest_graphmode.fuzz.checks import REPLAY_MATCHES_EAGER
from pytest_graphmode.fuzz.race_check import NO_STREAM_RACES
from pytest_graphmode.hf.engine import EngineConfig, llama
from pytest_graphmode.hf.target import HFTarget, make_ordered_target, make_target
from pytest_graphmode.hf.versions import (
    check_version,
    has,
    installed_layout,
    split_trash,
    support_problem,
)
from pytest_graphmode.loader import check_twins
from pytest_graphmode.strategies.stressors import poison_null_block

pytest.importorskip("transformers")
if (problem := support_problem()) is not None:
    pytest.skip(problem, allow_module_level=True)

PROMPT = (5, 9, 17, 3, 44, 12, 90, 7, 61, 2)  # 10 tokens: a block and a bit
BLOCKS = (5, 2)


@pytest.fixture
def target() -> Iterator[HFTarget]:
    made = make_target("eager", seed=3, backend="sim")
    yield made
    made.close()


def greedy(target: HFTarget, steps: int) -> list[int]:
    """Prefill PROMPT, then decode `steps` tokens, each fed back."""
    result = target.step(Batch((Request(1, PROMPT, 0, BLOCKS),)))
    tokens = [int(result.next_tokens[0])]
    for position in range(len(PROMPT), len(PROMPT) + steps):
        request = Request(1, (tokens[-1],), position, BLOCKS)
        tokens.append(int(target.step(Batch((request,))).next_tokens[0]))
    return tokens


def test_tokens_equal_transformers_generate(target: HFTarget) -> None:
    reference = llama(EngineConfig(), seed=3).eval()
    expected = reference.generate(
        torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert greedy(target, 5) == expected[0, len(PROMPT) :].tolist()


def test_prefill_writes_exactly_the_slots_of_its_blocks(target: HFTarget) -> None:
    target.step(Batch((Request(1, PROMPT, 0, BLOCKS),)))
    slots = [kv_slot(BLOCKS, position, target.spec.block_size) for position in range(len(PROMPT))]
    for name, tensor in target.state().items():
        written = tensor.flatten(1).abs().sum(dim=1).nonzero().flatten().tolist()
        assert written == sorted(slots), name


def test_a_decode_writes_one_slot_in_the_second_block(target: HFTarget) -> None:
    target.step(Batch((Request(1, PROMPT, 0, BLOCKS),)))
    before = {name: tensor.clone() for name, tensor in target.state().items()}
    target.step(Batch((Request(1, (4,), len(PROMPT), BLOCKS),)))
    slot = kv_slot(BLOCKS, len(PROMPT), target.spec.block_size)
    for name, tensor in target.state().items():
        changed = (tensor != before[name]).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert changed == [slot], name


def test_state_is_the_engines_cache_with_its_trash_blocks(target: HFTarget) -> None:
    spec, config = target.spec, EngineConfig()
    assert spec.num_blocks == config.num_blocks + 2
    # Up to 5.17 the read and write trash blocks follow the allocatable ones (up to 5.12 they read
    # and write their padding in the second); from 5.18 they are the cache's first two sectors, one
    # block each at these sizes.
    trash = {"continuous_api": (32, 33), "paged_tensors": (32, 33), "sector_cache": (0, 1)}[
        installed_layout()
    ]
    if not split_trash(check_version()):
        trash = (33, 33)
    assert (target.engine.read_trash_block, target.engine.write_trash_block) == trash
    assert spec.null_block == target.engine.write_trash_block
    state = target.state()
    assert len(state) == 2 * config.num_layers
    for tensor, engine_tensor in zip(state.values(), target.engine.kv_tensors(), strict=True):
        assert tensor.shape[0] == spec.num_slots
        assert tensor.data_ptr() == engine_tensor.data_ptr()
        assert not tensor.any()  # the warm-up's writes and the uninitialised memory are gone


def test_a_state_copied_into_another_twin_is_what_its_next_step_reads(target: HFTarget) -> None:
    # The harness restores kept twins and poisons blocks through state(): what it writes there
    # must be what transformers' next step reads.
    target.step(Batch((Request(1, PROMPT, 0, BLOCKS),)))
    decode = Batch((Request(1, (4,), len(PROMPT), BLOCKS),))
    other = make_target("eager", seed=3, backend="sim")
    for name, tensor in other.state().items():
        tensor.copy_(target.state()[name])
    copied, expected = other.step(decode), target.step(decode)
    other.close()
    torch.testing.assert_close(copied.logits, expected.logits, rtol=0, atol=0)


def test_nan_written_into_a_read_block_reaches_the_request(target: HFTarget) -> None:
    target.step(Batch((Request(1, PROMPT, 0, BLOCKS),)))
    first = BLOCKS[0] * target.spec.block_size
    for tensor in target.state().values():
        tensor[first : first + target.spec.block_size].fill_(float("nan"))
    result = target.step(Batch((Request(1, (4,), len(PROMPT), BLOCKS),)))
    assert result.logits.isnan().all()


def test_padding_writes_only_the_nan_null_block_and_valid_results_stay_finite() -> None:
    graph = make_target("graph", seed=3, backend="sim")
    poison_null_block(graph.state(), graph.spec)
    result = graph.step(Batch((Request(1, PROMPT, 0, BLOCKS),)))  # 10 tokens, padded to 16
    null = graph.spec.null_block * graph.spec.block_size
    state = {name: tensor.clone() for name, tensor in graph.state().items()}
    graph.close()
    assert result.logits.isfinite().all()
    for name, tensor in state.items():
        # Every padding token writes one slot of the sink, its first (up to 5.12: its last but
        # one, before the sentinel); the rest keeps the poison.
        written = null + (0 if split_trash(check_version()) else graph.spec.block_size - 2)
        poisoned = [s for s in range(null, null + graph.spec.block_size) if s != written]
        assert tensor[written].isfinite().all(), name
        assert tensor[poisoned].isnan().all(), name


def test_padded_kv_reads_see_the_null_block_only_where_transformers_reads_its_write_trash() -> None:
    # 16 query tokens need no query padding, so no padding token writes the write trash before
    # the padded KV reads: up to 5.12 they read those from the write trash (the null block, NaN
    # here) and the mask does not stop a NaN, which is what a campaign on them reports; from 5.13
    # they read the zeroed read-trash block.
    graph = make_target("graph", seed=3, backend="sim")
    poison_null_block(graph.state(), graph.spec)
    result = graph.step(Batch((Request(1, tuple(range(1, 17)), 0, BLOCKS),)))
    graph.close()
    assert bool(result.logits.isfinite().all()) is split_trash(check_version())


def test_a_batch_of_requests_matches_each_request_alone() -> None:
    company = Batch((Request(1, PROMPT, 0, BLOCKS), Request(2, (8, 8, 8), 0, (9,))))
    alone = Batch((Request(2, (8, 8, 8), 0, (9,)),))
    first, second = (
        make_target("eager", seed=4, backend="sim"),
        make_target("eager", seed=4, backend="sim"),
    )
    together, single = first.step(company), second.step(alone)
    torch.testing.assert_close(together.logits[1], single.logits[0])
    first.close()
    second.close()


def test_the_sim_graph_twin_captures_then_replays_transformers_graph() -> None:
    graph, eager = (
        make_target("graph", seed=0, backend="sim"),
        make_target("eager", seed=0, backend="sim"),
    )
    prefill = Batch((Request(1, PROMPT, 0, BLOCKS),))
    first = graph.step(prefill)
    assert graph.engine.graphs and first.path == "eager"
    assert first.reason is not None and "captured the graph" in first.reason
    token = int(eager.step(prefill).next_tokens[0])
    decode = Batch((Request(1, (token,), len(PROMPT), BLOCKS),))
    replayed, expected = graph.step(decode), eager.step(decode)
    graph.close()
    eager.close()
    assert replayed.path == "full" and replayed.graph_key is not None
    assert torch.equal(replayed.next_tokens, expected.next_tokens)
    torch.testing.assert_close(replayed.logits, expected.logits, rtol=1e-4, atol=1e-4)


def test_the_warm_up_captures_the_largest_graph_before_the_first_step() -> None:
    graph = make_target("graph", seed=0, backend="sim")
    keys = list(graph.engine._graph_store())
    graph.close()
    # Up to 5.4 there is no warm-up: a graph is captured by the first batch of its sizes.
    if not has(check_version(), "warmup"):
        assert keys == []
        return
    # Its varlen graph at the most query tokens, after a cache full but for them.
    config = EngineConfig()
    queries = config.max_batch_tokens
    assert [key[:2] for key in keys] == [(queries, config.max_position - queries)]


def test_making_a_target_leaves_the_global_generator_alone() -> None:
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    make_target("graph", seed=0, backend="sim").close()
    assert torch.equal(torch.rand(4), expected)


def test_update_weights_replaces_the_weights_in_place(target: HFTarget) -> None:
    batch = Batch((Request(1, PROMPT, 0, BLOCKS),))
    other = make_target("eager", seed=9, backend="sim")
    target.update_weights(9)
    torch.testing.assert_close(target.step(batch).logits, other.step(batch).logits)
    other.close()


def test_the_twins_pass_the_loader_checks() -> None:
    check_twins(make_target, seed=0, backend="sim")


def test_a_sim_campaign_finds_transformers_inputs_written_on_another_stream() -> None:
    # From 5.3 transformers' synchronous IO writes its static inputs on the current stream and
    # runs the forward (eager, capture or replay) on its own compute stream, which does not wait
    # for it: the race checker reports the first step (docs/targets-hf.md, "What runs where").
    if not has(check_version(), "compute_stream"):
        pytest.skip("before 5.3 there is no compute stream (tests/hf/test_continuous_api.py)")
    with pytest.raises(GraphmodeFailure) as caught:
        run_campaign(make_target, backend="sim", max_examples=3, max_steps=6, seed=0)
    failure = caught.value.failure
    assert failure.check == NO_STREAM_RACES, failure.message
    assert "continuous_batching/input_outputs.py" in failure.message
    assert "is not ordered before" in failure.message


def test_with_its_streams_ordered_the_sim_campaign_finds_no_race() -> None:
    # The compute stream made to wait for the staging stream: from 5.13, which zeroes its read
    # trash, the campaign passes with transformers' own graphs replaying; up to 5.12 the one
    # thing it may still find is the write-trash NaN (the test above), never a race.
    try:
        stats = run_campaign(
            make_ordered_target, backend="sim", max_examples=12, max_steps=6, seed=0
        )
    except GraphmodeFailure as caught:
        failure = caught.failure
        assert not split_trash(check_version()), failure.message
        assert failure.check == REPLAY_MATCHES_EAGER, failure.message
        assert "nan" in failure.message.lower(), failure.message
        return
    assert stats.failures == []
    assert stats.paths["full"] > 0, stats.paths
