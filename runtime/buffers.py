"""Persistent input buffers: one set at maximum shape, shared by every graph.

Every static input lives in ONE packed device buffer; a step is staged into ONE pinned host buffer
of the same layout and moved by ONE non_blocking copy. An event recorded after that copy is waited
on before the host buffer is written again: without it the next step could overwrite the host
buffer while the previous copy is still queued, and the graph would read a mix of two steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytest_graphmode.contract import Batch, batch_problems
from pytest_graphmode.runtime.backends import Backend
from pytest_graphmode.runtime.model import DecoderInputs, input_spec
from pytest_graphmode.runtime.padding import HostRows, PaddingPolicy, host_rows

_MAX_PROBLEMS = 8  # a rejected batch lists this many problems, enough to act on without a flood


@dataclass(frozen=True, slots=True)
class InputLimits:
    """The maximum shape of the static inputs and the ranges valid ids must fall in."""

    max_num_reqs: int
    max_num_tokens: int
    max_blocks_per_req: int
    num_blocks: int
    block_size: int
    vocab_size: int
    num_adapters: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_reqs", "max_num_tokens", "max_blocks_per_req", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"InputLimits.{name}={getattr(self, name)} must be >= 1")
        if self.block_size < 1 or self.vocab_size < 1 or self.num_adapters < 0:
            raise ValueError(
                f"InputLimits needs block_size >= 1, vocab_size >= 1, num_adapters >= 0; got "
                f"{self.block_size}, {self.vocab_size}, {self.num_adapters}"
            )


@dataclass(frozen=True, slots=True)
class SamplingInputs:
    """Per-request sampling inputs; `positions` is where the sampled token goes (= seq_lens)."""

    seeds: torch.Tensor  # [R] int64, -1 = greedy
    temperatures: torch.Tensor  # [R] float32
    positions: torch.Tensor  # [R] int64


class StaticInputs:
    """The persistent inputs at maximum shape; graphs read prefixes of them through `views`."""

    def __init__(self, limits: InputLimits, policy: PaddingPolicy, backend: Backend) -> None:
        if not 0 <= policy.null_block < limits.num_blocks:
            raise ValueError(f"null_block={policy.null_block} outside [0, {limits.num_blocks})")
        self.limits = limits
        self.policy = policy
        self._spec = input_spec(
            limits,
            null_block=policy.null_block,
            max_num_reqs=limits.max_num_reqs,
            max_num_tokens=limits.max_num_tokens,
        )
        reqs, tokens, blocks = limits.max_num_reqs, limits.max_num_tokens, limits.max_blocks_per_req
        # int64 words per field; temperatures are float32, two to a word.
        lengths = {
            "token_ids": tokens,
            "positions": tokens,
            "slot_mapping": tokens,
            "query_start": reqs + 1,
            "seq_lens": reqs,
            "block_tables": reqs * blocks,
            "adapter_ids": reqs,
            "seeds": reqs,
            "temperatures": (reqs + 1) // 2,
        }
        total = sum(lengths.values())
        self._host = backend.empty_pinned(total, dtype=torch.int64)
        self._device = torch.zeros(total, dtype=torch.int64, device=backend.device)
        self._host_fields = _split(self._host, lengths, reqs, blocks)
        # Where each integer field starts in the packed host buffer, for `_write_host`.
        self._host_offsets = {
            name: self._host_fields[name].storage_offset() for name in _INT_FIELDS
        }
        self._device_fields = _split(self._device, lengths, reqs, blocks)
        self._copied = backend.Event()
        self._copy_pending = False
        self.stage(Batch(()), reqs, tokens)  # every row of every field starts as padding

    @property
    def nbytes(self) -> int:
        return self._device.numel() * self._device.element_size()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every static input at maximum shape (views of the one device buffer)."""
        return dict(self._device_fields)

    def check(self, batch: Batch) -> None:
        """Raise ValueError listing every reason `batch` is not a step these inputs can hold."""
        _reject(batch_problems(batch, self._spec))

    def stage(self, batch: Batch, padded_reqs: int, padded_tokens: int) -> None:
        """Validate `batch`, then write it and its padding rows; raises ValueError, writing
        nothing, when the batch is bad. An empty batch stages padding only (used for capture)."""
        problems = batch_problems(batch, self._spec) if batch.requests else []
        limits = self.limits
        if not problems and not batch.num_reqs <= padded_reqs <= limits.max_num_reqs:
            problems.append(
                f"padded_reqs={padded_reqs} must lie in [{batch.num_reqs} requests in the "
                f"batch, max_num_reqs={limits.max_num_reqs}]"
            )
        if not problems and not batch.num_tokens <= padded_tokens <= limits.max_num_tokens:
            problems.append(
                f"padded_tokens={padded_tokens} must lie in [{batch.num_tokens} tokens in the "
                f"batch, max_num_tokens={limits.max_num_tokens}]"
            )
        _reject(problems)
        rows = host_rows(
            batch,
            padded_reqs,
            padded_tokens,
            block_size=self.limits.block_size,
            max_blocks_per_req=self.limits.max_blocks_per_req,
            policy=self.policy,
        )
        if self._copy_pending:
            self._copied.synchronize()
        self._write_host(rows)
        # The whole buffer, whatever the step's shape: one copy of a fixed size, where copying
        # only the used prefix of each field would take one copy per field.
        self._device.copy_(self._host, non_blocking=True)
        self._copied.record()
        self._copy_pending = True

    def _write_host(self, rows: HostRows) -> None:
        # Every integer field's rows in one indexed write: a step costs a fixed number of tensor
        # operations, not a few per field (on the sim every operation costs as much as a small
        # kernel launch does on a GPU).
        index: list[int] = []
        values: list[int] = []
        for name in _INT_FIELDS:
            field_values: list[int] = getattr(rows, name)
            start = self._host_offsets[name]
            index.extend(range(start, start + len(field_values)))
            values.extend(field_values)
        self._host.index_copy_(
            0, torch.tensor(index, dtype=torch.int64), torch.tensor(values, dtype=torch.int64)
        )
        temperatures = self._host_fields["temperatures"]
        temperatures[: len(rows.temperatures)].copy_(
            torch.tensor(rows.temperatures, dtype=torch.float32)
        )

    def views(self, padded_reqs: int, padded_tokens: int) -> DecoderInputs:
        """The decoder's inputs for a `padded_reqs` x `padded_tokens` step (fixed addresses)."""
        f = self._device_fields
        return DecoderInputs(
            token_ids=f["token_ids"][:padded_tokens],
            positions=f["positions"][:padded_tokens],
            slot_mapping=f["slot_mapping"][:padded_tokens],
            query_start=f["query_start"][: padded_reqs + 1],
            seq_lens=f["seq_lens"][:padded_reqs],
            block_tables=f["block_tables"][:padded_reqs],
            adapter_ids=f["adapter_ids"][:padded_reqs],
        )

    def sampling_views(self, padded_reqs: int) -> SamplingInputs:
        f = self._device_fields
        return SamplingInputs(
            seeds=f["seeds"][:padded_reqs],
            temperatures=f["temperatures"][:padded_reqs],
            positions=f["seq_lens"][:padded_reqs],
        )


def _reject(problems: list[str]) -> None:
    if problems:
        shown = "; ".join(problems[:_MAX_PROBLEMS])
        more = len(problems) - _MAX_PROBLEMS
        suffix = f"; and {more} more" if more > 0 else ""
        raise ValueError(f"rejected batch, nothing was staged: {shown}{suffix}")


_INT_FIELDS = (
    "token_ids",
    "positions",
    "slot_mapping",
    "query_start",
    "seq_lens",
    "block_tables",
    "adapter_ids",
    "seeds",
)


def _split(
    packed: torch.Tensor, lengths: dict[str, int], reqs: int, blocks: int
) -> dict[str, torch.Tensor]:
    fields: dict[str, torch.Tensor] = {}
    offset = 0
    for name, length in lengths.items():
        words = packed[offset : offset + length]
        offset += length
        if name == "block_tables":
            fields[name] = words.view(reqs, blocks)  # [max_reqs, max_blocks_per_req]
        elif name == "temperatures":
            fields[name] = words.view(torch.float32)[:reqs]
        else:
            fields[name] = words
    return fields
