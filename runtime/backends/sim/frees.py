"""Stream-ordered frees: memory the program freed while another stream's queued work still uses it.

On CUDA a block the program frees goes back at once to the caching allocator's pool of the stream
it was allocated on: the next allocation on that stream may be handed it, whatever other streams
still have queued. Work another stream queued on the block before the free then reads (or writes)
the new owner's bytes, unless the program called `tensor.record_stream(other)` before letting go
(the allocator then holds the block until `other`'s work queued up to the free is done) or ordered
the allocating stream after that work (an event wait, `wait_stream`, a synchronize).

The sim's memory comes from the CPU allocator and its queued work holds what it uses, so no block
is ever handed out early. The sim reports the latent bug instead, as a `Race` whose later side is
the allocation: at the first allocation on the stream that allocated the memory, after the program
let go of it, while a use on another stream is neither ordered before that allocation nor covered
by `record_stream`. It reports it whatever the allocation's size (CUDA reuses the block only for an
allocation it fits), as it reports every allocation during a capture. It also overwrites the freed
bytes, as the block's new owner would: queued work that has not run yet reads poison.

To see the program let go of memory that queued work still holds, the sim's queued work holds
aliases (tensors of its own over the same storage), never the program's tensors, and counts them:
the program still holds a storage while torch counts more tensors on it than the queued work's
aliases.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from pytest_graphmode.runtime.backends.footprint import Footprint, Line, format_line, source_line
from pytest_graphmode.runtime.backends.race import Race, RaceSide
from pytest_graphmode.runtime.backends.sim.capture import storage_tensor_count
from pytest_graphmode.runtime.backends.sim.happens_before import RaceChecker, Touch

# Allocations noted on streams other than the default one before those since freed are forgotten
# (a device synchronize forgets them too).
_SIDE = 4096
# Storages watched (used by another stream than their own, not yet freed nor passed) before the
# ones every use of which the host has passed are swept.
_WATCHED = 1024


# What `hold` looks into (torch.Tensor's own isinstance check is a Python call).
_TensorBase = torch._C.TensorBase
_NESTED = (_TensorBase, list, tuple, dict)


class _Use:
    __slots__ = ("agent", "epoch", "fp", "line", "op", "write")

    def __init__(
        self, agent: int, epoch: int, fp: Footprint, write: bool, op: str, line: Line
    ) -> None:
        self.agent, self.epoch, self.fp, self.write = agent, epoch, fp, write
        self.op, self.line = op, line


class _Watched:
    """A storage one stream allocated and another used: held (so its address stays its own)
    until the program frees it, or every use is passed."""

    __slots__ = ("allocated_on", "storage", "uses")

    def __init__(self, storage: torch.UntypedStorage, allocated_on: int) -> None:
        self.storage = storage
        self.allocated_on = allocated_on
        self.uses: dict[int, _Use] = {}  # the latest use of each other stream


class StreamOrderedFrees:
    """Allocation streams, other streams' uses, `record_stream` and the program's frees of the
    sim's device memory (module docstring). Agents are the race checker's."""

    def __init__(self, races: RaceChecker, default_agent: int, pinned: set[int]) -> None:
        self._races = races
        self._default_agent = default_agent
        self._pinned = pinned  # the sim's pinned host storages: host memory, never watched
        # Storages allocated on a stream other than the default one (absent: the default stream).
        self._side: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self._side_limit = _SIDE
        self._recorded: dict[int, tuple[weakref.ref[torch.UntypedStorage], set[int]]] = {}
        self._held: dict[int, int] = {}  # the queued work's live aliases, per storage
        self.watched: dict[int, _Watched] = {}

    @property
    def side_allocations(self) -> bool:
        """Whether memory allocated on a stream other than the default one may still live: only
        then can work on the default stream use another stream's memory."""
        return bool(self._side)

    # -- what the program does -------------------------------------------------------------------

    def allocated(self, agent: int, result: Any) -> None:
        """The device tensors in `result` were allocated on `agent`, not the default stream."""
        if len(self._side) >= self._side_limit:
            self._side = {a: e for a, e in self._side.items() if e[0]() is not None}
            self._side_limit = max(_SIDE, 2 * len(self._side))  # many live ones: sweep less often
        for t in result if isinstance(result, tuple | list) else (result,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self._side[storage.data_ptr()] = (weakref.ref(storage), agent)

    def allocated_on(self, storage: torch.UntypedStorage, address: int) -> int:
        side = self._side.get(address)
        if side is not None and side[0]() is storage:
            return side[1]
        return self._default_agent

    def used(self, agent: int, touched: Sequence[Touch], op: str) -> None:
        """An operation issued now on `agent` touches these storages."""
        epoch = self._races.epoch(agent)
        line: Line | None = None
        for storage, fp, write in touched:
            address = fp.storage
            if address in self._pinned:
                continue
            allocated_on = self.allocated_on(storage, address)
            if allocated_on == agent:
                continue
            watched = self.watched.get(address)
            if watched is None or watched.storage is not storage:
                if len(self.watched) >= _WATCHED:
                    self._sweep()
                watched = self.watched[address] = _Watched(storage, allocated_on)
            if line is None:
                line = source_line()
            watched.uses[agent] = _Use(agent, epoch, fp, write, op, line)

    def record_stream(self, t: torch.Tensor, agent: int) -> None:
        """`t.record_stream(stream)`: `agent`'s work queued before the free keeps the block."""
        storage = t.untyped_storage()
        address = storage.data_ptr()
        entry = self._recorded.get(address)
        if entry is None or entry[0]() is not storage:
            if len(self._recorded) >= _WATCHED:
                self._recorded = {a: e for a, e in self._recorded.items() if e[0]() is not None}
            entry = self._recorded[address] = (weakref.ref(storage), set())
        entry[1].add(agent)

    # -- what queued work holds ------------------------------------------------------------------

    def hold(self, what: Any) -> tuple[Any, list[int]]:
        """`what` (arguments in tuples, lists and dicts) with every tensor replaced by an alias,
        and the storages the aliases hold: queued work holds these, and gives them back with
        `release` once it ran. Call it past the sim's modes: an alias is no operation of the
        program."""
        addresses: list[int] = []
        return self._aliased(what, addresses), addresses

    def release(self, addresses: list[int]) -> None:
        """Queued work that held aliases of these storages ran (`hold`)."""
        held = self._held
        for address in addresses:
            left = held.get(address, 0) - 1
            if left > 0:
                held[address] = left
            else:
                held.pop(address, None)

    def _aliased(self, x: Any, addresses: list[int]) -> Any:
        if isinstance(x, _TensorBase):
            alias = x.detach()
            address = alias.untyped_storage().data_ptr()
            self._held[address] = self._held.get(address, 0) + 1
            addresses.append(address)
            return alias
        if isinstance(x, list | tuple):
            return type(x)(
                [self._aliased(i, addresses) if isinstance(i, _NESTED) else i for i in x]
            )
        if isinstance(x, dict):
            return {k: self._aliased(v, addresses) for k, v in x.items()} if x else x
        return x

    # -- allocations -----------------------------------------------------------------------------

    def freed_before_allocation(self, agent: int, op: str) -> list[torch.UntypedStorage]:
        """An allocation on `agent` is issued now. Report every storage `agent` allocated that
        the program has freed while another stream's use of it is not ordered before now; return
        them (to be overwritten) and stop watching every freed one."""
        freed_racing = []
        line: Line | None = None
        for address, watched in list(self.watched.items()):
            if watched.allocated_on != agent:
                continue
            unordered = [
                use
                for use in watched.uses.values()
                if not self._races.ordered(use.agent, use.epoch, agent)
                and not self._recorded_for(watched.storage, address, use.agent)
            ]
            if not unordered:  # every use is ordered before any reuse: nothing to watch
                del self.watched[address]
                continue
            if self._program_holds(watched.storage, address):
                continue
            del self.watched[address]
            if line is None:
                line = source_line()
            for use in unordered:
                self._report(watched, use, agent, op, line)
            freed_racing.append(watched.storage)
        return freed_racing

    def host_passed_all(self) -> None:
        """A device synchronize: every use is done."""
        self.watched.clear()
        self._side = {a: e for a, e in self._side.items() if e[0]() is not None}
        self._recorded = {a: e for a, e in self._recorded.items() if e[0]() is not None}

    # -- helpers ---------------------------------------------------------------------------------

    def _program_holds(self, storage: torch.UntypedStorage, address: int) -> bool:
        return storage_tensor_count(storage) > self._held.get(address, 0)

    def _recorded_for(self, storage: torch.UntypedStorage, address: int, agent: int) -> bool:
        entry = self._recorded.get(address)
        return entry is not None and entry[0]() is storage and agent in entry[1]

    def _sweep(self) -> None:
        races = self._races
        for address, watched in list(self.watched.items()):
            if all(races.passed(u.agent, u.epoch) for u in watched.uses.values()):
                del self.watched[address]

    def _report(self, watched: _Watched, use: _Use, agent: int, op: str, line: Line) -> None:
        races = self._races
        fp = use.fp
        earlier = RaceSide(
            use.op, races.name(use.agent), format_line(use.line), "write" if use.write else "read"
        )
        later = RaceSide(
            f"{op} (an allocation: it may be handed the freed block)",
            races.name(agent),
            format_line(line),
            "write",
        )
        races.report(
            Race(
                fp.describe(),
                fp.storage,
                (fp.lo, fp.hi),
                earlier,
                later,
                cause=(
                    f"the program freed memory allocated on {races.name(agent)} without "
                    f"record_stream({races.name(use.agent)}) nor an event wait, wait_stream or "
                    "synchronize ordering the freeing stream after that use: the caching "
                    "allocator hands a freed block to the next allocation of its stream at once"
                ),
            )
        )
