"""What an operation touches, told to the race checker (happens_before.py) and the free tracker
(frees.py) when the operation is issued; the layer of `SimBackend` under streams, capture and
dispatch (state.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pytest_graphmode.runtime.backends import footprint
from pytest_graphmode.runtime.backends.sim import ops
from pytest_graphmode.runtime.backends.sim.happens_before import HOST, Touch
from pytest_graphmode.runtime.backends.sim.ops import OpFacts
from pytest_graphmode.runtime.backends.sim.state import SimState
from pytest_graphmode.runtime.backends.sim.streams import SimStream


class AccessNotes(SimState):
    """Notes of the memory each operation reads and writes, in the order they are issued."""

    def _note(
        self,
        stream: SimStream | None,
        touched: list[tuple[torch.Tensor, bool]],
        op: str,
        *,
        keep: bool = False,
    ) -> list[Any]:
        """Tell the race checker what an operation issued now touches; stream None: the host.
        `keep`: judge and record now, and return the accesses (see RaceChecker.access)."""
        found = []
        for t, write in touched:
            located = footprint.of(t)
            if located is not None:
                found.append((located[0], located[1], write))
        return self._access(stream, found, op, keep=keep)

    def _access(
        self, stream: SimStream | None, touched: list[Touch], op: str, *, keep: bool = False
    ) -> list[Any]:
        """An operation issued now on `stream` (None: the host) touches these bytes: judged by the
        race checker, and, on a stream, noted by the free tracker."""
        races = self._races
        if stream is None:
            return races.access(HOST, touched, op, keep=keep)
        agent = races.agent(stream)
        accesses = races.access(agent, touched, op, keep=keep)
        self._note_uses(stream, agent, touched, op)
        return accesses

    def _note_uses(self, stream: SimStream, agent: int, touched: list[Touch], op: str) -> None:
        """Tell the free tracker which storages a device operation issued now touches, where one
        may be another stream's memory: always off the default stream, on it only while memory
        allocated elsewhere lives."""
        if stream is not self._default or self._frees.side_allocations:
            self._frees.used(agent, touched, op)

    def _note_call(
        self,
        stream: SimStream | None,
        op: OpFacts,
        args: Any,
        kwargs: Any,
        result: Any,
        tensors: list[torch.Tensor],
    ) -> None:
        """`_note` of a call that ran: its tensor arguments (`tensors`) and fresh outputs, in one
        pass (ops.touched, without its intermediate list: this runs for every eager operation)."""
        if op.quiet:
            return
        found = []
        of = footprint.of
        if op.written_positions:
            written = ops.written_args(op, args, kwargs)
            for t in tensors:
                located = of(t)
                if located is not None:
                    found.append((located[0], located[1], any(t is w for w in written)))
        else:
            for t in tensors:
                located = of(t)
                if located is not None:
                    found.append((located[0], located[1], False))
        for t in ops.fresh_outputs(op, result):
            located = of(t)
            if located is not None:
                found.append((located[0], located[1], True))
        self._access(stream, found, op.name)

    def _after_watches(
        self, watches: list[Any], run: Callable[[], Any], retired: Sequence[Any] = ()
    ) -> Callable[[], None]:
        """Queued work that first judges its watched pinned reads (host writes torch could not
        see happened before it ran), then runs `run` as sim-internal work. `retired`: watches of
        earlier reads this work's writes to pinned memory come after (`_retired_by`), judged
        one last time and dropped before it writes."""
        races = self._races

        def work() -> None:
            for watch in watches:
                races.check(watch, drop=False)
            for watch in retired:
                races.check(watch, drop=True)
            self._internal(run)

        return work

    def _retired_by(self, agent: int, written: list[Any]) -> list[Any]:
        """The watches a device write issued now on `agent` to the pinned storages `written`
        supersedes: those of reads ordered before it, whose bytes it is free to change."""
        pinned = self._pinned
        retired: list[Any] = []
        for storage in {id(s): s for s in written}.values():
            if storage.data_ptr() in pinned:
                retired += self._races.watches_ordered_before(agent, storage.data_ptr())
        return retired

    def _watch_pinned_reads(self, accesses: list[Any], storages: list[Any]) -> list[Any]:
        """Pinned bytes read by queued device work: watched for host writes torch cannot see."""
        watches = []
        for access, storage in zip(accesses, storages, strict=True):
            if not access.write and access.fp.storage in self._pinned:
                self._races.check_watched(access.fp.storage)
                watch = self._races.watch(access, storage)
                if watch is not None:
                    watches.append(watch)
        return watches

    def _held(self, what: tuple[Any, ...]) -> tuple[Any, list[int]]:
        """What queued work holds of `what`: aliases of its tensors, never the program's own,
        so that the program's frees stay visible (frees.py); and the storages to release."""
        # Torch's own detach, past the sim's modes: an alias is no operation of the program.
        with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
            return self._frees.hold(what)

    def _before_allocation(self, stream: SimStream, op: OpFacts) -> None:
        """An allocation issued on `stream`: memory freed while another stream still used it,
        without an order or record_stream, may be handed out now; it is overwritten as the new
        owner would."""
        freed = self._frees.freed_before_allocation(self._races.agent(stream), op.name)
        for storage in freed:
            self._internal(functools.partial(_overwrite, storage))

    def _note_allocation(self, stream: SimStream, op: OpFacts, result: Any) -> None:
        """Memory allocated by an operation that ran at once on `stream` belongs to `stream`
        (the default stream's needs no note: it is what memory belongs to unless noted)."""
        if op.allocates and stream is not self._default:
            fresh = ops.fresh_outputs(op, result)
            if fresh:
                self._frees.allocated(self._races.agent(stream), fresh)


def _overwrite(storage: torch.UntypedStorage) -> None:
    """Every byte of `storage` set to 0xFF (NaN in floating point, -1 in integers): what an
    allocation handed a freed block may write before queued work reads it."""
    torch.empty(0, dtype=torch.uint8).set_(storage).fill_(255)
