"""The harness as scheduler: block allocation and request lifecycles.

`BlockScheduler.compile` turns an abstract `StepPlan` into a concrete `Batch` that is legal for the
target's `TargetSpec`: every request's `block_ids` cover exactly `context_len + len(tokens)`
positions, no block belongs to two requests, the null block is never handed out, and the spec's
limits (`max_num_reqs`, `max_num_tokens`, `max_blocks_per_req`, `num_blocks`, `vocab_size`) hold.
Freed blocks go on top of a stack, so the next allocation reuses them while they are still warm
with another request's KV: stale indices then point at live data, which is what makes padding
and stale-buffer bugs visible.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from pytest_graphmode.contract import Batch, Request, TargetSpec
from pytest_graphmode.strategies.plans import Arrival, StepPlan, Stress


class BlockAllocator:
    """Free-block stack over every block but the null block; last freed is first reused."""

    def __init__(self, spec: TargetSpec, rng: random.Random) -> None:
        free = [b for b in range(spec.num_blocks) if b != spec.null_block]
        rng.shuffle(free)  # fragmented from the start: no request gets contiguous blocks by luck
        self._free = free
        self._null = spec.null_block

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks, or None (and nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if block == self._null or block in self._free:
                raise ValueError(f"block {block} freed twice or is the null block")
            self._free.append(block)


@dataclass
class _Live:
    req_id: int
    tokens: list[int]  # every token known so far; the first `computed` are in the KV cache
    computed: int
    block_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    temperature: float = 1.0
    adapter: int = 0

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed

    @property
    def decoding(self) -> bool:
        return self.computed > 0 and self.pending == 1


@dataclass(frozen=True)
class _Row:
    live: _Live
    query_len: int
    spec_drafts: int


class BlockScheduler:
    """Owns the requests and blocks of one schedule; deterministic for a given seed."""

    def __init__(self, spec: TargetSpec, seed: int = 0) -> None:
        self.spec = spec
        self._rng = random.Random(seed)
        self.allocator = BlockAllocator(spec, self._rng)
        self.live: list[_Live] = []
        self._next_id = 0
        usable = min(spec.max_blocks_per_req, spec.num_blocks - 1)
        self.capacity = usable * spec.block_size  # positions one request may ever hold

    def compile(self, plan: StepPlan) -> Batch:
        """Apply the plan's lifecycle events, form its batch and advance the requests."""
        for index in plan.finish:
            if self.live:
                self._retire(self.live[index % len(self.live)])
        for index in plan.preempt:
            if self.live:
                victim = self.live[index % len(self.live)]
                self.allocator.free(victim.block_ids)
                victim.block_ids, victim.computed = [], 0
        for arrival in plan.arrivals:
            if len(self.live) < 2 * self.spec.max_num_reqs:
                self._admit(arrival)
        if not self.live:
            self._admit(Arrival(prompt_len=1))
        rows = self._select(plan)
        if not rows:
            rows = self._make_room(plan)
        batch = Batch(tuple(self._request(row) for row in rows))
        for row in rows:
            self._advance(row, plan)
        return batch

    def _admit(self, arrival: Arrival) -> None:
        features = self.spec.features
        if arrival.seed is not None and "sampling" not in features:
            raise ValueError("Arrival.seed needs the 'sampling' feature in the TargetSpec")
        if arrival.adapter and "adapters" not in features:
            raise ValueError("Arrival.adapter needs the 'adapters' feature in the TargetSpec")
        length = min(arrival.prompt_len, self.capacity)
        tokens = [self._token() for _ in range(length)]
        live = _Live(
            self._next_id, tokens, 0, [], arrival.seed, arrival.temperature, arrival.adapter
        )
        self._next_id += 1
        self.live.append(live)

    def _select(self, plan: StepPlan) -> list[_Row]:
        shift = plan.rotate % len(self.live)
        order = self.live[shift:] + self.live[:shift]
        wanted = {
            "decode": [r for r in order if r.decoding],
            "spec": [r for r in order if r.decoding],
            "prefill": [r for r in order if not r.decoding],
            "mixed": order,
        }[plan.kind] or order
        rows: list[_Row] = []
        budget = self.spec.max_num_tokens
        limit = min(plan.rows, self.spec.max_num_reqs)
        for live in wanted:
            if len(rows) == limit or budget == 0:
                break
            row = self._shape(live, plan, budget, len(rows))
            if self._reserve(live, live.computed + row.query_len):
                rows.append(row)
                budget -= row.query_len
        return rows

    def _shape(self, live: _Live, plan: StepPlan, budget: int, index: int) -> _Row:
        """The query of `live` as the step's row `index`, within the step's token `budget`."""
        if live.decoding:
            drafts = 0
            if plan.kind == "spec" and "spec_decode" in self.spec.features:
                drafts = plan.spec_k
                if plan.uneven:
                    drafts = (plan.spec_k - index - plan.rotate) % (plan.spec_k + 1)
                drafts = max(0, min(drafts, self.capacity - len(live.tokens), budget - 1))
            return _Row(live, 1 + drafts, drafts)
        chunk = plan.chunk if "prefill" in self.spec.features else 1
        return _Row(live, max(1, min(live.pending, chunk, budget)), 0)

    def _reserve(self, live: _Live, positions: int) -> bool:
        """Make `live.block_ids` cover exactly `positions`; False if blocks ran out."""
        needed = -(-positions // self.spec.block_size)
        if needed < len(live.block_ids):
            self.allocator.free(live.block_ids[needed:])
            del live.block_ids[needed:]
        extra = self.allocator.allocate(needed - len(live.block_ids))
        if extra is None:
            return False
        live.block_ids.extend(extra)
        return True

    def _make_room(self, plan: StepPlan) -> list[_Row]:
        """Every block is taken: preempt all but one request so that one can run."""
        keeper = self.live[plan.rotate % len(self.live)]
        for other in self.live:
            if other is not keeper:
                self.allocator.free(other.block_ids)
                other.block_ids, other.computed = [], 0
        row = self._shape(keeper, plan, self.spec.max_num_tokens, 0)
        if not self._reserve(keeper, keeper.computed + row.query_len):
            raise RuntimeError("scheduler invariant broken: a lone request does not fit")
        return [row]

    def _request(self, row: _Row) -> Request:
        live = row.live
        live.tokens.extend(self._token() for _ in range(row.spec_drafts))
        return Request(
            req_id=live.req_id,
            tokens=tuple(live.tokens[live.computed : live.computed + row.query_len]),
            context_len=live.computed,
            block_ids=tuple(live.block_ids),
            seed=live.seed,
            temperature=live.temperature,
            adapter=live.adapter,
        )

    def _advance(self, row: _Row, plan: StepPlan) -> None:
        live = row.live
        if row.spec_drafts:
            live.computed += 1 + min(plan.accepted, row.spec_drafts)
            del live.tokens[live.computed :]  # rejected drafts are rewritten by later steps
        else:
            live.computed += row.query_len
        if live.computed >= self.capacity:
            self._retire(live)
        elif live.pending == 0:
            live.tokens.append(self._token())

    def _retire(self, live: _Live) -> None:
        self.allocator.free(live.block_ids)
        self.live.remove(live)

    def _token(self) -> int:
        return self._rng.randrange(self.spec.vocab_size)


def compile_schedule(
    spec: TargetSpec, plans: Sequence[StepPlan], seed: int = 0
) -> list[Batch | Stress]:
    """The concrete event list of a schedule: each step's `Stress` (when active) then its batch."""
    scheduler = BlockScheduler(spec, seed)
    events: list[Batch | Stress] = []
    for plan in plans:
        if plan.stress.active:
            events.append(plan.stress)
        events.append(scheduler.compile(plan))
    return events
