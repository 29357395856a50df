"""The dispatch of every operation while the sim is active: host code runs at once; device work is
recorded in a capture, run at once on the default stream, or queued on a side stream; a copy
across host and device follows CUDA's rules for pinned and pageable memory. The layer of
`SimBackend` over capture and replay (state.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pytest_graphmode.runtime.backends.sim import ops
from pytest_graphmode.runtime.backends.sim.capture import keep_bases_of_views
from pytest_graphmode.runtime.backends.sim.capturing import Capturing
from pytest_graphmode.runtime.backends.sim.device import SIM_DEVICE, SimDeviceTensor, mark_device
from pytest_graphmode.runtime.backends.sim.frees import StreamOrderedFrees
from pytest_graphmode.runtime.backends.sim.generators import bind_draw, philox_state
from pytest_graphmode.runtime.backends.sim.limits import check_kernel_dtypes, check_runnable
from pytest_graphmode.runtime.backends.sim.ops import OpFacts
from pytest_graphmode.runtime.backends.sim.pool import poison_
from pytest_graphmode.runtime.backends.sim.state import ActiveCapture
from pytest_graphmode.runtime.backends.sim.streams import SimStream, new_work

if TYPE_CHECKING:
    from pytest_graphmode.runtime.backends.sim.backend import _SimMode

# Where a runner's own operator has its host kernel (`Dispatching._apart`)
_HOST_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class Dispatching(Capturing):
    """Every ATen operation of the process, while the sim is active (`_SimMode`)."""

    def _dispatch(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mode: _SimMode
    ) -> Any:
        if self._passthrough:
            return func(*args, **kwargs)
        op = ops.facts(func)
        if op.apart:
            return self._apart(op, args, kwargs, mode)
        tensors, host = _tensors(args, kwargs)
        placing = self._placing
        if placing is None:
            # A factory has no tensor to go by: inside a builtin call on device tensors, it is
            # one of the call's own tensors (`call_through`).
            device = len(host) < len(tensors) or (
                not tensors
                and self._call_args is not None
                and _made_for_a_device_call(op, self._call_args)
            )
        else:
            host, device = [], placing
        if not device:
            return self._host_op(op, args, kwargs, tensors)
        if op.draws and self.capturing_here() is None:
            kwargs = _bound_draw(kwargs)
        if op.runnable is not True:
            check_runnable(op)
        if host:
            if op.is_copy:
                return self._cross(args, kwargs)
            self._check_host_operands(op, args, host)
        if op.cuda_check is not None:
            op.cuda_check(args, kwargs)  # raised at the call, also when queued or recorded
        result = mark_device(self._device_op(op, args, kwargs, tensors, bool(host)))
        if self.memory.counting:
            if op.allocates:
                self.memory.made(result)
            elif op.resizes:
                self.memory.resized(args[0])
        if op.is_view and args:
            keep_bases_of_views(args[0], result)
        return result

    def _apart(
        self, op: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any], mode: _SimMode
    ) -> Any:
        """An operation the sim does not take as one device operation (`OpFacts.apart`)."""
        func = op.func
        if op.python_kernel:
            # A runner's own operator written in Python (`torch.library.custom_op`, as vLLM
            # keeps attention opaque): CUDA runs its Python once, at the call (at capture, for a
            # graph), and records the kernels it launches. Run here below the sim's mode, with
            # both modes entered again (the function mode too: the call is still inside its
            # handler), so that each operation it makes reaches the sim as the runner's own
            # would; recorded whole, a replay would have run its Python again.
            with torch._C._EnableTorchFunction(), mode.device_mode, mode:
                return func.redispatch(_HOST_KERNEL, *args, **kwargs)
        if op.composite:
            # Outside inference mode autograd breaks such an operation into the ones it is made
            # of before the sim sees it; in inference mode (no autograd) it arrives whole, and
            # some of them (`to`, `reshape`, `contiguous`) copy where their schema promises a
            # view. Broken up here as autograd would, with the sim's mode entered again so that
            # each part reaches it.
            with mode:
                return func.decompose(*args, **kwargs)
        return func(*args, **kwargs)  # a metadata query: no device work, no read

    def _host_op(
        self,
        op: OpFacts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
    ) -> Any:
        """Host code on host memory: it runs at once, whatever the device is doing."""
        self.scheduler.maybe_progress()  # the device keeps working while the host does
        result = op.func(*args, **kwargs)
        # Only pinned memory is touched by queued device work: pageable memory crosses to and
        # from the device synchronously, so a host access to it has nothing to race with.
        if self._pinned and any(self.is_pinned(t) for t in tensors):
            self._note_call(None, op, args, kwargs, result, tensors)
        return result

    def _cross(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A copy between host and device memory, with CUDA's rules: only a non_blocking copy
        with pinned memory is asynchronous, and only it can be captured."""
        dst, src = args[0], args[1]
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        upload = isinstance(dst, SimDeviceTensor)
        pinned = self.is_pinned(src if upload else dst)
        stream = self._current
        active = self._active
        if active is not None and stream in active.unjoined:
            if not (non_blocking and pinned):
                raise active.capture.fail(_crossing_refused(upload, non_blocking))
            self._check_seed(active)
            active.ops_on[stream] += 1
            if stream is not active.origin:
                active.unjoined[stream] = True
            return active.capture.record(ops.facts(ops.aten.copy_.default), args, kwargs, stream)
        self.scheduler.maybe_progress()
        if non_blocking and pinned:
            touched = [(src, False), (dst, True)]
            accesses = self._note(stream, touched, "aten.copy_", keep=upload)
            reads = [access for access in accesses if not access.write]
            watches = self._watch_pinned_reads(reads, [src.untyped_storage()] * len(reads))
            retired = (
                []
                if upload
                else self._retired_by(self._races.agent(stream), [dst.untyped_storage()])
            )
            (held_dst, held_src), held = self._held((dst, src))
            copy = self._after_watches(
                watches,
                _queued_call(
                    ops.aten.copy_.default, (held_dst, held_src), {}, {}, held, self._frees
                ),
                retired,
            )
            self.scheduler.enqueue(stream, new_work(copy, "async copy"))
            return dst
        # A blocking copy, or one with pageable memory: in stream order on the current stream,
        # and the host waits for it (a pageable source is staged before the call returns).
        self._note(stream, [(src, False), (dst, True)], "aten.copy_")
        self._host_waits_for(stream, checked=not non_blocking)
        return ops.aten.copy_.default(*args, **kwargs)

    def _device_op(
        self,
        op: OpFacts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
        host_scalars: bool,
    ) -> Any:
        """Device work: recorded on a capturing stream, else run at once on the default stream
        (after the work queued on it), else queued.
        `host_scalars`: a 0-dim host tensor is among the arguments (a kernel argument, read when
        the operation is issued)."""
        func = op.func
        stream = self._current
        active = self._active
        if active is not None:
            if stream not in active.unjoined:
                if op.allocates and active.refuses_unsafe_call():
                    raise active.capture.fail(
                        f"{op.name} on a stream outside the capture needs a new "
                        "allocation while a stream is capturing (operation not permitted when "
                        "stream is capturing): allocate before the capture, capture with "
                        "capture_error_mode='relaxed', or with 'thread_local' and allocate "
                        "from another thread"
                    )
            else:
                return self._recorded(active, op, args, kwargs, tensors)
        # Eager work, also while another stream captures (another thread's, or a stream the
        # capture never joined): in its stream's order, after the work queued on it before.
        self.scheduler.maybe_progress()
        if op.allocates and self._frees.watched:
            self._before_allocation(stream, op)
        if ops.capture_violation(op, args, kwargs) is not None:
            self._note(stream, ops.touched(op, args, kwargs, ()), op.name)
            self._host_waits_for(stream)  # a host read: it waits for the stream
            result = func(*args, **kwargs)
            self._note_allocation(stream, op, result)
            return result
        if stream is self._default:
            self.scheduler.drain(stream)
            result = func(*args, **kwargs)
            self._note_call(stream, op, args, kwargs, result, tensors)
            return result
        if not op.quiet:
            check_kernel_dtypes(op, args, kwargs, tensors, self._internal)
        if host_scalars:
            args, kwargs = _baked(args), {k: _baked(v) for k, v in kwargs.items()}
            return self._defer(stream, op, args, kwargs, None)
        return self._defer(stream, op, args, kwargs, tensors)

    def _recorded(
        self,
        active: ActiveCapture,
        op: OpFacts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
    ) -> Any:
        """An operation issued on a capturing stream: recorded into the capture, not run."""
        stream = self._current
        self._check_seed(active)
        active.ops_on[stream] += 1
        if stream is not active.origin:
            active.unjoined[stream] = True
        if not op.quiet and ops.capture_violation(op, args, kwargs) is None:
            check_kernel_dtypes(op, args, kwargs, tensors, self._internal)
        return active.capture.record(op, args, kwargs, stream)

    def _defer(
        self,
        stream: SimStream,
        op: OpFacts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor] | None,
    ) -> Any:
        """Queue an operation on a side stream; its fresh outputs are poison until it runs.
        `tensors`: its tensor arguments, when the caller has them (ops.touched)."""
        func = op.func
        agent = self._races.agent(stream)
        if op.quiet:
            result = func(*args, **kwargs)  # metadata or allocation only: nothing to order
            if op.empty:
                self._frees.allocated(agent, result)
            return result
        positions = op.fresh_positions
        metas = ops.checked_layouts(op, args, kwargs)
        fresh = {}
        for p in positions:
            out = torch.empty_strided(metas[p].shape, metas[p].stride, dtype=metas[p].dtype)
            poison_(out)
            fresh[p] = out
        if fresh:
            self._frees.allocated(agent, list(fresh.values()))

        touched = ops.touched(op, args, kwargs, list(fresh.values()), tensors)
        self._note(stream, touched, op.name)
        if op.changes_metadata:
            run = _queued_call(func, args, kwargs, fresh, [], self._frees)
        else:
            (args_held, kwargs_held, fresh_held), held = self._held((args, kwargs, fresh))
            run = _queued_call(func, args_held, kwargs_held, fresh_held, held, self._frees)
        self.scheduler.enqueue(stream, new_work(lambda: self._internal(run), op.name))
        return ops.assemble_returns(op, args, kwargs, fresh)

    def _check_host_operands(
        self, op: OpFacts, args: tuple[Any, ...], host: list[torch.Tensor]
    ) -> None:
        """A device operation accepts host tensors only as 0-dim operands (kernel arguments) of
        operators that take them (`OpFacts.host_scalars`) and, as torch does on CUDA, as the
        indices of advanced indexing, which it copies to the device first: a capture refuses
        that copy."""
        if op.indexing and all(any(t is i for i in ops.flat(args[1])) for t in host):
            active = self.capturing_here()
            if active is not None:
                raise active.capture.fail(
                    f"{op.name} with host indices cannot be captured: they are copied to "
                    "the device first (a blocking copy). Keep the indices on the device."
                )
            return
        _check_host_operands(op, host)


