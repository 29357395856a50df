"""Graph memory: one physical pool shared by every captured graph, one virtual view per graph.

`make_graph_memory(strategy, backend)` gives the executor its strategy (`separate`, `shared` or
`vmm`); `HostPool` (memfd + mmap, used by the sim backend) and `CudaVmmPool` (CUDA VMM behind a
`torch.cuda.MemPool`) implement `vmm`; the ledger records every view for checks and stats.
"""

from .cuda_vmm import CudaView, CudaVmmPool
from .errors import PoolError, PoolExhaustedError, VmmUnsupportedError
from .host import HostPool, HostView
from .ledger import Ledger, MemoryStats, find_overlaps
from .strategies import (
    STRATEGIES,
    GraphMemory,
    HandlePoolMemory,
    PoolBackend,
    VmmMemory,
    make_graph_memory,
)

__all__ = [
    "STRATEGIES",
    "CudaView",
    "CudaVmmPool",
    "GraphMemory",
    "HandlePoolMemory",
    "HostPool",
    "HostView",
    "Ledger",
    "MemoryStats",
    "PoolBackend",
    "PoolError",
    "PoolExhaustedError",
    "VmmMemory",
    "VmmUnsupportedError",
    "find_overlaps",
    "make_graph_memory",
]
