"""A vLLM-style model runner written against plain torch.cuda, with a side copy stream.

Graph mode: persistent device input buffers sized for the largest shape, each step's inputs built
in pinned staging buffers and uploaded on a side copy stream (ordered by events and `wait_stream`),
one CUDA graph per (padded batch size, query length) in a shared pool (query length 1 captured at
start-up, speculative lengths on first use), sampled tokens downloaded into a pinned host buffer.
Prefill, mixed and oversized batches run eagerly. Each name in `BUGS` breaks one thing, the way
public engines have: the harness must catch every one (`test_side_copy.py`).

It uses nothing but torch and its model module: on sim the harness's drop-in makes its
`torch.cuda` the sim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tests.runners.side_copy_model import M31, ModelConfig, TinyDecoder

BUGS = frozenset(
    {
        "padding_slot_zero",  # padding rows write slot 0 (block 0), also in the start-up capture
        "padding_slot_zero_in_steps",  # the same, in every step's staging only
        "key_without_query_len",  # graphs keyed by batch size only; spec decode varies it
        "temperature_baked",  # a shared-temperature fast path bakes the capture's 1.0 in
        "tokens_read_before_download",  # the pinned tokens are read before their copy landed
        "replay_without_upload_wait",  # the replay does not wait for the side-stream upload
        "upload_over_live_inputs",  # the upload does not wait for the replay still reading
    }
)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 32
    cudagraph_capture_sizes: tuple[int, ...] = (1, 2, 4, 8)
    pad_block: int = 31  # reserved for padding (the last block)
    enforce_eager: bool = False


@dataclass
class SeqInput:
    tokens: list[int]
    context_len: int
    block_table: list[int]
    seed: int | None
    temperature: float


@dataclass
class RunnerOutput:
    logits: torch.Tensor
    tokens: torch.Tensor  # host int64
    graph_key: tuple[object, ...] | None
    fallback_reason: str | None


def _seed31(seed: int | None) -> int:
    return -1 if seed is None else int(seed) % M31


_FIELDS = {
    "input_ids": ("tokens", torch.int64),
    "positions": ("tokens", torch.int64),
    "slot_mapping": ("tokens", torch.int64),
    "block_tables": ("table", torch.int64),
    "seq_lens": ("rows", torch.int64),
    "seeds": ("rows", torch.int64),
    "temperatures": ("rows", torch.float32),
}


class ModelRunner:
    def __init__(self, cfg: EngineConfig, seed: int, bug: str | None = None) -> None:
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}; known: {sorted(BUGS)}")
        self.cfg, self.bug = cfg, bug
        self.device = "cuda"
        self.model = TinyDecoder(cfg.model, self.device, seed)
        m = cfg.model
        self.pad_slot = cfg.pad_block * m.block_size
        self.graphs: dict[tuple[object, ...], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        if cfg.enforce_eager:
            return
        dims = {
            "tokens": (cfg.max_num_batched_tokens,),
            "table": (cfg.max_num_seqs, m.max_blocks_per_seq),
            "rows": (cfg.max_num_seqs,),
        }
        for name, (dim, dtype) in _FIELDS.items():
            self.buffers[name] = torch.zeros(dims[dim], dtype=dtype, device=self.device)
        self.staging = {
            name: torch.zeros(dims[dim], dtype=dtype, pin_memory=True)
            for name, (dim, dtype) in _FIELDS.items()
        }
        self.sampled_host = torch.zeros(cfg.max_num_seqs, dtype=torch.int64, pin_memory=True)
        self.copy_stream = torch.cuda.Stream()
        self.upload_done = torch.cuda.Event()
        self.download_done = torch.cuda.Event()
        self.pool = torch.cuda.graph_pool_handle()
        for size in sorted(cfg.cudagraph_capture_sizes, reverse=True):
            self._capture(size, 1)

    # -- graph capture -------------------------------------------------------------------------

    def _graph_key(self, size: int, q: int) -> tuple[object, ...]:
        if self.bug == "key_without_query_len":
            return ("decode", size)
        return ("decode", size, q)

    def _forward_uniform(
        self, size: int, q: int, shared_temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform batch of `size` rows of `q` query tokens each, read from the static buffers."""
        b = self.buffers
        t = size * q
        token_req = torch.arange(t, device=self.device) // q
        logits_indices = torch.arange(size, device=self.device) * q + (q - 1)
        temperatures = (
            b["temperatures"][:size] if shared_temperature is None else shared_temperature
        )
        return self.model.forward(
            b["input_ids"][:t],
            b["positions"][:t],
            b["slot_mapping"][:t],
            token_req,
            b["block_tables"][:size],
            b["seq_lens"][:size],
            logits_indices,
            b["seeds"][:size],
            temperatures,
        )

    def _capture(self, size: int, q: int) -> None:
        self._stage([], size, q)  # every row is padding: it writes the pad block only
        self._upload(size, q)
        torch.cuda.current_stream().wait_stream(self.copy_stream)
        shared = None
        if self.bug == "temperature_baked":
            # decided on the capture's padding rows, whose temperatures are all 1.0
            temperatures = self.staging["temperatures"][:size].tolist()
            if len(set(temperatures)) == 1:
                shared = float(temperatures[0])
        self._forward_uniform(size, q, shared)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward_uniform(size, q, shared)
        torch.cuda.synchronize()
        self.graphs[self._graph_key(size, q)] = (graph, out)

    # -- input preparation ---------------------------------------------------------------------

    def _stage(self, seqs: list[SeqInput], size: int, q: int) -> None:
        """Write the batch into the pinned staging prefix; padding rows get sentinels."""
        self.upload_done.synchronize()  # the last upload has finished reading the staging buffers
        m = self.cfg.model
        t = size * q
        ids, pos, slots = [0] * t, [0] * t, [self.pad_slot] * t
        if self.bug == "padding_slot_zero" or (self.bug == "padding_slot_zero_in_steps" and seqs):
            slots = [0] * t
        tables = [[self.cfg.pad_block] * m.max_blocks_per_seq for _ in range(size)]
        seq_lens, seeds, temperatures = [1] * size, [-1] * size, [1.0] * size
        for r, seq in enumerate(seqs):
            tables[r][: len(seq.block_table)] = seq.block_table
            seq_lens[r] = seq.context_len + len(seq.tokens)
            seeds[r] = _seed31(seq.seed)
            temperatures[r] = seq.temperature
            for j, token in enumerate(seq.tokens):
                p = seq.context_len + j
                ids[r * q + j], pos[r * q + j] = token, p
                slots[r * q + j] = seq.block_table[p // m.block_size] * m.block_size + (
                    p % m.block_size
                )
        values = {
            "input_ids": ids,
            "positions": pos,
            "slot_mapping": slots,
            "block_tables": tables,
            "seq_lens": seq_lens,
            "seeds": seeds,
            "temperatures": temperatures,
        }
        for name, value in values.items():
            staged = torch.tensor(value, dtype=self.staging[name].dtype)
            self.staging[name][: staged.shape[0]].copy_(staged)

    def _upload(self, size: int, q: int) -> None:
        t = size * q
        copy_stream = self.copy_stream
        if self.bug != "upload_over_live_inputs":
            copy_stream.wait_stream(torch.cuda.current_stream())  # the last replay read them
        with torch.cuda.stream(copy_stream):
            for name, device_buffer in self.buffers.items():
                n = t if _FIELDS[name][0] == "tokens" else size
                device_buffer[:n].copy_(self.staging[name][:n], non_blocking=True)
            self.upload_done.record(copy_stream)

    # -- execution -----------------------------------------------------------------------------

    def execute(self, seqs: list[SeqInput]) -> RunnerOutput:
        reason = self._fallback_reason(seqs)
        if reason is not None:
            return self._run_eager(seqs, reason)
        n, q = len(seqs), len(seqs[0].tokens)
        size = self._padded_size(n, q)
        assert size is not None  # _fallback_reason ran eagerly otherwise
        key = self._graph_key(size, q)
        if key not in self.graphs:
            self._capture(size, q)
        self._stage(seqs, size, q)
        self._upload(size, q)
        main = torch.cuda.current_stream()
        if self.bug != "replay_without_upload_wait":
            main.wait_stream(self.copy_stream)
        graph, (logits, tokens) = self.graphs[key]
        graph.replay()
        out_logits = logits[:n].clone()
        self.sampled_host[:n].copy_(tokens[:n], non_blocking=True)
        self.download_done.record(main)
        if self.bug != "tokens_read_before_download":
            self.download_done.synchronize()
        return RunnerOutput(out_logits, self.sampled_host[:n].clone(), key, None)

    def _padded_size(self, n: int, q: int) -> int | None:
        for size in self.cfg.cudagraph_capture_sizes:
            if size >= n and size * q <= self.cfg.max_num_batched_tokens:
                return size
        return None

    def _fallback_reason(self, seqs: list[SeqInput]) -> str | None:
        if self.cfg.enforce_eager:
            return "enforce_eager"
        if not seqs:
            return "empty batch"
        if any(s.context_len == 0 for s in seqs):
            return "prefill in batch"
        if len({len(s.tokens) for s in seqs}) != 1:
            return "non-uniform query lengths"
        if self._padded_size(len(seqs), len(seqs[0].tokens)) is None:
            return f"no capture size for {len(seqs)} reqs x {len(seqs[0].tokens)} tokens"
        return None

    def _run_eager(self, seqs: list[SeqInput], reason: str) -> RunnerOutput:
        m = self.cfg.model
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        token_req: list[int] = []
        logits_indices: list[int] = []
        for r, seq in enumerate(seqs):
            for j, token in enumerate(seq.tokens):
                p = seq.context_len + j
                ids.append(token)
                pos.append(p)
                slots.append(seq.block_table[p // m.block_size] * m.block_size + p % m.block_size)
                token_req.append(r)
            logits_indices.append(len(ids) - 1)
        tables = [
            s.block_table + [self.cfg.pad_block] * (m.max_blocks_per_seq - len(s.block_table))
            for s in seqs
        ]

        def on_device(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        logits, tokens = self.model.forward(
            on_device(ids),
            on_device(pos),
            on_device(slots),
            on_device(token_req),
            on_device(tables).view(len(seqs), m.max_blocks_per_seq),
            on_device([s.context_len + len(s.tokens) for s in seqs]),
            on_device(logits_indices),
            on_device([_seed31(s.seed) for s in seqs]),
            torch.tensor([s.temperature for s in seqs], dtype=torch.float32, device=self.device),
        )
        return RunnerOutput(logits, tokens.cpu(), None, reason)

    def shutdown(self) -> None:
        torch.cuda.synchronize()
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
