"""Recording a capture into a replayable program, and replaying it.

A captured program refers to three kinds of values, as a CUDA graph refers to addresses:
- owned: outputs allocated from the graph's pool during the capture (held by the graph);
- external: tensors the graph reads or writes but does not own (weights, static inputs, workspaces).
  Like a CUDA graph, the program keeps only their address, not a reference: it holds a weak reference
  to the storage, so memory freed or reallocated after the capture is reported as use-after-free
  instead of silently read;
- derived: views, recomputed at each replay from the values above (metadata only).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from pytest_graphmode.runtime.backends import footprint
from pytest_graphmode.runtime.backends.errors import CaptureError, UseAfterFreeError
from pytest_graphmode.runtime.backends.footprint import Footprint, Line
from pytest_graphmode.runtime.backends.sim import ops
from pytest_graphmode.runtime.backends.sim.capture_order import Branches, CaptureOrder
from pytest_graphmode.runtime.backends.sim.device import (
    POOL_BLOCK,
    POOLED,
    VIEW_OF,
    SimDeviceTensor,
)
from pytest_graphmode.runtime.backends.sim.generators import CapturedDraws, philox_state
from pytest_graphmode.runtime.backends.sim.happens_before import Touch
from pytest_graphmode.runtime.backends.sim.pool import BlockReturns, SimPoolHandle, poison_

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.memory_ledger import DeviceMemory


@dataclass(frozen=True, slots=True)
class Ref:
    idx: int


@dataclass(slots=True)
class _External:
    idx: int
    storage: weakref.ref[torch.UntypedStorage]
    address: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    label: str
    site: Line  # the runner's line whose operation the capture first saw it in


@dataclass(slots=True)
class _Instr:
    func: Any
    args: list[Any]
    kwargs: dict[str, Any]
    view_outs: list[int] | None  # view instruction: env slots its results go to
    fresh: list[tuple[int, int]]  # compute instruction: (return position, owned slot)


def _resolve(x: Any, env: list[Any]) -> Any:
    if type(x) is Ref:
        return env[x.idx]
    if type(x) is list or type(x) is tuple:
        return type(x)(_resolve(i, env) for i in x)
    return x


_Planned = tuple[
    Any,
    list[Any],
    tuple[tuple[int, int], ...],
    tuple[int, ...],
    dict[str, Any],
    bool,
    list[int] | None,
    list[tuple[int, int]],
]
"""An instruction as a replay runs it (`_plan`); a tuple, unpacked once per instruction."""


def _plan(ins: _Instr) -> _Planned:
    """How one instruction's arguments are filled in at each replay: the template's top-level
    references are set by position, only nested lists are walked, and keyword arguments are
    resolved only when they hold a reference."""
    direct = tuple((i, a.idx) for i, a in enumerate(ins.args) if type(a) is Ref)
    nested = tuple(
        i for i, a in enumerate(ins.args) if (type(a) is list or type(a) is tuple) and _has_ref(a)
    )
    kwargs_refs = any(_has_ref(v) for v in ins.kwargs.values())
    return (ins.func, ins.args, direct, nested, ins.kwargs, kwargs_refs, ins.view_outs, ins.fresh)


def _has_ref(x: Any) -> bool:
    if type(x) is Ref:
        return True
    return (type(x) is list or type(x) is tuple) and any(_has_ref(i) for i in x)


def _describe(t: torch.Tensor) -> str:
    return f"tensor {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


KEEPS_CAPTURED_PINNED_BLOCKS = _torch_release() >= (2, 11)
"""Whether a pinned host block allocated during a capture, which a captured copy reads or writes,
stays the graph's after the program drops it. Torch's caching host allocator allocates such a
block to the graph's pool and keeps it for the pool's life from release 2.11 on (pytorch#167507,
measured on the H200; 2.10 not checked), so dropping it is safe there, and the sim keeps it too.
A pinned block allocated before the capture is not kept, on CUDA as on the sim: dropped, it can be
handed out again while the graph still copies through it (seen on the H200), and the sim reports
a replay after the drop as a use after free, as it does for such blocks under an older torch."""


ReplayAccess = tuple[weakref.ref[torch.UntypedStorage], Footprint, bool]
"""A storage a replay touches (weakly held, as a graph holds addresses), the bytes, and whether it
writes them."""


class Program:
    """A finished capture: replays its instructions in recorded order on the same memory.

    `accesses` are the bytes every replay reads and writes, of external tensors and of its pool
    (merged once here: the race checker judges them at each launch)."""

    def __init__(
        self,
        env: list[Any],
        externals: list[_External],
        instrs: list[_Instr],
        accesses: list[ReplayAccess],
        kept: dict[int, torch.UntypedStorage] | None = None,
        external_events: list[Any] | None = None,
        draws: CapturedDraws | None = None,
        branches: Branches | None = None,
    ) -> None:
        self._env = env
        self._externals = externals
        self._kept = kept or {}  # external slot -> a pinned storage the graph keeps alive
        self._plans = [_plan(ins) for ins in instrs]
        self.accesses = accesses
        # An event recorded after the last launch (SimBackend._launch): CUDA orders a graph's
        # launch behind its previous launch, on whichever stream that ran.
        self.last_launch: Any = None
        self.external_events = external_events or []  # events made with external=True it records
        self.draws = draws or CapturedDraws()  # from device generators, bound at each launch
        # The order of a capture that forked side streams: a launch picks one order it allows.
        self.branches = branches
        self._first_reader: dict[int, str] = {}
        for ins in instrs:
            for ref in _refs(ins.args, ins.kwargs):
                self._first_reader.setdefault(ref, ops.op_name(ins.func))

    def live_storages(self) -> list[torch.UntypedStorage]:
        """The storages of the external memory the program reads, for `run`; UseAfterFreeError
        now if any of it is gone.

        Called when a replay is issued. The queued replay holds what this returns, so a tensor the
        program dropped after issuing it stays where it is until the replay ran: on CUDA the
        caching allocator hands a freed block out again only in the order of its stream, after the
        replay already issued on it."""
        return [self._storage(ext) for ext in self._externals]

    def run(
        self,
        storages: list[torch.UntypedStorage],
        draws: list[tuple[int, int]] | None = None,
        order: list[int] | None = None,
    ) -> None:
        """One replay on `storages` (`live_storages`'s, at the replay's issue), its draws at the
        seeds and offsets its launch reserved (`CapturedDraws.reserve`), its instructions in
        `order` (one `branches` allows; recorded order when None)."""
        if draws:
            self.draws.bind(draws)
        plans = self._plans if order is None else [self._plans[i] for i in order]
        env = list(self._env)
        for ext, storage in zip(self._externals, storages, strict=True):
            t = torch.empty(0, dtype=ext.dtype)
            env[ext.idx] = t.set_(storage, ext.offset, ext.shape, ext.stride)
        with torch.no_grad():
            for index, (
                func,
                template,
                direct,
                nested,
                kwargs,
                kwargs_refs,
                view_outs,
                fresh,
            ) in enumerate(plans):
                args = template.copy()
                for i, slot in direct:
                    args[i] = env[slot]
                for i in nested:
                    args[i] = _resolve(args[i], env)
                if kwargs_refs:
                    kwargs = {k: _resolve(v, env) for k, v in kwargs.items()}
                try:
                    out = func(*args, **kwargs)
                except Exception as error:
                    error.add_note(
                        f"in a graph replay: its recorded operation {index + 1} of {len(plans)}, "
                        f"{func}, as captured"
                    )
                    raise
                outs = out if isinstance(out, tuple | list) else [out]
                if view_outs is not None:
                    for slot, value in zip(view_outs, outs, strict=True):
                        env[slot] = value
                else:
                    for pos, slot in fresh:
                        env[slot].copy_(outs[pos])

    def _storage(self, ext: _External) -> torch.UntypedStorage:
        """The storage of an external tensor, still where the capture saw it."""
        kept = self._kept.get(ext.idx)
        if kept is not None:
            return kept
        storage = ext.storage()
        if storage is not None and _dropped_by_the_program(storage):
            storage = None
        reader = self._first_reader.get(ext.idx, "the graph")
        if storage is None or storage.data_ptr() != ext.address:
            what = "freed" if storage is None else "reallocated (resized)"
            raise UseAfterFreeError(
                f"graph replay reads memory that was {what} after capture: {ext.label}, read by "
                f"{reader} (the capture met it at {footprint.format_line(ext.site)}). A graph keeps "
                "addresses, not tensors: a tensor a graph reads must outlive the graph, and hold "
                "at each replay what the replay should read. A value the runner computes outside "
                "the capture (from this step's batch or the capture's own) is read as the capture "
                "left it: compute it inside the capture from buffers the runner rewrites in place "
                "(copy_) before each replay, or keep a persistent buffer and rewrite it so; never "
                "rebind, resize or drop what a graph reads (or capture again)."
            )
        return storage


def _dropped_by_the_program(storage: torch.UntypedStorage) -> bool:
    """Whether no tensor refers to the memory any more: it lives on only because a replay issued
    before the program freed it holds its storage object until it has run (`Program.live_storages`).
    """
    return storage_tensor_count(storage) < 1


def storage_tensor_count(storage: torch.UntypedStorage) -> int:
    """How many tensors refer to `storage`, asked through its storage object."""
    return int(torch._C._storage_Use_Count(storage._cdata)) - _ONE_TENSOR_COUNT + 1


def _one_tensor_count() -> int:
    """The use count torch reports for a storage that one tensor refers to, asked through its
    storage object. Measured, not assumed: whether the storage object itself counts has differed
    between torch releases, and where it does not, no memory is ever taken for dropped."""
    one = torch.empty(1, device="cpu")
    return int(torch._C._storage_Use_Count(one.untyped_storage()._cdata))


# Measured once, at import: outside any mode the sim or a runner may enter later.
_ONE_TENSOR_COUNT = _one_tensor_count()


def _refs(args: list[Any], kwargs: dict[str, Any]) -> list[int]:
    found: list[int] = []

    def walk(x: Any) -> None:
        if type(x) is Ref:
            found.append(x.idx)
        elif type(x) is list or type(x) is tuple:
            for i in x:
                walk(i)

    walk(args)
    walk(list(kwargs.values()))
    return found


def patch_custom_op_alias_check() -> Callable[[], None]:
    """While the sim is active, `torch.library.custom_op`'s check that an operator's outputs
    alias none of its inputs compares the bytes they span rather than their storages. A
    capture's outputs are slices of one chunk of its pool (`SimPoolHandle`), as a CUDA pool's
    blocks are slices of one segment; but on CUDA each block is a storage of its own, and on sim
    they share the chunk's, so torch's check took two distinct outputs of a capture for aliases.
    Returns what puts torch's back."""
    import torch._library.utils as library_utils

    original = library_utils._c_check_aliasing_constraint

    def check(name: str, args: Any, kwargs: Any, result: Any, get_module: Any = None) -> None:
        outputs = _footprints(result)
        inputs = _footprints((args, kwargs))
        for i, mine in enumerate(outputs):
            if any(footprint.overlap(mine, other) for other in inputs + outputs[:i]):
                original(name, args, kwargs, result, *(() if get_module is None else (get_module,)))
                return

    library_utils._c_check_aliasing_constraint = check

    def restore() -> None:
        library_utils._c_check_aliasing_constraint = original

    return restore


