"""Batches for the decoder tests: Hypothesis strategies and helpers that fill the KV cache.

A scenario is a set of full token sequences, each split into a context (already cached) and this
step's query, with its blocks, adapter and the step's padding. `prepare` runs the contexts through
`Decoder.forward` in chunks, starting from a cache full of NaN, so any read of a slot that was never
written shows up in the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from pytest_graphmode import Request
from pytest_graphmode.runtime.model import Decoder, DecoderConfig, DecoderInputs, make_inputs

CONFIG = DecoderConfig.tiny()
KINDS = ("decode", "spec_decode", "prefill", "chunked", "mixed")
ONE_PREFILL = [Request(req_id=0, tokens=(1, 2, 3), context_len=0, block_ids=(1,))]


@dataclass(frozen=True)
class Scenario:
    sequences: tuple[tuple[int, ...], ...]  # context + query tokens of each request
    context_lens: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
    adapters: tuple[int, ...]
    history_chunk: int  # contexts are cached in chunks of this many tokens
    pad_tokens: int
    pad_reqs: int

    @property
    def num_reqs(self) -> int:
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        """Valid query tokens of the step."""
        return sum(len(s) - c for s, c in zip(self.sequences, self.context_lens, strict=True))

    def step_requests(self) -> list[Request]:
        return [
            Request(req_id=i, tokens=seq[ctx:], context_len=ctx, block_ids=blocks, adapter=adapter)
            for i, (seq, ctx, blocks, adapter) in enumerate(
                zip(self.sequences, self.context_lens, self.block_ids, self.adapters, strict=True)
            )
        ]

    def context_slots(self) -> list[int]:
        """Slots holding cached context before the step."""
        return [
            _slot(blocks, position)
            for blocks, ctx in zip(self.block_ids, self.context_lens, strict=True)
            for position in range(ctx)
        ]

    def step_slots(self) -> list[int]:
        """Slots the step's valid tokens write, in token-row order."""
        return [
            _slot(blocks, position)
            for blocks, ctx, seq in zip(
                self.block_ids, self.context_lens, self.sequences, strict=True
            )
            for position in range(ctx, len(seq))
        ]


def _slot(blocks: tuple[int, ...], position: int) -> int:
    return blocks[position // CONFIG.block_size] * CONFIG.block_size + position % CONFIG.block_size


def _split(kind: str, draw: st.DrawFn, spec_len: int) -> tuple[int, int]:
    """(context_len, query_len) of one request of a batch of `kind`."""
    longest = CONFIG.max_seq_len
    if kind == "decode":
        return draw(st.integers(1, longest - 1)), 1
    if kind == "spec_decode":
        return draw(st.integers(1, longest - spec_len)), spec_len
    if kind == "prefill":
        return 0, draw(st.integers(1, 12))
    if kind == "chunked":
        query = draw(st.integers(2, 10))
        return draw(st.integers(1, longest - query)), query
    return _split(draw(st.sampled_from(KINDS[:-1])), draw, spec_len)


@st.composite
def scenarios(
    draw: st.DrawFn, kind: str = "mixed", *, adapters: bool = False, padded: bool = False
) -> Scenario:
    """A step of `kind`; `adapters` draws adapter ids, `padded` at least one padding row of each
    kind (token and request)."""
    num_reqs = draw(st.integers(1, 4))
    spec_len = draw(st.integers(2, 4))
    splits = [_split(kind, draw, spec_len) for _ in range(num_reqs)]
    free = draw(st.permutations([b for b in range(CONFIG.num_blocks) if b != CONFIG.null_block]))
    sequences, block_ids = [], []
    for ctx, query in splits:
        n = ctx + query
        sequences.append(
            tuple(draw(st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=n, max_size=n)))
        )
        needed = -(-n // CONFIG.block_size)
        block_ids.append(tuple(free[:needed]))
        free = free[needed:]
    adapter_ids = st.integers(0, CONFIG.num_adapters) if adapters else st.just(0)
    return Scenario(
        sequences=tuple(sequences),
        context_lens=tuple(ctx for ctx, _ in splits),
        block_ids=tuple(block_ids),
        adapters=tuple(draw(adapter_ids) for _ in range(num_reqs)),
        history_chunk=draw(st.integers(1, 8)),
        pad_tokens=draw(st.integers(int(padded), 4)),
        pad_reqs=draw(st.integers(int(padded), 2)),
    )


def prepare(
    decoder: Decoder,
    scenario: Scenario,
    *,
    use_adapters: bool = False,
    num_tokens: int | None = None,
    num_reqs: int | None = None,
) -> DecoderInputs:
    """Fill the cache with NaN, cache every context through `forward`, return the step's inputs
    (padded as the scenario says unless `num_tokens` / `num_reqs` are given)."""
    decoder.kv_cache.fill_(float("nan"))
    chunk = scenario.history_chunk
    longest = max(scenario.context_lens)
    for start in range(0, longest, chunk):
        history = [
            Request(
                req_id=i,
                tokens=seq[start : min(start + chunk, ctx)],
                context_len=start,
                block_ids=blocks,
                adapter=adapter,
            )
            for i, (seq, ctx, blocks, adapter) in enumerate(
                zip(
                    scenario.sequences,
                    scenario.context_lens,
                    scenario.block_ids,
                    scenario.adapters,
                    strict=True,
                )
            )
            if start < ctx
        ]
        decoder.forward(
            make_inputs(CONFIG, history, device=decoder.device), use_adapters=use_adapters
        )
    return make_inputs(
        CONFIG,
        scenario.step_requests(),
        device=decoder.device,
        num_tokens=scenario.num_tokens + scenario.pad_tokens if num_tokens is None else num_tokens,
        num_reqs=scenario.num_reqs + scenario.pad_reqs if num_reqs is None else num_reqs,
    )


def fresh_decoder(seed: int = 0, device: torch.device | str = "cpu") -> Decoder:
    return Decoder(CONFIG, seed=seed, device=device)
