"""The decoder's per-step inputs and how padding rows and padding requests are filled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import Tensor

from pytest_graphmode.contract import Batch, Request, TargetSpec, batch_problems, kv_slot
from pytest_graphmode.runtime.model.config import DecoderConfig

PAD_TOKEN = 0
PAD_POSITION = 0
PAD_SLOT = -1  # the decoder redirects this (and any slot outside the cache) to the null block
PAD_ADAPTER = 0
SEQ_LEN_FILL = 1
"""Sequence length of a padding request: at least one visible key (in the null block), so no
softmax of a padding row normalises over an empty set."""


@dataclass
class DecoderInputs:
    """One step's inputs for `T` token rows and `R` request rows; all on the model's device.

    Rows past the valid tokens/requests are padding: `slot_mapping` -1, `query_start` repeating its
    last valid value, `seq_lens` `SEQ_LEN_FILL`, block tables and adapters 0 (null block, base).
    """

    token_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: Tensor  # [T] int64, KV slot each token writes; -1 for padding
    query_start: Tensor  # [R + 1] int64, cumulative query offsets
    seq_lens: Tensor  # [R] int64, context + query tokens
    block_tables: Tensor  # [R, max_blocks_per_req] int64
    adapter_ids: Tensor  # [R] int64, 0 = base

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    def tensors(self) -> dict[str, Tensor]:
        """Every field by name, e.g. to allocate persistent buffers of the same shapes."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def token_requests(inputs: DecoderInputs) -> Tensor:
    """[T] request row of each token row, found on the device from `query_start`.

    Padding tokens (past the last valid offset) map to the last request row; garbage offsets
    still give a row in range.
    """
    rows = torch.arange(inputs.num_tokens, device=inputs.token_ids.device)
    found = torch.searchsorted(inputs.query_start[1:], rows, right=True)
    return found.clamp(max=inputs.num_reqs - 1)


class InputShape(Protocol):
    """The cache and vocabulary sizes a step's ids must fit (`DecoderConfig` has them)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_blocks_per_req(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_adapters(self) -> int: ...


def input_spec(
    shape: InputShape, *, null_block: int, max_num_reqs: int, max_num_tokens: int
) -> TargetSpec:
    """The contract's view of what inputs of `shape` can hold, to check batches against."""
    features = {"decode", "prefill", "spec_decode", "sampling"}
    if shape.num_adapters:
        features.add("adapters")
    return TargetSpec(
        num_blocks=shape.num_blocks,
        block_size=shape.block_size,
        max_blocks_per_req=shape.max_blocks_per_req,
        vocab_size=shape.vocab_size,
        max_num_reqs=max_num_reqs,
        # Padding requests have no tokens, so inputs may hold more request rows than token rows;
        # a TargetSpec may not. The padded shapes are checked where they are staged.
        max_num_tokens=max(max_num_tokens, max_num_reqs),
        capture_sizes=(),
        features=frozenset(features),
        null_block=null_block,
        num_adapters=shape.num_adapters,
    )


def make_inputs(
    config: DecoderConfig,
    requests: Sequence[Request],
    *,
    device: torch.device | str,
    num_tokens: int | None = None,
    num_reqs: int | None = None,
) -> DecoderInputs:
    """Build a step's inputs, padded to `num_tokens` token rows and `num_reqs` request rows.

    Raises ValueError, before building anything, for a request the decoder cannot run.
    """
    valid_tokens = sum(len(r.tokens) for r in requests)
    num_tokens = valid_tokens if num_tokens is None else num_tokens
    num_reqs = len(requests) if num_reqs is None else num_reqs
    if not requests or num_reqs < len(requests) or num_tokens < valid_tokens:
        raise ValueError(
            f"need at least one request and room for all of them: {len(requests)} requests with "
            f"{valid_tokens} tokens do not fit num_reqs={num_reqs}, num_tokens={num_tokens}"
        )
    spec = input_spec(
        config, null_block=config.null_block, max_num_reqs=num_reqs, max_num_tokens=num_tokens
    )
    problems = batch_problems(Batch(tuple(requests)), spec)
    if problems:
        raise ValueError("; ".join(problems))

    token_ids = [PAD_TOKEN] * num_tokens
    positions = [PAD_POSITION] * num_tokens
    slots = [PAD_SLOT] * num_tokens
    query_start = [0]
    seq_lens = [SEQ_LEN_FILL] * num_reqs
    tables = [[config.null_block] * config.max_blocks_per_req for _ in range(num_reqs)]
    adapters = [PAD_ADAPTER] * num_reqs
    row = 0
    for index, request in enumerate(requests):
        for offset, token in enumerate(request.tokens):
            position = request.context_len + offset
            token_ids[row] = token
            positions[row] = position
            slots[row] = kv_slot(request.block_ids, position, config.block_size)
            row += 1
        query_start.append(row)
        seq_lens[index] = request.seq_len
        tables[index][: len(request.block_ids)] = request.block_ids
        adapters[index] = request.adapter
    query_start += [row] * (num_reqs - len(requests))

    def tensor(values: list[int] | list[list[int]]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return DecoderInputs(
        token_ids=tensor(token_ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        query_start=tensor(query_start),
        seq_lens=tensor(seq_lens),
        block_tables=tensor(tables),
        adapter_ids=tensor(adapters),
    )
