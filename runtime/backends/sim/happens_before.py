"""Happens-before race detection: two conflicting accesses that no synchronization orders.

Every operation runs on an agent: a stream (the current one when it was issued; a graph replay on
the stream it was launched on) or the host (operations whose tensors are all pinned host memory,
host reads). Each agent has a vector clock. Program order, event record / wait (and `wait_stream`,
which is both) and the host's synchronizations (stream, event and device synchronize, host reads
that wait for a stream, a query that answers done) are its edges; the host also orders everything it
did before it issues an operation, so an operation's clock is its stream's joined with the host's.

Accesses are judged when they are issued, in program order, not when the scheduler runs them: a race
is reported at its first occurrence whatever order the scheduler picks. Two accesses conflict when
they share a byte of one storage and one writes; a conflict the clocks do not order is a race.

An access the host has passed (the host synchronized with it) is ordered before everything issued
later, so it is dropped: the history holds only work the host has not waited for, and a device
synchronize empties it. A history is keyed by storage address and holds a weak reference to its
storage: memory freed and allocated again starts a new history (see docs/backends.md for what that
and the other limits mean).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pytest_graphmode.runtime.backends.footprint import (
    Footprint,
    Line,
    format_line,
    overlap,
    source_line,
)
from pytest_graphmode.runtime.backends.race import Race, RaceSide

HOST = -1
"""The agent id of the host; streams use their `stream_id`."""

Clock = dict[int, int]
Touch = tuple[torch.UntypedStorage, Footprint, bool]
"""A storage, the bytes of it an operation touches, and whether it writes them."""
_LoggedTouch = tuple[weakref.ref[torch.UntypedStorage], Footprint, bool]

# Accesses kept per storage before the oldest is forgotten (a race with it would be missed).
_PER_STORAGE = 64
# Storages with a history before the histories of freed or passed memory are swept.
_STORAGES = 4096
# Races kept between two `take()` calls (the first ones: later ones usually repeat them).
_KEPT = 32


class _Access:
    __slots__ = ("agent", "epoch", "fp", "line", "op", "watch", "write")

    def __init__(
        self, fp: Footprint, write: bool, agent: int, epoch: int, op: str, line: Line
    ) -> None:
        self.fp, self.write, self.agent, self.epoch = fp, write, agent, epoch
        self.op, self.line = op, line
        self.watch: _Watch | None = None


class _History:
    __slots__ = ("accesses", "ref")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.ref = weakref.ref(storage)
        self.accesses: list[_Access] = []


@dataclass(eq=False)
class _Watch:
    """Pinned bytes a queued device read was issued on, as they were then: host writes through a
    numpy view bypass the dispatcher, so a change before the host synchronized with the read is
    the only trace they leave."""

    access: _Access
    storage: torch.UntypedStorage
    snapshot: bytes

    def bytes_now(self) -> bytes:
        """The watched bytes, read without a torch operation (sim memory is host memory)."""
        fp = self.access.fp
        return ctypes.string_at(self.storage.data_ptr() + fp.lo, fp.hi - fp.lo)


class RaceChecker:
    """The clocks and access histories of one sim backend; `take()` hands over what it found."""

    def __init__(self, per_storage: int = _PER_STORAGE) -> None:
        """`per_storage`: accesses kept per storage before the oldest is forgotten."""
        self._per_storage = per_storage
        self._clocks: dict[int, Clock] = {HOST: {HOST: 0}}
        self._streams: dict[int, weakref.ref[Any]] = {}
        self._names: dict[int, str] = {HOST: "the host"}
        self._history: dict[int, _History] = {}
        self._watches: list[_Watch] = []
        self._found: list[Race] = []
        self._seen: set[tuple[str, str, str, str]] = set()
        # Agents with accesses the host has not passed; while there is at most one, its accesses
        # are logged, not recorded (`access`).
        self._pending: set[int] = set()
        self._log_agent = HOST
        self._log: list[tuple[int, str, Line, list[_LoggedTouch]]] = []

    def take(self) -> list[Race]:
        """The races found since the last call, first found first; forgets them."""
        found, self._found = self._found, []
        self._seen.clear()
        return found

    # -- agents and clocks ------------------------------------------------------------------------

    def agent(self, stream: Any) -> int:
        """The agent id of a sim stream (registered on first use)."""
        sid: int = stream.stream_id
        if sid not in self._clocks:
            self._clocks[sid] = {}
            self._streams[sid] = weakref.ref(stream)
            self._names[sid] = "the default stream" if stream.is_default else f"stream #{sid}"
        return sid

    def record(self, agent: int) -> Clock:
        """The clock an event recorded now on `agent` carries."""
        clock = dict(self._clocks[HOST])
        _join(clock, self._clocks[agent])
        return clock

    def wait(self, agent: int, clock: Clock) -> None:
        """`agent` waits for an event that carries `clock`."""
        _join(self._clocks[agent], clock)

    def host_waits(self, clock: Clock) -> None:
        """The host waited for an event (or a stream) that carries `clock`."""
        host = self._clocks[HOST]
        _join(host, clock)
        self._pending = {a for a in self._pending if host.get(a, 0) < self._clocks[a].get(a, 0)}
        if self._log_agent not in self._pending:
            self._log.clear()
        self._check_passed_watches()

    def host_waits_for(self, agent: int) -> None:
        """The host waited for everything issued so far on `agent`."""
        self.host_waits(self._clocks[agent])

    def host_waits_for_all(self) -> None:
        """A device synchronize: the host has passed every access, so every history empties."""
        host = self._clocks[HOST]
        for sid in list(self._streams):
            _join(host, self._clocks[sid])
        self._pending.clear()
        self._log.clear()
        self._check_passed_watches()
        self._history.clear()
        for sid, ref in list(self._streams.items()):
            if ref() is None:  # a dead stream issues nothing more: forget it everywhere
                del self._streams[sid], self._clocks[sid], self._names[sid]
                for clock in self._clocks.values():
                    clock.pop(sid, None)

    def epoch(self, agent: int) -> int:
        """The epoch of `agent`'s latest operation."""
        return self._clocks[agent].get(agent, 0)

    def ordered(self, earlier: int, epoch: int, agent: int) -> bool:
        """Whether `earlier`'s operation of `epoch` is ordered before what `agent` issues now."""
        return self._clocks[agent].get(earlier, 0) >= epoch or self.passed(earlier, epoch)

    def passed(self, agent: int, epoch: int) -> bool:
        """Whether the host has waited for `agent`'s operation of `epoch`."""
        return self._clocks[HOST].get(agent, 0) >= epoch

    def name(self, agent: int) -> str:
        return self._names.get(agent, f"stream #{agent}")

    def report(self, race: Race) -> bool:
        """Keep `race` for `take()`, unless its pair of lines was reported already or enough
        races are kept: whether it was kept. Also for races found outside the access histories
        (a stream-ordered free, frees.py)."""
        if not self._first(race.earlier, race.later):
            return False
        self._found.append(race)
        return True

    def _first(self, earlier: RaceSide, later: RaceSide) -> bool:
        """Whether a race between these two lines is the first reported, and room is left for it
        (then it counts as reported)."""
        key = (earlier.op, earlier.line, later.op, later.line)
        if key in self._seen or len(self._found) >= _KEPT:
            return False
        self._seen.add(key)
        return True

    # -- accesses ---------------------------------------------------------------------------------

    def forget(self, storage: int, lo: int, hi: int) -> list[_Access]:
        """Bytes [lo, hi) of the storage at `storage` are handed out again (a pool block): every
        tensor that touched them is gone (a block is handed out only once free), so their
        accesses are dropped; returns them."""
        self._flush()
        history = self._history.get(storage)
        if history is None:
            return []
        kept: list[_Access] = []
        dropped: list[_Access] = []
        for old in history.accesses:
            (dropped if old.fp.lo < hi and lo < old.fp.hi else kept).append(old)
        history.accesses = kept
        return dropped

    def handed_again(
        self, storage: int, lo: int, hi: int, agent: int, allocation: str, cause: str
    ) -> None:
        """Bytes [lo, hi) of the storage at `storage` (a pool block) are handed to `agent`'s next
        allocation, `allocation` (its operation, as a race names it): `forget`, and an access
        to them by another agent that is not ordered before what `agent` issues now races with
        the new owner: it is reported, the allocation its later side and `cause` why."""
        later = None
        for old in self.forget(storage, lo, hi):
            if old.agent == agent or self.ordered(old.agent, old.epoch, agent):
                continue
            if later is None:  # the caller's line, looked up only for a race
                later = RaceSide(allocation, self.name(agent), format_line(source_line()), "write")
            earlier = self._side(old)
            if self._first(earlier, later):
                span = (max(lo, old.fp.lo), min(hi, old.fp.hi))
                self._found.append(Race(old.fp.describe(), storage, span, earlier, later, cause))

    def access(
        self, agent: int, touched: Sequence[Touch], op: str, *, keep: bool = False
    ) -> list[_Access]:
        """An operation issued now on `agent` touches these bytes. With `keep`, its accesses are
        judged and recorded now and returned (to `watch` them). Otherwise, while `agent` has
        waited for all work the host has not passed (the common case: one stream at work), they
        are only logged: nothing can race with them until another agent issues work, which
        records the log first, and the log is dropped once the host passes them."""
        clock = self._clocks[agent]
        epoch = clock.get(agent, 0) + 1
        clock[agent] = epoch
        pending = self._pending
        solo = True
        for b in pending:
            if b != agent and clock.get(b, 0) < self._clocks[b].get(b, 0):
                solo = False
                break
        if agent == HOST and solo:
            return []  # nothing unpassed to race with, and the host passes its own work at once
        line = source_line()
        if solo and not keep:
            if self._log_agent != agent:
                self._flush()
            pending.add(agent)
            self._log_agent = agent
            self._log.append((epoch, op, line, [(weakref.ref(s), fp, w) for s, fp, w in touched]))
            return []
        self._flush()
        if agent != HOST:
            pending.add(agent)
        made = []
        for storage, fp, write in touched:
            new = _Access(fp, write, agent, epoch, op, line)
            self._add(storage, new, clock)
            made.append(new)
        return made

    def watch(self, access: _Access, storage: torch.UntypedStorage) -> _Watch | None:
        """Keep the pinned bytes a queued device read was issued on, to see numpy writes to them;
        `check` the watch when the read runs. None for a strided read: its neighbours'
        legitimate writes would look like changes."""
        if access.fp.strided is not None or access.agent == HOST:
            return None
        watch = _Watch(access, storage, b"")
        watch.snapshot = watch.bytes_now()
        access.watch = watch
        self._watches.append(watch)
        return watch

    def check_watched(self, storage: int) -> None:
        """A new device read of pinned memory is issued: queued reads of the same storage must
        still see what they were issued on."""
        for watch in [w for w in self._watches if w.access.fp.storage == storage]:
            self.check(watch, drop=False)

    def watches_ordered_before(self, agent: int, storage: int) -> list[_Watch]:
        """The watches on `storage` whose reads are ordered before what `agent` issues now: a
        device write to those bytes that it issues comes after them (the same stream, or one
        that waited), so when it runs the bytes change for no host write."""
        return [
            w
            for w in self._watches
            if w.access.fp.storage == storage
            and self.ordered(w.access.agent, w.access.epoch, agent)
        ]

    def check(self, watch: _Watch, *, drop: bool) -> None:
        """Report a changed watched range as a host write that raced with the queued read."""
        if watch.access.watch is not watch:
            return  # already reported or dropped
        if watch.bytes_now() == watch.snapshot:
            if drop:
                self._drop(watch)
            return
        self._drop(watch)
        access = watch.access
        host = RaceSide(
            "a numpy view or another path torch does not see",
            "the host",
            f"an unknown line (the changed bytes were found at {format_line(source_line())})",
            "write",
        )
        self._report(access, access.fp, host, (access.fp.lo, access.fp.hi))

    def _drop(self, watch: _Watch) -> None:
        watch.access.watch = None
        self._watches.remove(watch)

    def _check_passed_watches(self) -> None:
        host = self._clocks[HOST]
        for watch in list(self._watches):
            if host.get(watch.access.agent, 0) >= watch.access.epoch:
                self.check(watch, drop=True)

    def _flush(self) -> None:
        """Another agent issues work: record the logged accesses it may race with."""
        if not self._log:
            return
        agent, host = self._log_agent, self._clocks[HOST]
        clock = self._clocks[agent]
        for epoch, op, line, touched in self._log:
            if host.get(agent, 0) >= epoch:
                continue  # passed by the host: ordered before everything from now on
            for ref, fp, write in touched:
                storage = ref()
                if storage is not None:  # freed memory is never accessed again as such
                    self._add(storage, _Access(fp, write, agent, epoch, op, line), clock)
        self._log.clear()

    def _add(self, storage: torch.UntypedStorage, new: _Access, clock: Clock) -> None:
        fp = new.fp
        history = self._history.get(fp.storage)
        if history is None or history.ref() is not storage:
            if len(self._history) >= _STORAGES:
                self._sweep()
            history = self._history[fp.storage] = _History(storage)
        host = self._clocks[HOST]
        kept = []
        for old in history.accesses:
            passed = host.get(old.agent, 0) >= old.epoch
            if passed and old.watch is None:
                continue  # ordered before everything issued from now on
            ordered = passed or old.agent == new.agent or clock.get(old.agent, 0) >= old.epoch
            if (new.write or old.write) and old.fp.lo < fp.hi and fp.lo < old.fp.hi:
                if not ordered:
                    span = overlap(old.fp, fp)
                    if span is not None:
                        self._report(old, fp, self._side(new), span)
                if new.write and old.watch is not None:
                    self._drop(old.watch)  # a dispatched write: the clocks judged it
            if ordered and old.watch is None and fp.covers(old.fp) and (new.write or not old.write):
                continue  # anything racing with `old` from now on races with `new` too
            kept.append(old)
        kept.append(new)
        if len(kept) > self._per_storage:
            del kept[0]
        history.accesses = kept

    def _sweep(self) -> None:
        host = self._clocks[HOST]
        for key, history in list(self._history.items()):
            if history.ref() is None or all(
                host.get(a.agent, 0) >= a.epoch and a.watch is None for a in history.accesses
            ):
                del self._history[key]

    def _side(self, access: _Access) -> RaceSide:
        return RaceSide(
            access.op,
            self.name(access.agent),
            format_line(access.line),
            "write" if access.write else "read",
        )

    def _report(self, old: _Access, fp: Footprint, later: RaceSide, span: tuple[int, int]) -> None:
        earlier = self._side(old)
        if not self._first(earlier, later):  # before describing it: a racy loop repeats its race
            return
        shown = fp if fp.dtype is not None else old.fp
        self._found.append(Race(shown.describe(), shown.storage, span, earlier, later))
        if old.watch is not None:
            self._drop(old.watch)  # one report per queued read


def _join(into: Clock, other: Clock) -> None:
    for agent, epoch in other.items():
        if into.get(agent, 0) < epoch:
            into[agent] = epoch
