"""Tree / speculative verification runner: one captured step verifies a small static token tree.

What it is
----------
A paged-KV decode runner in the Medusa / EAGLE "target verify" style. Every request of a step is
laid out as a fixed-size token tree of T_TREE nodes (its last token plus speculative children).
The tree topology lives in static buffers as an attention mask `tree_mask[r, i, j]` (node i sees
node j of the same request's tree) plus per-node position offsets `pos_offset[r, i]` (the node's
depth); a node's position is `ctx_len[r] + pos_offset[r, i]`. One captured graph computes the
keys/values and logits of *every* node (as verification needs), appends every node's K/V to the
paged cache, and gathers the logits / sampled token of each request's last node. Nodes of the
committed prefix are read from the cache (slot position < ctx_len); tree nodes attend to each
other through the in-step keys and the tree mask, so KV a rejected draft left in the cache past
ctx_len is never read (only accepted tokens' KV stays valid).

Graphs are keyed by (tree size, rows): T = 1 (plain decode) and T = 4 (root + up to 3 drafts),
rows padded to 1, 2, 4 or 6. A batch of continuing requests (context_len > 0) whose requests each
have at most 4 query tokens replays a graph; new prompts and longer queries run eagerly
(GENERATION_ONLY = False lets short prompts replay the verify graphs too).

How the contract expresses it (and what it cannot)
--------------------------------------------------
Contract v1 has speculative steps (feature "spec_decode"): a request's `tokens` is 1 + k tokens,
its last token followed by k drafts in a *chain*; the scheduler (the harness), not the runner,
decides how many drafts are accepted, visible only as the next step's `context_len`; and a
StepResult holds logits / next token at each request's *last* query token only. So this runner
verifies the closest tree the contract can send: a chain (a degenerate tree; the mask is the
chain's ancestor mask), trees shorter than T (fewer drafts near a block limit or token budget,
or mixed with plain decode rows) padded with inert nodes that write the null block. It computes
all nodes' logits but cannot report a per-node verdict or choose the accepted path itself.

The bug (make_buggy_target)
---------------------------
Modelled on TensorRT-LLM PR #17110 ("[TRTLLM-14706][fix] Fix SA specdec + CUDA graphs",
https://github.com/NVIDIA/TensorRT-LLM/pull/17110): the graph-safe, device-side KV append only
handled the q_len == 1 decode shape; the verify shape (q_len = 1 + max_draft_len) fell back to a
host-side loop whose write positions came from host metadata. Eagerly that is correct (the loop
runs every step); under capture the capture batch's slot numbers are frozen into the captured
copies, so every replayed verify step scatters its K/V into the capture-time dummy slots (here
the null block) and never into the requests' own slots, silently corrupting later steps. Here:
`_append_kv` takes the device `index_copy_` path only for graph mode *and* T == 1; the T = 4
verify graphs bake the host loop over the dummy batch's slots. Decode graphs and the eager path
stay correct.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_graphmode.contract import AddressView, Batch, Request, StepResult, TargetSpec
from pytest_graphmode.runtime.backends import get as get_backend

SPEC = TargetSpec(
    num_blocks=32,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=24,
    capture_sizes=(1, 2, 4, 6, 8, 16, 24),  # tokens: decode rows 1,2,4,6; verify rows x 4 nodes
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
# The verify graphs serve generation requests (context_len > 0), as engines' verify graphs do;
# with False, short prompts (a chain from position 0) replay them too.
GENERATION_ONLY = True
T_TREE = 4  # nodes per request in a verify graph: root + 3 speculative children
TREE_SIZES = (1, T_TREE)
ROW_BUCKETS = (1, 2, 4, 6)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CONTEXT = SPEC.max_blocks_per_req * SPEC.block_size
NULL_SLOT = SPEC.null_block * SPEC.block_size
_MASK32 = 0xFFFFFFFF

PADDING: dict[str, Any] = {
    "tokens": 0,
    "ctx_lens": 0,
    "pos_offset": 0,
    "tree_mask": False,
    "slots": NULL_SLOT,
    "tables": SPEC.null_block,
    "last": 0,
    "seeds": 0,
    "temperatures": 1.0,
    "sampled": False,
}


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def _slot(request: Request, position: int) -> int:
    return (
        request.block_ids[position // SPEC.block_size] * SPEC.block_size
        + position % SPEC.block_size
    )


class TreeInputs:
    """Per-step tensors for R rows x T nodes (static buffer views in graph mode)."""

    def __init__(self, bufs: Mapping[str, Tensor], host_slots: list[int]) -> None:
        self.__dict__.update(bufs)
        # Host copy of the slot mapping, used by the host-loop KV append (eager path only, in
        # the correct runner). Read at the time the forward is *issued*, so under capture it is
        # whatever the capture batch held.
        self.host_slots = host_slots


def host_rows(requests: Sequence[Request], rows: int, tree: int) -> dict[str, list[Any]]:
    """Every row of an R x T grid: requests first, then padding rows; short trees padded."""
    out: dict[str, list[Any]] = {name: [] for name in PADDING}
    for r in range(rows):
        req = requests[r] if r < len(requests) else None
        q = req.query_len if req else 0
        out["tokens"].append(
            [req.tokens[i] if i < q else 0 for i in range(tree)] if req else [0] * tree
        )
        out["ctx_lens"].append(req.context_len if req else 0)
        out["pos_offset"].append([i if i < q else 0 for i in range(tree)])
        # chain tree: node i sees its ancestors 0..i; padding nodes see only themselves
        out["tree_mask"].append(
            [[(j <= i) if i < q else (i == j) for j in range(tree)] for i in range(tree)]
        )
        out["slots"].append(
            [_slot(req, req.context_len + i) if i < q else NULL_SLOT for i in range(tree)]
            if req
            else [NULL_SLOT] * tree
        )
        blocks = list(req.block_ids) if req else []
        out["tables"].append(blocks + [SPEC.null_block] * (SPEC.max_blocks_per_req - len(blocks)))
        out["last"].append(q - 1 if req else 0)
        sampled = bool(req and req.seed is not None)
        out["seeds"].append((req.seed & _MASK32) if sampled else 0)
        out["temperatures"].append(req.temperature if sampled else 1.0)
        out["sampled"].append(sampled)
    return out


class TreeModel:
    def __init__(self, seed: int, device: torch.device) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "pos": (CONTEXT, HIDDEN),
            "head": (HIDDEN, SPEC.vocab_size),
            "q": (HIDDEN, HIDDEN),
            "k": (HIDDEN, HIDDEN),
            "v": (HIDDEN, HIDDEN),
            "o": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
        }
        self.w = {n: torch.empty(s, device=device) for n, s in shapes.items()}
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.w):
            t = self.w[name]
            t.copy_((torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[0])).to(t.device))

    def forward(
        self, inp: TreeInputs, kv: tuple[Tensor, Tensor], device_append: bool
    ) -> tuple[Tensor, Tensor]:
        w = self.w
        rows, tree = inp.tokens.shape
        positions = inp.ctx_lens[:, None] + inp.pos_offset  # [R, T] per-node positions
        x = w["embed"][inp.tokens] + w["pos"][positions]  # [R, T, H]
        h = _rms(x)
        q, k, v = ((h @ w[n]).view(rows, tree, HEADS, HEAD_DIM) for n in "qkv")
        _append_kv(
            kv, inp, k.reshape(-1, HEADS, HEAD_DIM), v.reshape(-1, HEADS, HEAD_DIM), device_append
        )
        k_cache, v_cache = kv
        # committed prefix from the paged cache: slot position < ctx_len
        offs = torch.arange(SPEC.block_size, device=x.device)
        ctx_slots = (inp.tables[:, :, None] * SPEC.block_size + offs).flatten(1)  # [R, C]
        pk, pv = k_cache[ctx_slots], v_cache[ctx_slots]  # [R, C, heads, dim]
        seen = torch.arange(CONTEXT, device=x.device)[None, :] < inp.ctx_lens[:, None]  # [R, C]
        scale = 1.0 / math.sqrt(HEAD_DIM)
        s_pre = torch.einsum("rthd,rchd->rthc", q, pk) * scale
        s_tree = torch.einsum("rthd,rshd->rths", q, k) * scale
        s_pre = s_pre.masked_fill(~seen[:, None, None, :], float("-inf"))
        s_tree = s_tree.masked_fill(~inp.tree_mask[:, :, None, :], float("-inf"))
        probs = torch.cat([s_pre, s_tree], -1).softmax(-1)
        p_pre, p_tree = probs[..., :CONTEXT], probs[..., CONTEXT:]
        pv = torch.where(seen[:, :, None, None], pv, torch.zeros((), device=x.device))  # NaN-safe
        att = torch.einsum("rthc,rchd->rthd", p_pre, pv) + torch.einsum(
            "rths,rshd->rthd", p_tree, v
        )
        x = x + att.reshape(rows, tree, HIDDEN) @ w["o"]
        x = x + torch.nn.functional.silu(_rms(x) @ w["up"]) @ w["down"]
        node_logits = _rms(x) @ w["head"]  # [R, T, V]: every node's logits (verification)
        node_tokens = _sample(node_logits, positions, inp)  # [R, T]: target's choice per node
        pick = inp.last[:, None]
        logits = node_logits.gather(1, pick[:, :, None].expand(rows, 1, SPEC.vocab_size)).squeeze(1)
        return logits, node_tokens.gather(1, pick).squeeze(1)


def _append_kv(
    kv: tuple[Tensor, Tensor], inp: TreeInputs, k: Tensor, v: Tensor, device_append: bool
) -> None:
    """Store every node's K/V in its slot (padding nodes: the null block)."""
    k_cache, v_cache = kv
    if device_append:  # graph-safe: the slot mapping is a device input
        slots = inp.slots.reshape(-1)
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        return
    for node, slot in enumerate(inp.host_slots):  # host loop: one copy per node
        k_cache[slot].copy_(k[node])
        v_cache[slot].copy_(v[node])