def _tensors(args: Any, kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensor arguments of a call (lists flattened), and those of them on the host."""
    found: list[torch.Tensor] = []
    host: list[torch.Tensor] = []
    for x in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(x, torch.Tensor):
            found.append(x)
            if not isinstance(x, SimDeviceTensor):
                host.append(x)
        elif isinstance(x, list | tuple):
            for i in x:
                if isinstance(i, torch.Tensor):
                    found.append(i)
                    if not isinstance(i, SimDeviceTensor):
                        host.append(i)
    return found, host


def _made_for_a_device_call(op: OpFacts, call: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
    """Whether a factory dispatched inside a builtin call makes a device tensor: an input of the
    call is one (`call_through`). A scalar torch wraps for a kernel stays a host scalar, as on
    CUDA."""
    if op.func is _SCALAR_TENSOR:
        return False
    found, host = _tensors(*call)
    return len(host) < len(found)


_SCALAR_TENSOR = torch.ops.aten.scalar_tensor.default


def _check_host_operands(op: OpFacts, host: list[torch.Tensor]) -> None:
    for t in host:
        if t.dim() != 0 or not op.host_scalars:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"{SIM_DEVICE} and cpu! ({op.name} got a host tensor of shape "
                f"{list(t.shape)}: copy it to the device first)"
            )


def _bound_draw(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A draw's arguments with its device generator bound to the seed and offset it holds now
    (generators.py), when it names one: work queued on a side stream draws what its issue took,
    as a CUDA kernel does. (A captured draw is bound at each replay instead: capture.py.)"""
    generator = kwargs.get("generator")
    if philox_state(generator) is None:
        return kwargs
    return dict(kwargs, generator=bind_draw(generator))


def _queued_call(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fresh: dict[int, torch.Tensor],
    held: list[int],
    frees: StreamOrderedFrees,
) -> Callable[[], None]:
    """Queued device work: run `func` and copy its fresh results into the outputs handed out when
    it was issued, then release the storages its aliases hold (`held`). Holds only what it is
    given (never the issuing frame)."""

    def run() -> None:
        try:
            result = func(*args, **kwargs)
            results = result if isinstance(result, tuple | list) else [result]
            for p, out in fresh.items():
                out.copy_(results[p])
        finally:
            frees.release(held)

    return run


def _baked(x: Any) -> Any:
    """A 0-dim host tensor argument as it is now: queued work reads the value it was issued with."""
    if isinstance(x, torch.Tensor):
        return x if isinstance(x, SimDeviceTensor) else x.clone()
    if isinstance(x, list | tuple):
        return type(x)(_baked(i) for i in x)
    return x


def _crossing_refused(upload: bool, non_blocking: bool) -> str:
    what = "from host memory to the device" if upload else "from the device to host memory"
    why = "a blocking copy synchronizes" if not non_blocking else "its host memory is pageable"
    return (
        f"a copy {what} cannot be captured: {why}. Only a non_blocking copy to or from pinned "
        "memory (backend.empty_pinned, pin_memory=True) is recorded into a graph; copy before or "
        "after the capture, or stage through pinned memory."
    )
