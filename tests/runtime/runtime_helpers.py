"""Shared by the runtime tests: small legal batches for the tiny decoder, and twin comparisons."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pytest_graphmode import Batch, Request, StepResult
from pytest_graphmode.runtime.model import DecoderConfig

TINY = DecoderConfig.tiny()


def make_batch(
    query_lens: Sequence[int],
    *,
    context: int = 5,
    seeds: Sequence[int | None] | None = None,
    adapters: Sequence[int] | None = None,
    first_block: int = 1,
    config: DecoderConfig = TINY,
) -> Batch:
    """Requests with disjoint blocks (request i owns a run of blocks starting after request i-1's)
    and tokens that differ per request and position."""
    requests = []
    block = first_block
    for row, q in enumerate(query_lens):
        needed = math.ceil((context + q) / config.block_size)
        requests.append(
            Request(
                req_id=100 + row,
                tokens=tuple((31 * row + 7 * j + context) % config.vocab_size for j in range(q)),
                context_len=context,
                block_ids=tuple(range(block, block + needed)),
                seed=None if seeds is None else seeds[row],
                adapter=0 if adapters is None else adapters[row],
            )
        )
        block += needed
    return Batch(tuple(requests))


def assert_match(graph: StepResult, eager: StepResult) -> None:
    """Graph twin == eager twin: logits up to rounding (padded and unpadded shapes may run
    different GEMM kernels), next tokens exactly."""
    # CPU kernels (the sim device's storage is host memory) are tighter than GPU ones
    on_cpu = graph.logits.untyped_storage().device.type == "cpu"
    tolerance = 1e-5 if on_cpu else 1e-4
    torch.testing.assert_close(graph.logits, eager.logits, atol=tolerance, rtol=tolerance)
    assert torch.equal(graph.next_tokens.cpu(), eager.next_tokens.cpu())


def assert_kv_match(graph_kv: torch.Tensor, eager_kv: torch.Tensor) -> None:
    """Equal everywhere but the null block, which only the graph twin's padding rows write."""
    skip = TINY.block_size * (TINY.null_block + 1)
    torch.testing.assert_close(graph_kv[skip:], eager_kv[skip:], atol=1e-4, rtol=1e-4)
