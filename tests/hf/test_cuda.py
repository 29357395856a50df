"""On a GPU: transformers captures and replays its own CUDA graphs, and they match its eager run."""

import pytest
import torch

from pytest_graphmode.contract import Batch, Request
from pytest_graphmode.hf.target import ENGINES, make_target
from pytest_graphmode.hf.versions import installed_layout, support_problem

pytest.importorskip("transformers")
if (problem := support_problem()) is not None:
    pytest.skip(problem, allow_module_level=True)
pytestmark = pytest.mark.graphmode_cuda

PROMPTS = (
    Request(1, (5, 9, 17, 3, 44, 12, 90, 7, 61, 2), 0, (5, 2)),
    Request(2, (8, 8, 8), 0, (9,)),
)


def test_graph_twin_replays_its_captured_graph_and_matches_the_eager_twin() -> None:
    graph, eager = (make_target(mode, seed=0, backend="cuda") for mode in ("graph", "eager"))
    batch = Batch(PROMPTS)
    results = []
    for _ in range(4):
        replayed, expected = graph.step(batch), eager.step(batch)
        torch.testing.assert_close(replayed.logits, expected.logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(replayed.next_tokens, expected.next_tokens)
        results.append(replayed)
        batch = Batch(
            tuple(
                Request(r.req_id, (int(t),), r.seq_len, r.block_ids)
                for r, t in zip(batch.requests, replayed.next_tokens, strict=True)
            )
        )
    # Every slot but the null block's (padding's sink, wherever the installed layout puts it).
    kept = torch.ones(graph.spec.num_slots, dtype=torch.bool, device=graph.engine.model.device)
    null = graph.spec.null_block * graph.spec.block_size
    kept[null : null + graph.spec.block_size] = False
    for name, tensor in graph.state().items():
        torch.testing.assert_close(tensor[kept], eager.state()[name][kept], msg=name)
    assert type(graph.engine) is ENGINES[installed_layout()]
    graph.close()
    eager.close()
    # The prefill (13 query tokens, padded to 16) captures the graph its decodes (2, padded to 16)
    # replay: the capture step reports transformers' eager results, the rest the graph's key.
    assert results[0].path == "eager" and "captured the graph keyed" in (results[0].reason or "")
    assert [r.path for r in results[1:]] == ["full"] * 3
    assert len({r.graph_key for r in results[1:]}) == 1
