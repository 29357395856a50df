"""The order of a capture's work as CUDA keeps it: a graph of branches, not one sequence.

CUDA turns a capture into a graph whose nodes depend on one another only through stream order
and the events the capture's streams record and wait on. The branches a capture forks onto side
streams run side by side at every replay. Two things follow, and this module keeps both:
- Two conflicting accesses on two branches that nothing inside the capture orders race at every
  replay, whatever the host does around it. The capture's own happens-before checker (its agents
  are the capture's streams) reports such a race when the capture issues the later access.
- A replay may run the branches in any order the graph allows. The sim runs one order per replay,
  picked by the scheduler's seed (`Branches.linear_extension`), so a join missing inside a graph
  shows up as a wrong value for some seeds, as a join missing between eager streams does.

Until a capture forks a second stream, each operation follows the one before it: no access is
judged, and a graph of one stream replays in recorded order.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections.abc import Sequence
from typing import Any

from pytest_graphmode.runtime.backends.race import Race
from pytest_graphmode.runtime.backends.sim.happens_before import Clock, RaceChecker, Touch

_CAUSE = (
    "both are work of one captured graph: the branches a capture forks onto other streams run "
    "side by side at every replay, and no event wait or wait_stream inside the capture orders "
    "these two"
)
_REUSE_CAUSE = (
    "the program freed a block of the graph's pool while another branch of the capture still "
    "used it, with neither record_stream on that branch's stream nor an event wait or "
    "wait_stream ordering the freeing stream after that use: during a capture the caching "
    "allocator hands a freed block to the next allocation of its stream at once, so at every "
    "replay the new owner's work runs side by side with that use"
)
# Accesses kept per storage: a capture's outputs are blocks of one pool chunk, one storage.
_PER_STORAGE = 1024

EventPoint = tuple[tuple[int, ...], Clock]
"""Where an event was recorded in a capture: the nodes a wait on it follows, and its clock."""


class CaptureOrder:
    """The nodes of one capture in progress, what each must follow, and the races between them.

    A node is one recorded instruction (`Capture._instrs`, same index). The nodes before the
    first fork are all on the origin and all come before the fork, so they form a prefix that
    runs first, in recorded order; nothing is kept for them. After it, a compute node follows the
    node before it on its stream, the nodes its stream waited for since, the last users of a pool
    block it was handed again (in a runner's own pool only), and the views whose results it
    reads. A view node is metadata: it follows only the views it reads, never its stream.

    `per_stream`: the capture's pool hands a freed block only to the stream that allocated it,
    as CUDA's caching allocator does (the sim's own pools); False for a runner's own pool."""

    def __init__(self, *, per_stream: bool) -> None:
        self._per_stream = per_stream
        self._races = RaceChecker(per_storage=_PER_STORAGE)
        self._count = 0  # nodes so far
        self._forked_at: int | None = None  # the first node after the first fork
        # per node from `_forked_at` on: its stream's agent (None for a view), nodes it follows
        self._agents: list[int | None] = []
        self._deps: list[tuple[int, ...]] = []
        self._last: dict[int, int] = {}  # agent -> its last compute node after the fork
        self._waits: dict[int, list[int]] = {}  # agent -> nodes its next compute node follows
        self._view_of: dict[int, int] = {}  # slot -> the view node after the fork computing it
        # storage -> (first byte, end, node) of the compute nodes that touched its bytes (kept
        # for a runner's own pool only: a pool per stream orders no reuse)
        self._users: dict[int, list[tuple[int, int, int]]] = {}

    @property
    def forked(self) -> bool:
        """Whether a second stream has joined the capture."""
        return self._forked_at is not None

    def _agent(self, stream: Any) -> int:
        return self._races.agent(stream)

    def node(self, stream: Any, refs: Sequence[int], view_outs: Sequence[int] | None) -> int:
        """A new instruction issued on `stream` that reads `refs` (slots; needed once forked);
        `view_outs`: the slots it computes, when it is a view."""
        index = self._count
        self._count += 1
        if self._forked_at is None:
            return index
        deps = {self._view_of[r] for r in refs if r in self._view_of}
        if view_outs is not None:
            self._agents.append(None)
            self._deps.append(tuple(deps))
            for slot in view_outs:
                self._view_of[slot] = index
            return index
        agent = self._agent(stream)
        before = self._last.get(agent)
        if before is not None:
            deps.add(before)
        deps.update(self._waits.pop(agent, ()))
        self._agents.append(agent)
        self._deps.append(tuple(deps))
        self._last[agent] = index
        return index

    def touched(self, stream: Any, node: int, touched: list[Touch], op: str) -> None:
        """The accesses of compute `node`: judged against the other branches once forked."""
        if self._forked_at is None:
            return
        agent = self._agent(stream)
        self._races.access(agent, touched, op)
        if not self._per_stream:
            self._used(node, agent, touched)

    def handed_out(self, stream: Any, storage: int, lo: int, hi: int, op: str) -> None:
        """Bytes [lo, hi) of a pool chunk handed to a new tensor of `stream` by `op`. The
        tensors that touched them are gone.

        A pool per stream hands a block back at once to the next allocation of the stream that
        allocated it, as CUDA's caching allocator does in a capture (a block another stream was
        `record_stream`ed on waits for the capture's end, `Capture.recorded_on`): that stream's
        own earlier uses are ordered already, and another branch's use that no wait orders
        before now races with the new owner at every replay. It is reported, and nothing orders
        it at replay either. A runner's own pool may hand a block to any stream: the new owner's
        next compute node follows the block's last users, as if the pool had waited for them."""
        if self._forked_at is None:
            return
        if self._per_stream:
            allocation = f"{op} (an allocation handed the freed block)"
            agent = self._agent(stream)
            self._races.handed_again(storage, lo, hi, agent, allocation, _REUSE_CAUSE)
            return
        self._races.forget(storage, lo, hi)
        users = self._users.get(storage)
        if not users:
            return
        last, kept = [], []
        for use in users:
            use_lo, use_hi, node = use
            if use_lo < hi and lo < use_hi:
                last.append(node)
                if lo <= use_lo and use_hi <= hi:
                    continue  # wholly reused: the next owner's node stands for it from now on
            kept.append(use)
        self._users[storage] = kept
        self._waits.setdefault(self._agent(stream), []).extend(last)

    def _used(self, node: int, agent: int, touched: list[Touch]) -> None:
        """Remember which bytes compute `node` touched, for a later reuse of them. An earlier
        use by the same stream within the same bytes is dropped: `node` follows it."""
        agents, first = self._agents, self._forked_at or 0
        for _, fp, _ in touched:
            users = self._users.setdefault(fp.storage, [])
            users[:] = [
                u
                for u in users
                if not (fp.lo <= u[0] and u[1] <= fp.hi and agents[u[2] - first] == agent)
            ]
            users.append((fp.lo, fp.hi, node))

    def recorded(self, stream: Any) -> EventPoint:
        """An event recorded on `stream` inside the capture: the nodes a wait on it follows (the
        stream's last node and what it waited for since), and its clock."""
        agent = self._agent(stream)
        last = self._last.get(agent)
        nodes = tuple(self._waits.get(agent, ())) + (() if last is None else (last,))
        return nodes, self._races.record(agent)

    def waited(self, stream: Any, point: EventPoint, forks: bool) -> None:
        """`stream` waits on an event recorded inside the capture; `forks`: it joins the capture
        by this wait."""
        if forks and self._forked_at is None:
            self._forked_at = self._count
        nodes, clock = point
        agent = self._agent(stream)
        self._races.wait(agent, clock)
        if nodes:
            self._waits.setdefault(agent, []).extend(nodes)

    def take_races(self) -> list[Race]:
        """The races found inside the capture so far, each saying why nothing orders it."""
        return [
            race if race.cause else dataclasses.replace(race, cause=_CAUSE)
            for race in self._races.take()
        ]

    def branches(self, kept: Sequence[int]) -> Branches | None:
        """The order of the instructions a finished program keeps (`kept`: their old indices,
        in order), or None when the capture never forked: they then run in recorded order."""
        forked_at = self._forked_at
        if forked_at is None:
            return None
        new_index = {old: new for new, old in enumerate(kept)}
        agents: list[int | None] = []
        deps: list[tuple[int, ...]] = []
        prefix_last: tuple[int, ...] = ()  # the prefix's last kept node: it ran all before it
        for new, old in enumerate(kept):
            if old < forked_at:
                agents.append(None)
                deps.append(prefix_last)
                prefix_last = (new,)
                continue
            at = old - forked_at
            agents.append(self._agents[at])
            # A dropped instruction is a view computed once, at capture end: nothing waits for it.
            after = {new_index[d] for d in self._deps[at] if d in new_index and d >= forked_at}
            deps.append(tuple(after.union(prefix_last)))
        return Branches(agents, deps)


