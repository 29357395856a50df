"""A graph-captured decode runner written against plain `torch.cuda`, as engines write them.

It imports nothing but torch: weights and a paged KV cache made with `device="cuda"`, host inputs
staged in pinned memory (`pin_memory=True`) and uploaded on a side `torch.cuda.Stream` that the
compute stream waits for through a `torch.cuda.Event`, one `torch.cuda.CUDAGraph` per capture size
captured with `torch.cuda.graph` into one pool from `torch.cuda.graph_pool_handle()`, largest
first. A decode step writes its rows into the static buffers' prefix, points the padding rows at
the null block, replays, and copies the results out. Any other step runs eagerly.

On a GPU it runs as it is; under the sim's drop-in (`--graphmode-backend=sim`) the same code runs
on the simulated GPU. `tests/runners/plain_target.py` adapts it to the target contract.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
NULL_BLOCK = 0  # padding rows read and write this block only


@dataclass(frozen=True)
class Shape:
    num_blocks: int = 24
    block_size: int = 4
    max_blocks_per_req: int = 6
    vocab_size: int = 48
    capture_sizes: tuple[int, ...] = (1, 2, 4)

    @property
    def context(self) -> int:
        return self.max_blocks_per_req * self.block_size


@dataclass(frozen=True)
class Row:
    """One query token: its id, position, the KV slot it writes, and its request's block table."""

    token: int
    position: int
    slot: int
    table: tuple[int, ...]


_COLUMNS = ("token", "position", "slot")


class PlainDecodeRunner:
    """`graphs=True` captures decode graphs at start-up; `graphs=False` always runs eagerly."""

    def __init__(self, shape: Shape, *, graphs: bool, seed: int) -> None:
        self.shape = shape
        self.device = torch.device("cuda")
        names = {
            "embed": (shape.vocab_size, HIDDEN),
            "pos": (shape.context, HIDDEN),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "head": (HIDDEN, shape.vocab_size),
        }
        self.weights = {n: torch.empty(s, device=self.device) for n, s in names.items()}
        self.load_weights(seed)
        slots = shape.num_blocks * shape.block_size
        self.k_cache = torch.zeros(slots, HEADS, HEAD_DIM, device="cuda")
        self.v_cache = torch.zeros(slots, HEADS, HEAD_DIM, device="cuda:0")
        rows = max(shape.capture_sizes)
        width = len(_COLUMNS) + shape.max_blocks_per_req
        # Host rows are staged in pinned memory and uploaded asynchronously on the copy stream.
        self.staging = torch.zeros(rows, width, dtype=torch.int64, pin_memory=True)
        self.static = torch.zeros(rows, width, dtype=torch.int64, device=self.device)
        self.copy_stream = torch.cuda.Stream()
        self.uploaded = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[Tensor, Tensor]] = {}
        if graphs:
            self._capture()

    def load_weights(self, seed: int) -> None:
        """(Re)initialise in place: captured graphs keep reading the same tensors."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(self.device))

    # -- graphs ---------------------------------------------------------------------------------

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.shape.capture_sizes, reverse=True):
            self._upload([], size)  # every row is padding during warm-up and capture
            self._forward(self.static[:size])  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(self.static[:size])
            self.graphs[size] = graph

    def capture_size(self, rows: int) -> int | None:
        return next((s for s in sorted(self.shape.capture_sizes) if s >= rows), None)

    def _upload(self, rows: Sequence[Row], size: int) -> None:
        """Stage `rows` plus padding rows up to `size` on the host, upload them on the copy stream,
        and make the compute stream wait for the upload."""
        self.uploaded.synchronize()  # the previous upload has read the staging rows
        self._stage(rows, size)
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            self.static[:size].copy_(self.staging[:size], non_blocking=True)
            self.uploaded.record()
        torch.cuda.current_stream().wait_event(self.uploaded)

    def _stage(self, rows: Sequence[Row], size: int) -> None:
        """Write the rows, then padding rows pointing at the null block, into the staging buffer."""
        for i in range(size):
            values = self._values(rows[i]) if i < len(rows) else self._padding()
            self.staging[i] = torch.tensor(values, dtype=torch.int64)

    def _values(self, row: Row) -> list[int]:
        table = list(row.table) + [NULL_BLOCK] * (self.shape.max_blocks_per_req - len(row.table))
        return [row.token, row.position, row.slot, *table]

    def _padding(self) -> list[int]:
        return [0, 0, NULL_BLOCK * self.shape.block_size] + [NULL_BLOCK] * (
            self.shape.max_blocks_per_req
        )

    def decode(self, rows: Sequence[Row]) -> tuple[Tensor, Tensor, int]:
        """Replay the smallest graph that fits `rows` (one token each); the logits, the greedy
        tokens and the capture size replayed."""
        size = self.capture_size(len(rows))
        if size is None or size not in self.graphs:
            raise ValueError(f"no decode graph for {len(rows)} rows")
        self._upload(rows, size)
        self.graphs[size].replay()
        logits, tokens = self._results(size, len(rows))
        return logits, tokens, size

    def _results(self, size: int, rows: int) -> tuple[Tensor, Tensor]:
        """The first `rows` rows of the graph's static outputs, copied: the next replay rewrites them."""
        logits, tokens = self.outputs[size]
        return logits[:rows].clone(), tokens[:rows].clone()

    # -- eager ----------------------------------------------------------------------------------

    def eager(self, rows: Sequence[Row], last: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Run `rows` (any number of tokens per request) eagerly; results at the `last` rows."""
        width = len(_COLUMNS) + self.shape.max_blocks_per_req
        host = torch.tensor([self._values(r) for r in rows], dtype=torch.int64)
        logits, tokens = self._forward(host.reshape(len(rows), width).to(self.device))
        index = torch.tensor(list(last), dtype=torch.int64, device=self.device)
        return logits[index], tokens[index]

    # -- the model ------------------------------------------------------------------------------

    def _forward(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """One attention layer over the paged cache. `rows`: [T, 3 + max_blocks] on the device."""
        w = self.weights
        tokens, positions, slots, tables = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:]
        x = w["embed"][tokens] + w["pos"][positions]
        q, k, v = (x @ w[n] for n in "qkv")
        self.k_cache.index_copy_(0, slots, k.view(-1, HEADS, HEAD_DIM))
        self.v_cache.index_copy_(0, slots, v.view(-1, HEADS, HEAD_DIM))
        size = self.shape.block_size
        offsets = torch.arange(size, device=self.device)
        context = (tables[:, :, None] * size + offsets).flatten(1)  # [T, context] slots
        keys, values = self.k_cache[context], self.v_cache[context]
        visible = (
            torch.arange(self.shape.context, device=self.device)[None, :] <= positions[:, None]
        )
        scores = torch.einsum("thd,tchd->thc", q.view(-1, HEADS, HEAD_DIM), keys)
        probs = (scores / math.sqrt(HEAD_DIM)).masked_fill(~visible[:, None, :], float("-inf"))
        # Masked slots may hold anything: 0 * NaN would leak it.
        values = torch.where(visible[:, :, None, None], values, torch.zeros((), device=x.device))
        attended = torch.einsum("thc,tchd->thd", probs.softmax(-1), values).flatten(1)
        logits = (x + attended @ w["o"]) @ w["head"]
        return logits, logits.argmax(-1)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
