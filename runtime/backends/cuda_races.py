"""Host accesses to pinned memory while a non-blocking copy of it is still in flight (cuda).

A GPU has no happens-before checker (the sim's, happens_before.py, judges every access), so on
cuda a host-staging race shows only as a value, and only when the copy's late bytes differ from
the ones the host meant: a pinned mask rewritten for the next step while the last step's upload
is still queued changes nothing where both steps' masks agree at the bytes that raced. What a GPU
does show, whatever the values, is that the copy had not run yet: `InflightCopies` keeps, for
every non-blocking copy between pinned host memory and a cuda device that it is told of
(`queued`), an event recorded right after the copy on the copy's stream; a host operation it is
told of (`host_operation`, an operation whose tensors are all in host memory, which the host runs
at once) that writes the host bytes of an upload, or reads or writes those of a download, while
that event has not completed is a race. The copy reads or writes those bytes after the host did,
so the host needed a wait for the copy (its event, its stream, the device) before touching them.
A blocking copy between pinned host memory and the device (`blocking_copy`) touches its host end
as the host does, but in its stream's order: it races a noted copy on another stream only.

A host write that torch's dispatcher does not show (through a numpy view of the pinned buffer,
as engines fill their staging) is found by its bytes instead: an upload's host bytes are copied
when the copy is noted, and whenever the host is next seen to queue a copy or run an operation
they are compared with that copy first and the copy's event asked second. Bytes that changed
before an event that has still not completed were written while the copy was in flight; a change
seen only once the copy is done may have come after it, and is no race.

Who tells it: the cuda delays (strategies/stream_delays.py) while a stressed step runs, which
also hold the copies back, so that a copy is still in flight when the host's next access comes;
across the two steps of a pipelined pair too, since the copies stay noted until they complete.
A runner's own threads are told of too, where the cuda backend was active when they started
(cuda_threads.py). Unseen: copies and host accesses outside such a scope, host reads that bypass torch's dispatcher
(a numpy view, `tolist()`, ctypes), a bypassing write of the bytes already there or one the host
does not follow with an operation or a copy before the copy lands, pageable host memory (a
non-blocking copy there is synchronous for the host) and copies inside a CUDA graph capture
(their timing is the replay's: cuda_captures.py notes them at each replay under the delays, where
the capture was made while the cuda backend was active).
No query is made while a capture is underway: asking whether an event has completed ends a
capture begun in torch's global mode with an error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pytest_graphmode.runtime.backends import footprint, op_kinds
from pytest_graphmode.runtime.backends.footprint import Footprint
from pytest_graphmode.runtime.backends.race import Race, RaceSide

# Operations that touch no bytes of their tensors: allocations shaped like them, and questions
# about their type, shape or memory.
_TOUCH_NO_BYTES = (
    op_kinds.EMPTY_OPS | op_kinds.METADATA_QUERIES | {torch.ops.aten.is_pinned.default}
)
# Uploads whose host bytes are copied to find writes the dispatcher does not show: larger ones
# (a staged weight) are left to the value checks rather than copied on every delayed step.
_MOST_WATCHED_BYTES = 1 << 22
# Races kept until taken: the first few say what is wrong; a runner that races every step would
# otherwise grow the list for as long as the campaign runs.
_MOST_RACES = 16


@dataclass
class _Copy:
    """A non-blocking copy still possibly in flight, and how to tell when it is not."""

    host: Footprint  # the host end's bytes
    upload: bool  # host to device (the copy reads the host bytes), else device to host (writes)
    done: Any  # a torch.cuda.Event recorded right after the copy on its stream
    side: RaceSide  # the copy, as the earlier side of a race
    # An upload's host bytes, as a uint8 view, and a copy of them taken when it was noted: how a
    # write the dispatcher does not show is found (None: not watched, or no longer).
    watched: tuple[torch.Tensor, torch.Tensor] | None = None


class InflightCopies:
    """The non-blocking copies between pinned host memory and a cuda device noted so far that
    have not been seen to complete, and the races host operations ran into with them."""

    def __init__(self) -> None:
        self._copies: list[_Copy] = []
        self._races: list[Race] = []
        # (copy's line, host's line): each pair once until the races are taken
        self._reported: set[tuple[str, str]] = set()

    def queued(self, host: torch.Tensor, stream: Any, upload: bool, op: str) -> None:
        """A non-blocking copy between `host` and a cuda device was just queued on `stream`
        (`upload`: from `host`, else into it). Pageable host memory is not noted: CUDA finishes
        with it before the copy call returns. The caller has made sure no capture is underway."""
        if not host.is_pinned():
            return
        done = torch.cuda.Event()
        # The class's own record: the delays replace `torch.cuda.Event.record` with one that
        # sleeps first, and this event must mark the copy, not a sleep after it.
        torch._C._CudaEventBase.record(done, stream)
        self.note(
            host, upload, done, f"{op} (non-blocking, {_direction(upload)})", stream_name(stream)
        )

    def note(self, host: torch.Tensor, upload: bool, done: Any, op: str, stream: str) -> None:
        """What `queued` notes of a copy, given what tells when it is done (anything whose
        `query()` says whether it has completed), the copy's `op` and its `stream`, as a race
        report names them."""
        located = footprint.of(host)
        if located is None:
            return
        storage, bytes_ = located
        where = footprint.format_line(footprint.source_line())
        self._unseen_writes(where)
        if not upload:  # its landing changes those bytes: no longer a sign of the host's write
            for copy in self._copies:
                if copy.watched is not None and footprint.overlap(copy.host, bytes_) is not None:
                    copy.watched = None
        side = RaceSide(op, stream, where, "read" if upload else "write")
        copy = _Copy(bytes_, upload, done, side)
        if (
            upload
            and bytes_.strided is None  # the bytes between a strided one's elements: another's
            and bytes_.hi - bytes_.lo <= _MOST_WATCHED_BYTES
            and not self._landing_into(bytes_)
        ):
            nbytes = bytes_.hi - bytes_.lo
            now = torch.empty(0, dtype=torch.uint8).set_(storage, bytes_.lo, (nbytes,), (1,))
            copy.watched = (now, now.clone())
        self._copies.append(copy)

    def _landing_into(self, host: Footprint) -> bool:
        """Whether a download noted before may still be landing in `host`'s bytes: queued on the
        same stream it lands before an upload reads them, and the change is no host's write."""
        return any(
            not copy.upload
            and footprint.overlap(copy.host, host) is not None
            and not copy.done.query()
            for copy in self._copies
        )

    @property
    def pending(self) -> bool:
        """Whether any copy noted may still be in flight (asks nothing of the device)."""
        return bool(self._copies)

    def host_operation(
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        capturing: Callable[[], bool] = lambda: False,
    ) -> None:
        """`func(*args, **kwargs)` is about to run: where it runs on the host, a race with every
        noted copy still in flight whose host bytes it writes, or, for a download, reads.
        `capturing` says whether a capture is underway, asked only of an operation that runs on
        the host: nothing is asked of the device then (the module docstring says why)."""
        touched = _host_touches(func, args, kwargs)
        if not touched or capturing():
            return
        self._settle()
        for tensor, write in touched:
            located = footprint.of(tensor)
            if located is None:
                continue
            for copy in self._copies:
                if copy.upload and not write:
                    continue  # a read of what an upload reads too: no race
                shared = footprint.overlap(copy.host, located[1])
                if shared is not None:
                    self._race(copy, located[1], shared, str(func.overloadpacket), write)

    def blocking_copy(self, host: torch.Tensor, upload: bool, op: str, stream: str) -> None:
        """A blocking copy between `host` and a cuda device is about to run on `stream` (named as
        `stream_name` names it): the host waits for it, so it reads (`upload`) or writes `host`'s
        bytes as a host operation would, but after the work queued before it on `stream`. A race
        with every noted copy on another stream still in flight whose host bytes it writes, or,
        for a download, reads. The caller has made sure no capture is underway."""
        located = footprint.of(host)
        if located is None:
            return
        self._settle()
        write, bytes_ = not upload, located[1]
        described = f"{op} (blocking, {_direction(upload)}, on {stream})"
        for copy in self._copies:
            shared = footprint.overlap(copy.host, bytes_)
            if shared is None or (copy.upload and not write):
                continue
            if copy.side.stream != stream:
                self._race(copy, bytes_, shared, described, write)
            elif write:  # on its own stream the copy came first: the change is no host's write
                copy.watched = None

    def take(self) -> list[Race]:
        """The races found since the last call, first found first; forgets them, so the same race
        is reported again when it happens again (a failing example replayed, as when shrinking)."""
        if self._copies and not _capturing():
            # the last chance to see a write the step made after its last operation; and copies
            # seen done let go of the host bytes they watched
            self._settle("the end of the step")
        races, self._races = self._races, []
        self._reported.clear()
        return races

    def _settle(self, where: str | None = None) -> None:
        """`_unseen_writes`, then forget the copies seen to have completed."""
        self._unseen_writes(where)
        self._copies = [copy for copy in self._copies if not copy.done.query()]

    def _unseen_writes(self, where: str | None = None) -> None:
        """A race for every watched upload whose host bytes changed while it is still in flight:
        the bytes are compared first and the event asked second, so a change seen before a copy
        that has still not completed was made before the copy read them. `where`: the line the
        host reached when the change was found (None: the program's line now, looked up only for
        a race, since this runs before every host operation while a copy is noted)."""
        for copy in self._copies:
            if copy.watched is None:
                continue
            now, then = copy.watched
            if torch.equal(now, then):
                continue
            copy.watched = None  # one report a copy; a change after it completed is no race
            if not copy.done.query():
                changed = torch.nonzero(now != then).flatten()
                item = copy.host.itemsize  # widened to whole elements, as the race names them
                lo = copy.host.lo + int(changed[0]) // item * item
                hi = copy.host.lo + (int(changed[-1]) // item + 1) * item
                if where is None:
                    where = footprint.format_line(footprint.source_line())
                later = RaceSide(
                    "a numpy view or another path torch does not see",
                    "the host",
                    f"an unknown line (the changed bytes were found at {where})",
                    "write",
                )
                self._report(copy, copy.host, (lo, hi), later)  # the bytes that changed

    def _race(
        self, copy: _Copy, host: Footprint, shared: tuple[int, int], op: str, write: bool
    ) -> None:
        where = footprint.format_line(footprint.source_line())
        later = RaceSide(op, "the host", where, "write" if write else "read")
        if write:
            copy.watched = None  # the change it makes is this race, not another
        self._report(copy, host, shared, later)

    def _report(
        self, copy: _Copy, host: Footprint, shared: tuple[int, int], later: RaceSide
    ) -> None:
        key = (copy.side.line, later.line)
        if key in self._reported or len(self._races) >= _MOST_RACES:
            return
        self._reported.add(key)
        self._races.append(Race(host.describe(), host.storage, shared, copy.side, later))


def _host_touches(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> list[tuple[torch.Tensor, bool]]:
    """The tensors `func` touches and whether it writes each, when every one of them is in host
    memory (the host runs it now); none when one is on a device (it runs in stream order), and
    none for a view or an allocation, which touch no bytes."""
    writes = _written_places(func)
    if writes is None:
        return []
    found: list[tuple[torch.Tensor, bool]] = []
    for place, value in [*enumerate(args), *kwargs.items()]:
        for tensor in _tensors(value):
            if tensor.device.type != "cpu":
                return []
            found.append((tensor, place in writes))
    return found


@functools.cache
def _written_places(func: Any) -> frozenset[int | str] | None:
    """The positions and names of the arguments `func` writes in place (one is found by its
    position, or by its name when passed by name); None for an operation that touches no bytes."""
    if func in _TOUCH_NO_BYTES or op_kinds.is_view(func):
        return None
    written = op_kinds.written_arguments(func)
    return frozenset(place for position, name in written for place in (position, name))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def _direction(upload: bool) -> str:
    return "host to device" if upload else "device to host"


def stream_name(stream: Any) -> str:
    """How a race names a cuda stream."""
    if stream == torch.cuda.default_stream(stream.device):
        return "the default stream"
    return f"stream #{stream.stream_id}"


def _capturing() -> bool:
    """Whether the current stream is capturing (never without a cuda context: the copies then
    have stand-ins for their events)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