class Branches:
    """The partial order of a forked program's instructions, and the orders a replay may run."""

    def __init__(self, agents: list[int | None], deps: list[tuple[int, ...]]) -> None:
        self._agents = agents
        self._streams = sorted({a for a in agents if a is not None})
        self._indegree = [len(d) for d in deps]
        self._after: list[list[int]] = [[] for _ in agents]
        for node, before in enumerate(deps):
            for d in before:
                self._after[d].append(node)

    def linear_extension(self, rng: random.Random) -> list[int]:
        """One order of all instructions that keeps every dependency, drawn from `rng`.

        Half the draws rank the streams and run the highest-ranked ready branch as far as it
        goes, the extremes where one branch finishes before another starts, which is where a
        missing join between them shows; the other half pick each next instruction at random.
        Views run as soon as they may: they are metadata, not device work."""
        by_stream = rng.random() < 0.5
        rank = {agent: rng.random() for agent in self._streams}
        indegree = list(self._indegree)
        after = self._after
        agents = self._agents

        def key(node: int) -> float:
            agent = agents[node]
            if agent is None:
                return -1.0
            return rank[agent] if by_stream else rng.random()

        ready = [(key(n), n) for n, d in enumerate(indegree) if d == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, node = heapq.heappop(ready)
            order.append(node)
            for nxt in after[node]:
                indegree[nxt] -= 1
                if indegree[nxt] == 0:
                    heapq.heappush(ready, (key(nxt), nxt))
        return order  # every node: a node's dependencies are all nodes issued before it
