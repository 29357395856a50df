"""The backend facade as a type: what a runner may use, whichever backend runs it.

`Backend` is the subset of torch.cuda that `backends.get()` returns; `CudaBackend` and
`SimBackend` both satisfy it, and mypy checks that they do (see the end of this module). Stream,
event and graph objects are typed by the methods a runner calls on them. Arguments that are another
stream or event are `Any`: each backend accepts only its own kind, which a protocol cannot say.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pytest_graphmode.runtime.backends.errors import CaptureError, UseAfterFreeError
from pytest_graphmode.runtime.backends.race import Race

if TYPE_CHECKING:
    import torch


class GraphHandle(Protocol):
    """A captured graph, shaped like `torch.cuda.CUDAGraph`."""

    def replay(self) -> None: ...

    def reset(self) -> None: ...

    def pool(self) -> Any: ...  # an opaque pool id, to pass as `graph(..., pool=)`

    # A generator besides the default one may draw in this graph's captures only once registered
    # (torch.Generator(device=...) where a target lives); each replay then advances it.
    def register_generator_state(self, generator: Any) -> None: ...


class StreamHandle(Protocol):
    """A stream, shaped like `torch.cuda.Stream`."""

    @property
    def cuda_stream(self) -> int:
        """The stream's identity: 0 for the default stream, distinct for every other."""
        ...

    def wait_stream(self, stream: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class EventHandle(Protocol):
    """An event, shaped like `torch.cuda.Event`."""

    def record(self, stream: Any = None) -> object: ...

    def wait(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds


@runtime_checkable
class Backend(Protocol):
    """What `backends.get()` returns: names and semantics as in torch.cuda."""

    @property
    def name(self) -> str: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def CaptureError(self) -> type[CaptureError]: ...

    @property
    def UseAfterFreeError(self) -> type[UseAfterFreeError]: ...

    @property
    def Graph(self) -> Callable[[], GraphHandle]: ...

    @property
    def Stream(self) -> Callable[..., StreamHandle]: ...  # Stream(priority=0)

    # Event(enable_timing=False, blocking=False, interprocess=False)
    @property
    def Event(self) -> Callable[..., EventHandle]: ...

    def graph(
        self,
        cuda_graph: Any,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
    ) -> AbstractContextManager[Any]: ...

    def stream(self, s: Any) -> AbstractContextManager[Any]: ...

    def current_stream(self) -> StreamHandle: ...

    def default_stream(self) -> StreamHandle: ...

    def synchronize(self) -> None: ...

    def graph_pool_handle(self) -> Any: ...

    def is_current_stream_capturing(self) -> bool: ...

    def empty_cache(self) -> None: ...

    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) bytes of device memory

    def empty_pinned(
        self, size: int | tuple[int, ...], dtype: torch.dtype = ...
    ) -> torch.Tensor: ...  # dtype defaults to float32

    def set_scheduler_seed(self, seed: int) -> None: ...

    # The stream races found since the last call, first found first: sim's happens-before
    # checker's; on cuda, host accesses to pinned memory whose non-blocking copy was still in
    # flight, where the harness's delays told the backend of them (cuda_races.py). None where a
    # backend has no checker at all.
    def take_races(self) -> list[Race] | None: ...

    # A backend changes nothing process-wide until activated (sim: torch is routed through it while
    # any activation is open; cuda: threads started meanwhile are followed by the harness's
    # delays, nothing of torch changes); activations nest.
    @property
    def is_active(self) -> bool: ...

    def activate(self) -> None: ...

    def deactivate(self) -> None: ...

    def active(self) -> AbstractContextManager[Any]: ...


if TYPE_CHECKING:  # mypy checks that both backends are Backends; nothing runs at import
    from pytest_graphmode.runtime.backends.cuda import CudaBackend
    from pytest_graphmode.runtime.backends.sim import SimBackend

    def _both_backends_conform(cuda: CudaBackend, sim: SimBackend) -> tuple[Backend, Backend]:
        return cuda, sim
