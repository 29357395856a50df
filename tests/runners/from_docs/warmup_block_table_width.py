"""A decode-graph runner shaped like text-generation-inference's `FlashCausalLM`, whose graphs are
sized at start-up from the warm-up batch.

The engine mechanism (written from scratch against the backend facade; no TGI code): every decode
row is one query token. A speculative step expands each request into 1 + k rows that share a copy
of its block table (TGI's `forward` with `speculative_ids`). At start-up `warmup()` captures one
graph per capture size, largest first, into one pool; the smaller sizes' static inputs are prefix
slices of the largest size's buffers (TGI PR #2790, "Saving some VRAM"). A graph's static inputs
are `input_ids`, `position_ids`, `slots`, `block_tables` (`[rows, max_bt]`) and `input_lengths`;
the captured attention gathers each row's keys through its block-table row over a fixed span of
`max_s = max_bt * block_size` positions and masks those past the row's length. A replay writes the
batch into the buffers' prefix (block tables into `[:rows, :width]`, width the batch's widest
table) after resetting every row to padding (slot and table entries on the reserved block 0, the
null block here, length 0). Prefill and mixed steps, uneven speculative steps and steps past the
largest graph run eagerly. Sampling (Gumbel-max from a hash of seed, position and token id) runs
after the forward, outside the graph.

The bug (`make_buggy_target`, `warmup_sized_graphs=True`): text-generation-inference PR #2716,
"Hotfixing auto length (warmup max_s was wrong)"
(https://github.com/huggingface/text-generation-inference/pull/2716, commit a5593ba8), fixing what
PR #2673 ("Choosing input/total tokens automatically based on available VRAM",
https://github.com/huggingface/text-generation-inference/pull/2673) left behind. `warmup()` took
`max_bt = batch.max_blocks` and `max_s = max_bt * BLOCK_SIZE` from the warm-up prefill batch (the
profiling batch, sized by the prefill budget) and captured every decode graph with them, so the
graphs' block-table buffer is only as wide, and their attended span only as long, as the warm-up
prompt. Any later decode batch holding a sequence longer than that prompt has a wider block table
than the buffer: the prefix copy cannot hold it (TGI raised a shape error at the copy; here too),
and a graph that read past `max_s` would not exist. The fix captures with `max_total_tokens`, the
longest sequence the server admits (here `max_blocks_per_req * block_size`), for both.
Everything else (eager steps, short contexts, speculative rows) is unaffected, so the bug shows
only once a graphed decode batch carries a request whose context outgrew the warm-up prompt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec, kv_slot
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=40,
    block_size=4,
    max_blocks_per_req=8,
    vocab_size=64,
    max_num_reqs=8,
    max_num_tokens=16,
    capture_sizes=(1, 2, 4, 8, 16),  # in rows: a speculative request takes 1 + k of them
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
MAX_TOTAL_TOKENS = SPEC.max_blocks_per_req * SPEC.block_size  # the longest sequence admitted
# The warm-up (profiling) prefill batch: prompts of this many tokens, as the prefill budget allows.
WARMUP_PROMPT_TOKENS = 12
NULL_BLOCK = SPEC.null_block  # TGI reserves block 0 (the health check's); padding writes there
MASKED_SCORE = -1.0e30  # finite, so a row with no keys (padding) softmaxes to zeros, not NaN
_M32 = 0xFFFFFFFF


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix32(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


class Model:
    """Token + learned position embedding, one attention layer over a slot-major paged cache."""

    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (MAX_TOTAL_TOKENS, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "lm_head": (HIDDEN, SPEC.vocab_size),
        }
        self.weights = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        """In place: the captured graphs hold these tensors' addresses."""
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(self.weights):
            weight = self.weights[name]
            fresh = torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[0])
            weight.copy_(fresh.to(weight.device))

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        slots: Tensor,
        block_tables: Tensor,
        input_lengths: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        max_s: int,
    ) -> Tensor:
        """Logits of every row. `max_s` is a host int: inside a capture it is frozen, so the graph
        attends over exactly that many positions of each row's block table."""
        w = self.weights
        x = w["embed"][input_ids] + w["pos"][position_ids]
        h = _rms(x)
        q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
        k = (h @ w["wk"]).view(-1, HEADS, HEAD_DIM)
        v = (h @ w["wv"]).view(-1, HEADS, HEAD_DIM)
        k_cache, v_cache = kv_cache
        # Store this step's keys first: a speculative row attends to the drafts before it.
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        key_pos = torch.arange(max_s, device=x.device)
        key_slots = (
            block_tables[:, key_pos // SPEC.block_size] * SPEC.block_size
            + key_pos % SPEC.block_size
        )  # [rows, max_s]
        visible = key_pos[None, :] < input_lengths[:, None]
        keys = k_cache[key_slots]  # [rows, max_s, heads, dim]
        # Masked keys may be the null block's NaN or an idle block's mark: replace, not multiply.
        vals = torch.where(visible[:, :, None, None], v_cache[key_slots], 0.0)
        scores = torch.einsum("rhd,rshd->rhs", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(visible[:, None, :], scores, MASKED_SCORE)
        probs = torch.where(visible[:, None, :], scores.softmax(-1), 0.0)
        attn = torch.einsum("rhs,rshd->rhd", probs, vals).reshape(-1, HIDDEN)
        x = x + attn @ w["wo"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        return _rms(x) @ w["lm_head"]


def sample(logits: Tensor, reqs: Sequence[Request]) -> Tensor:
    """Greedy for requests without a seed, else Gumbel-max with noise hashed from the request's
    seed, its last query position and the token id: the same in any batch, bucket or padding."""
    dev = logits.device
    seeds = torch.tensor([(r.seed or 0) & _M32 for r in reqs], dtype=torch.int64, device=dev)
    positions = torch.tensor([r.seq_len - 1 for r in reqs], dtype=torch.int64, device=dev)
    temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
    sampled = torch.tensor([r.seed is not None for r in reqs], dtype=torch.bool, device=dev)
    key = _mix32(_mix32(seeds) ^ ((positions * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], dtype=torch.int64, device=dev)
    bits = _mix32(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class FlashCausalLMRunner:
    def __init__(
        self, mode: str, *, seed: int, backend: str, warmup_sized_graphs: bool = False
    ) -> None:
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode = SPEC, mode
        self.be: Any = get_backend(backend)
        self.device = self.be.device
        self.model = Model(seed, self.device)
        shape = (SPEC.num_slots, HEADS, HEAD_DIM)
        self.k_cache = torch.zeros(shape, device=self.device)
        self.v_cache = torch.zeros(shape, device=self.device)
        self.cuda_graphs: dict[int, dict[str, Any]] = {}
        self.buffers: dict[str, Tensor] = {}
        if mode == "graph":
            if warmup_sized_graphs:  # before PR #2716: the warm-up prefill batch's blocks
                max_bt = -(-WARMUP_PROMPT_TOKENS // SPEC.block_size)
                max_s = max_bt * SPEC.block_size
            else:  # PR #2716: the longest sequence the server admits
                max_bt, max_s = SPEC.max_blocks_per_req, MAX_TOTAL_TOKENS
            self.warmup(max_s, max_bt)

    # -- start-up ---------------------------------------------------------------------------------

    def warmup(self, max_s: int, max_bt: int) -> None:
        """Capture every size, largest first, one pool; smaller sizes slice the largest's inputs."""
        pool = self.be.graph_pool_handle()
        for rows in sorted(SPEC.capture_sizes, reverse=True):
            self.cuda_graph_warmup(rows, max_s, max_bt, pool)

    def cuda_graph_warmup(self, rows: int, max_s: int, max_bt: int, pool: Any) -> None:
        dev = self.device
        if not self.buffers:
            largest = max(SPEC.capture_sizes)
            self.buffers = {
                "input_ids": torch.zeros(largest, dtype=torch.int64, device=dev),
                "position_ids": torch.zeros(largest, dtype=torch.int64, device=dev),
                "slots": torch.full(
                    (largest,), NULL_BLOCK * SPEC.block_size, dtype=torch.int64, device=dev
                ),
                "block_tables": torch.full(
                    (largest, max_bt), NULL_BLOCK, dtype=torch.int64, device=dev
                ),
                "input_lengths": torch.zeros(largest, dtype=torch.int64, device=dev),
            }
        inputs = {name: buf[:rows] for name, buf in self.buffers.items()}
        # Warm-up and capture run on all-padding rows: every write lands in the null block.
        self.model.forward(**inputs, kv_cache=(self.k_cache, self.v_cache), max_s=max_s)
        self.be.synchronize()
        graph = self.be.Graph()
        with self.be.graph(graph, pool=pool):
            logits = self.model.forward(
                **inputs, kv_cache=(self.k_cache, self.v_cache), max_s=max_s
            )
        self.cuda_graphs[rows] = {"graph": graph, "logits": logits, "inputs": inputs}

    # -- steps ------------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self.run_eager(batch, reason)
        return self.replay(batch)

    def fallback_reason(self, batch: Batch) -> str | None:
        if self.mode == "eager":
            return "eager twin"
        if any(r.context_len == 0 for r in batch.requests):
            return "prefill (cu_seqlen_prefill set)"
        if not batch.uniform:
            return "speculative rows of unequal length"
        if batch.num_tokens > max(SPEC.capture_sizes):
            return "more rows than the largest graph"
        return None

    @staticmethod
    def rows_of(batch: Batch) -> dict[str, list]:
        """One row per query token, each with its request's block table (TGI's expansion)."""
        rows: dict[str, list] = {"ids": [], "pos": [], "slots": [], "lens": [], "tables": []}
        for r in batch.requests:
            for j, token in enumerate(r.tokens):
                position = r.context_len + j
                rows["ids"].append(token)
                rows["pos"].append(position)
                rows["slots"].append(kv_slot(r.block_ids, position, SPEC.block_size))
                rows["lens"].append(position + 1)
                rows["tables"].append(list(r.block_ids))
        return rows

    @staticmethod
    def last_rows(batch: Batch) -> list[int]:
        last, n = [], 0
        for r in batch.requests:
            n += len(r.tokens)
            last.append(n - 1)
        return last

    @staticmethod
    def table_tensor(tables: list[list[int]], device: Any) -> Tensor:
        """The batch's block tables, as wide as its widest one (TGI's `block_tables_tensor`)."""
        width = max(len(t) for t in tables)
        padded = [t + [NULL_BLOCK] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int64, device=device)

    def replay(self, batch: Batch) -> StepResult:
        n = batch.num_tokens
        size = next(s for s in SPEC.capture_sizes if s >= n)
        entry = self.cuda_graphs[size]
        rows, dev = self.rows_of(batch), self.device
        static = entry["inputs"]
        # Every row the graph reads is rewritten: the harness poisons these buffers between steps,
        # and the gather reads every column of a row's table (masked or not).
        static["input_ids"].zero_()
        static["position_ids"].zero_()
        static["slots"].fill_(NULL_BLOCK * SPEC.block_size)
        static["block_tables"].fill_(NULL_BLOCK)
        static["input_lengths"].zero_()
        static["input_ids"][:n] = torch.tensor(rows["ids"], dtype=torch.int64, device=dev)
        static["position_ids"][:n] = torch.tensor(rows["pos"], dtype=torch.int64, device=dev)
        static["slots"][:n] = torch.tensor(rows["slots"], dtype=torch.int64, device=dev)
        static["input_lengths"][:n] = torch.tensor(rows["lens"], dtype=torch.int64, device=dev)
        tables = self.table_tensor(rows["tables"], dev)
        static["block_tables"][:n, : tables.shape[1]] = tables  # TGI's prefix copy
        entry["graph"].replay()
        last = torch.tensor(self.last_rows(batch), dtype=torch.int64, device=dev)
        logits = entry["logits"][last]  # a gather: a copy the next replay cannot overwrite
        tokens = sample(logits, batch.requests)
        return StepResult(logits, tokens, "full", ("decode", size))

    def run_eager(self, batch: Batch, reason: str) -> StepResult:
        rows, dev = self.rows_of(batch), self.device
        tables = self.table_tensor(rows["tables"], dev)
        logits = self.model.forward(
            torch.tensor(rows["ids"], dtype=torch.int64, device=dev),
            torch.tensor(rows["pos"], dtype=torch.int64, device=dev),
            torch.tensor(rows["slots"], dtype=torch.int64, device=dev),
            tables,
            torch.tensor(rows["lens"], dtype=torch.int64, device=dev),
            kv_cache=(self.k_cache, self.v_cache),
            max_s=tables.shape[1] * SPEC.block_size,  # this batch's longest table
        )
        logits = logits[torch.tensor(self.last_rows(batch), dtype=torch.int64, device=dev)]
        return StepResult(logits, sample(logits, batch.requests), "eager", None, reason)

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k_cache": self.k_cache, "v_cache": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.model.load(seed)

    def close(self) -> None:
        for entry in self.cuda_graphs.values():
            entry["graph"].reset()
        self.cuda_graphs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> FlashCausalLMRunner:
    return FlashCausalLMRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> FlashCausalLMRunner:
    return FlashCausalLMRunner(mode, seed=seed, backend=backend, warmup_sized_graphs=True)