def _footprints(value: Any) -> list[Footprint]:
    """The footprints of the non-empty tensors in `value` (lists, tuples and dicts walked)."""
    found = (footprint.of(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return [located[1] for located in found if located is not None]


def keep_bases_of_views(base: Any, result: Any) -> None:
    """A view of a capture's output (or of a view of one) holds the output's Python object: the
    output's pool block returns to the pool when that object dies (`Capture._allocate`). torch
    keeps a view's base alive through autograd's view tracking, which inference mode switches
    off: there a view outlived its base's object, and the pool handed its block, still in use,
    to the next allocation."""
    if not getattr(base, POOLED, False):
        return
    for out in result if isinstance(result, tuple | list) else (result,):
        if isinstance(out, torch.Tensor):
            setattr(out, POOLED, True)
            setattr(out, VIEW_OF, base)


class Capture:
    """One capture in progress: turns intercepted operations into a Program."""

    def __init__(
        self,
        pool: Any,
        *,
        keeps_pinned: bool = False,
        memory: DeviceMemory | None = None,
    ) -> None:
        """`keeps_pinned`: pinned host blocks allocated during the capture that a captured copy
        reads or writes are the graph's for its life (`KEEPS_CAPTURED_PINNED_BLOCKS`).
        `memory`: the ledger that counts the pool blocks the capture hands out."""
        self.pool = pool
        self._memory = memory
        self._returns = BlockReturns(pool)
        # The sim's own pools serve one stream per chunk; a runner's SimCapturePool takes none.
        self._per_stream = isinstance(pool, SimPoolHandle)
        self._keeps_pinned = keeps_pinned
        self._made_pinned: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._kept: dict[int, torch.UntypedStorage] = {}
        self._external_events: list[Any] = []
        self._env: list[Any] = []
        self._owned: set[int] = set()
        self._externals: list[_External] = []
        self._instrs: list[_Instr] = []
        self._ids: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._touched: dict[tuple[Footprint, bool], weakref.ref[torch.UntypedStorage]] = {}
        self._draws = CapturedDraws()
        self.order = CaptureOrder(per_stream=self._per_stream)
        self.invalid: str | None = None

    def fail(self, message: str) -> CaptureError:
        self.invalid = self.invalid or message
        return CaptureError(message)

    def record(
        self, op: ops.OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any], stream: Any
    ) -> Any:
        """`op` issued on `stream`, a stream of this capture: recorded, not run."""
        if self.invalid is not None:
            raise CaptureError(f"capture already invalidated: {self.invalid}")
        problem = ops.capture_violation(op, args, kwargs)
        if problem is not None:
            raise self.fail(
                f"{op.name} cannot be captured: {problem}. Move it out of the capture "
                "region, or keep the value on the device."
            )
        func = op.func
        if op.draws and philox_state(kwargs.get("generator")) is not None:
            func = self._draws.record(func, kwargs["generator"])
        if op.constant:
            return self._constant(args[0])
        if op.empty:
            return self._allocate(ops.meta_outputs(op, args, kwargs), stream, op.name)[0][0]
        # Host tensors reach a captured operation only as 0-dim operands, which CUDA passes as
        # kernel arguments (their value now is baked in), and as the pinned side of a
        # non_blocking copy, which the graph reads or writes at every replay.
        bake = not op.is_copy
        targs = [self._template(a, bake) for a in args]
        tkwargs = {k: self._template(v, bake) for k, v in kwargs.items()}
        if op.is_copy and self._made_pinned:
            self._keep_pinned(args, targs)
        if op.is_view:
            out = func(*args, **kwargs)
            outs = list(out) if isinstance(out, tuple | list) else [out]
            slots = [self._bind(o, self._new_slot(None)) for o in outs]
            self._instrs.append(_Instr(func, targs, tkwargs, slots, []))
            self.order.node(stream, self._refs_once_forked(targs, tkwargs), slots)
            return out
        positions = op.fresh_positions
        metas = ops.checked_layouts(op, args, kwargs)
        fresh, slots = self._allocate([metas[p] for p in positions], stream, op.name)
        self._instrs.append(
            _Instr(func, targs, tkwargs, None, list(zip(positions, slots, strict=True)))
        )
        node = self.order.node(stream, self._refs_once_forked(targs, tkwargs), None)
        touched = self._touch(ops.touched(op, args, kwargs, fresh))
        self.order.touched(stream, node, touched, op.name)
        return ops.assemble_returns(op, args, kwargs, dict(zip(positions, fresh, strict=True)))

    def finish(self) -> Program:
        """Freeze the program; views of owned memory are computed once here."""
        constant = set(self._owned)
        kept: list[_Instr] = []
        kept_at: list[int] = []  # their indices among the recorded instructions
        env = list(self._env)
        for index, ins in enumerate(self._instrs):
            if ins.view_outs is not None and set(_refs(ins.args, ins.kwargs)) <= constant:
                out = ins.func(
                    *[_resolve(a, env) for a in ins.args],
                    **{k: _resolve(v, env) for k, v in ins.kwargs.items()},
                )
                outs = out if isinstance(out, tuple | list) else [out]
                for slot, value in zip(ins.view_outs, outs, strict=True):
                    env[slot] = value
                    constant.add(slot)
            else:
                kept.append(ins)
                kept_at.append(index)
        for slot in range(len(env)):
            if slot not in constant:
                env[slot] = None
        refs = {fp.storage: ref for (fp, _), ref in self._touched.items()}
        accesses = [(refs[fp.storage], fp, write) for fp, write in footprint.merge(self._touched)]
        return Program(
            env,
            self._externals,
            kept,
            accesses,
            self._kept,
            self._external_events,
            self._draws,
            self.order.branches(kept_at),
        )

    def _refs_once_forked(self, args: list[Any], kwargs: dict[str, Any]) -> list[int]:
        """The slots an instruction reads, which the order needs only once the capture forked."""
        return _refs(args, kwargs) if self.order.forked else []

    def recorded_on(self, t: torch.Tensor, stream: Any) -> bool:
        """`t.record_stream(stream)` while this capture is under way: whether `t` is (a view of)
        an output of it. Its block then waits for the capture's end once freed, if `stream` is
        not the one it was allocated on (BlockReturns)."""
        base = t
        while (up := getattr(base, VIEW_OF, None)) is not None:
            base = up
        held = getattr(base, POOL_BLOCK, None)
        if held is None or held[0] is not self._returns:
            return False
        _, block, allocated_on = held
        if stream.stream_id != allocated_on:
            self._returns.recorded(block)
        return True

    def ended(self) -> None:
        """The capture ended, or was aborted: blocks kept for it come back to the pool."""
        self._returns.end()

    def records_external(self, event: Any) -> None:
        """An event made with external=True recorded in the capture: each replay records it."""
        if not any(event is e for e in self._external_events):
            self._external_events.append(event)

    def made_pinned(self, storage: torch.UntypedStorage) -> None:
        """A pinned host block allocated while this capture runs."""
        if self._keeps_pinned:
            self._made_pinned[storage.data_ptr()] = weakref.ref(storage)

    def _keep_pinned(self, args: tuple[Any, ...], targs: list[Any]) -> None:
        """The pinned host sides of a captured copy allocated during the capture, held for the
        life of the program."""
        for arg, template in zip(args, targs, strict=True):
            if type(template) is not Ref or isinstance(arg, SimDeviceTensor):
                continue
            storage = arg.untyped_storage()
            made = self._made_pinned.get(storage.data_ptr())
            if made is not None and made() is not None:
                self._kept[template.idx] = storage

    def _touch(self, touched: list[tuple[torch.Tensor, bool]]) -> list[Touch]:
        """Note what an instruction touches (a replay touches all of it); returns it as
        (storage, footprint, write)."""
        known = self._touched
        located = []
        for t, write in touched:
            found = footprint.of(t)
            if found is not None:
                located.append((found[0], found[1], write))
                if (found[1], write) not in known:
                    known[(found[1], write)] = weakref.ref(found[0])
        return located

    # -- values ---------------------------------------------------------------------------------

    def _new_slot(self, value: Any) -> int:
        self._env.append(value)
        return len(self._env) - 1

    def _bind(self, t: torch.Tensor, slot: int) -> int:
        self._ids[id(t)] = (weakref.ref(t), slot)
        return slot

    def _slot_of(self, t: torch.Tensor) -> int:
        known = self._ids.get(id(t))
        if known is not None and known[0]() is t:
            return known[1]
        storage = t.untyped_storage()
        slot = self._new_slot(None)
        self._externals.append(
            _External(
                slot,
                weakref.ref(storage),
                storage.data_ptr(),
                int(t.storage_offset()),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
                f"{_describe(t)} at 0x{t.data_ptr():x}",
                footprint.source_line(),  # once per external tensor a capture meets
            )
        )
        return self._bind(t, slot)

    def _template(self, x: Any, bake: bool) -> Any:
        if isinstance(x, torch.Tensor):
            if bake and not isinstance(x, SimDeviceTensor):
                slot = self._new_slot(x.clone())
                self._owned.add(slot)
                return Ref(slot)
            return Ref(self._slot_of(x))
        if type(x) is list or type(x) is tuple:
            return type(x)(self._template(i, bake) for i in x)
        return x

    def _constant(self, t: torch.Tensor) -> torch.Tensor:
        slot = self._new_slot(t)
        self._owned.add(slot)
        self._bind(t, slot)
        return t

    def _allocate(
        self, metas: list[ops.Layout], stream: Any, op: str
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Pool-backed, poisoned outputs of `op`, work on `stream`: one tensor for the program,
        one handed to the caller."""
        fresh, slots = [], []
        pool = self.pool
        for meta in metas:
            block = (
                pool.allocate(meta.nbytes, stream.stream_id)
                if self._per_stream
                else pool.allocate(meta.nbytes)
            )
            offset = block.storage_offset() // meta.itemsize
            storage = block.untyped_storage()
            lo = block.storage_offset() * block.element_size()
            self.order.handed_out(stream, storage.data_ptr(), lo, lo + block.nbytes, op)
            owned = torch.empty(0, dtype=meta.dtype).set_(storage, offset, meta.shape, meta.stride)
            poison_(owned)
            handed = torch.empty(0, dtype=meta.dtype).set_(storage, offset, meta.shape, meta.stride)
            # The block returns to the pool when the caller drops its tensor (and every view of it),
            # as a CUDA graph pool block does; the program's own handle does not keep it reserved.
            weakref.finalize(handed, self._returns.give_back, block)
            setattr(handed, POOL_BLOCK, (self._returns, block, stream.stream_id))
            if self._memory is not None and self._memory.counting:
                self._memory.pooled(storage, handed, meta.nbytes)
            setattr(handed, POOLED, True)  # see keep_bases_of_views
            slot = self._bind(handed, self._new_slot(owned))
            self._owned.add(slot)
            fresh.append(handed)
            slots.append(slot)
        return fresh, slots