def _sample(node_logits: Tensor, positions: Tensor, inp: TreeInputs) -> Tensor:
    """Gumbel-max per node from a hash of (seed, position, token id): batch-independent."""
    key = _mix(_mix(inp.seeds)[:, None] ^ ((positions * 0x9E3779B1) & _MASK32))  # [R, T]
    ids = torch.arange(node_logits.shape[-1], device=node_logits.device)
    bits = _mix(key[:, :, None] ^ ((ids * 0x85EBCA6B) & _MASK32))
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = node_logits / inp.temperatures[:, None, None] - torch.log(-torch.log(uniform))
    return torch.where(inp.sampled[:, None], noisy.argmax(-1), node_logits.argmax(-1))


class TreeVerifyRunner:
    def __init__(
        self, mode: Literal["graph", "eager"], *, seed: int, backend: str, buggy: bool = False
    ) -> None:
        self.spec = SPEC
        self.mode = mode
        self.buggy = buggy
        self.backend: Any = get_backend(backend)
        self.device = self.backend.device
        with torch.inference_mode():
            self.model = TreeModel(seed, self.device)
            shape = (SPEC.num_slots, HEADS, HEAD_DIM)
            self.kv = (
                torch.zeros(shape, device=self.device),
                torch.zeros(shape, device=self.device),
            )
            self.buffers: dict[int, dict[str, Tensor]] = {}
            self.host_slots: dict[tuple[int, int], list[int]] = {}
            self.graphs: dict[tuple[int, int], Any] = {}
            self.outputs: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
            if mode == "graph":
                for tree in TREE_SIZES:
                    self.buffers[tree] = self._allocate(ROW_BUCKETS[-1], tree)
                self._capture()

    def _allocate(self, rows: int, tree: int) -> dict[str, Tensor]:
        i64, dev = torch.int64, self.device
        return {
            "tokens": torch.zeros(rows, tree, dtype=i64, device=dev),
            "ctx_lens": torch.zeros(rows, dtype=i64, device=dev),
            "pos_offset": torch.zeros(rows, tree, dtype=i64, device=dev),
            "tree_mask": torch.zeros(rows, tree, tree, dtype=torch.bool, device=dev),
            "slots": torch.zeros(rows, tree, dtype=i64, device=dev),
            "tables": torch.zeros(rows, SPEC.max_blocks_per_req, dtype=i64, device=dev),
            "last": torch.zeros(rows, dtype=i64, device=dev),
            "seeds": torch.zeros(rows, dtype=i64, device=dev),
            "temperatures": torch.ones(rows, device=dev),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=dev),
        }

    def _device_append(self, tree: int) -> bool:
        if self.mode == "eager":
            return False  # eager: the host loop is correct, it runs every step
        if self.buggy:
            return tree == 1  # BUG: only the decode shape takes the graph-safe path
        return True

    # -- graph mode -------------------------------------------------------------------------------

    def _prepare(self, batch: Batch, rows: int, tree: int) -> TreeInputs:
        values = host_rows(batch.requests, rows, tree)
        bufs = {}
        for name, vals in values.items():
            view = self.buffers[tree][name][:rows]
            view.copy_(torch.tensor(vals, dtype=view.dtype))  # every row, valid and padding
            bufs[name] = view
        self.host_slots[(tree, rows)] = [s for row in values["slots"] for s in row]
        return TreeInputs(bufs, self.host_slots[(tree, rows)])

    def _capture(self) -> None:
        pool = self.backend.graph_pool_handle()
        for tree in reversed(TREE_SIZES):
            for rows in reversed(ROW_BUCKETS):
                key = (tree, rows)
                inputs = self._prepare(Batch(()), rows, tree)  # a dummy batch: all padding
                self.model.forward(inputs, self.kv, self._device_append(tree))  # warm-up
                self.backend.synchronize()
                graph = self.backend.Graph()
                with self.backend.graph(graph, pool=pool):
                    self.outputs[key] = self.model.forward(
                        inputs, self.kv, self._device_append(tree)
                    )
                self.graphs[key] = graph

    def _graph_key(self, batch: Batch) -> tuple[int, int] | str:
        if self.mode == "eager":
            return "eager twin"
        if batch.num_reqs == 0:
            return "empty batch"
        if max(batch.query_lens) > T_TREE:
            return f"query of {max(batch.query_lens)} tokens exceeds the {T_TREE}-node tree"
        if batch.num_reqs > ROW_BUCKETS[-1]:
            return "more requests than the largest graph"
        if GENERATION_ONLY and any(r.context_len == 0 for r in batch.requests):
            return "a new prompt: context requests run eagerly"
        tree = 1 if max(batch.query_lens) == 1 else T_TREE
        return tree, next(b for b in ROW_BUCKETS if b >= batch.num_reqs)

    def step(self, batch: Batch) -> StepResult:
        with torch.inference_mode():
            key = self._graph_key(batch)
            n = batch.num_reqs
            if isinstance(key, str):
                tree = max(batch.query_lens, default=1)
                values = host_rows(batch.requests, n, tree)
                bufs = {
                    name: torch.tensor(vals, dtype=self._dtype(name), device=self.device)
                    for name, vals in values.items()
                }
                inputs = TreeInputs(bufs, [s for row in values["slots"] for s in row])
                logits, tokens = self.model.forward(inputs, self.kv, device_append=False)
                return StepResult(logits, tokens, "eager", None, reason=key)
            tree, rows = key
            self._prepare(batch, rows, tree)
            self.graphs[key].replay()
            logits, tokens = self.outputs[key]
            kind = "verify" if tree > 1 else "decode"
            return StepResult(logits[:n].clone(), tokens[:n].clone(), "full", (kind, rows))

    @staticmethod
    def _dtype(name: str) -> torch.dtype:
        if name in ("tree_mask", "sampled"):
            return torch.bool
        return torch.float32 if name == "temperatures" else torch.int64

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k0": self.kv[0], "v0": self.kv[1]}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return {
            f"t{tree}.{name}": buf
            for tree, bufs in self.buffers.items()
            for name, buf in bufs.items()
        }

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        with torch.inference_mode():
            self.model.load(seed)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str) -> TreeVerifyRunner:
    return TreeVerifyRunner(mode, seed=seed, backend=backend)


def make_buggy_target(
    mode: Literal["graph", "eager"], *, seed: int, backend: str
) -> TreeVerifyRunner:
    return TreeVerifyRunner(mode, seed=seed, backend=backend, buggy=True)
