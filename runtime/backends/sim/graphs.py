"""`SimGraph`: torch.cuda.CUDAGraph's shape on the sim backend. Its capture and replay are the
backend's (capturing.py); a graph holds what its capture recorded (capture.Program) and its pool."""

from __future__ import annotations

from typing import Any

from pytest_graphmode.runtime.backends.sim.capture import Program
from pytest_graphmode.runtime.backends.sim.generators import is_device_generator
from pytest_graphmode.runtime.backends.sim.limits import SimUnsupportedError
from pytest_graphmode.runtime.backends.sim.pool import SimPoolHandle


class SimGraph:
    """Shaped like torch.cuda.CUDAGraph."""

    def __init__(self, keep_graph: bool = False) -> None:
        from pytest_graphmode.runtime.backends.sim.backend import current_backend

        self._backend = current_backend()
        self._program: Program | None = None
        self._pool: Any = None
        # generators besides the default whose draws this graph may capture
        self._generators: list[Any] = []

    def register_generator_state(self, generator: Any) -> None:
        """Let this graph's captures draw from `generator`, a device generator: each replay
        advances it and draws what its seed and offset give then (generators.py)."""
        if not is_device_generator(generator):
            raise RuntimeError(
                f"register_generator_state takes a device generator (torch.Generator(device="
                f"'cuda')); got one for {generator.device}"
            )
        if not self.draws_from(generator):
            self._generators.append(generator)

    def draws_from(self, generator: Any) -> bool:
        """Whether `generator` is registered with this graph."""
        return any(generator is g for g in self._generators)

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self._backend._begin_capture(self, pool, capture_error_mode)

    def capture_end(self) -> None:
        self._backend._end_capture(self)

    def replay(self) -> None:
        if self._program is None:
            raise RuntimeError("replay() of a graph that was never captured, or was reset")
        self._backend._launch(self._program)

    def reset(self) -> None:
        # As CUDA's: the graph lets go of its pool, and pool() has nothing to share until the
        # next capture.
        if self._program is not None and isinstance(self._pool, SimPoolHandle):
            self._pool.let_go(self)
        self._program = None
        self._pool = None

    def instantiate(self) -> None:
        """A sim graph is ready to replay when its capture ends (CUDA instantiates a
        `keep_graph=True` graph here, or at its first replay)."""
        if self._program is None:
            raise RuntimeError("instantiate() of a graph that was never captured, or was reset")

    def enable_debug_mode(self) -> None:
        """Nothing to keep: the sim's graph is its recorded program."""

    def debug_dump(self, debug_path: str) -> None:
        raise SimUnsupportedError(
            "CUDAGraph.debug_dump (a CUDA driver graph, which the sim has not)"
        )

    def raw_cuda_graph(self) -> Any:
        raise SimUnsupportedError("CUDAGraph.raw_cuda_graph (a CUDA driver graph handle)")

    def raw_cuda_graph_exec(self) -> Any:
        raise SimUnsupportedError("CUDAGraph.raw_cuda_graph_exec (a CUDA driver graph handle)")

    def get_graph_data(self) -> Any:
        raise SimUnsupportedError("CUDAGraph.get_graph_data (a CUDA driver graph's nodes)")

    def pool(self) -> Any:
        if self._pool is None:
            raise RuntimeError("pool() of a graph that was never captured, or was reset")
        return self._pool
