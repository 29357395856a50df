"""A runner modelled on llama.cpp's CUDA graphs (ggml-cuda's `ggml_cuda_graph`), with one real bug.

The model: one context, one CUDA graph. Every step builds the ggml compute graph of its ubatch;
before running it the backend compares each node's properties (op, shape, data address, source
addresses) with those it stored at the last step. A node whose op is `GGML_OP_CPY` or `GGML_OP_VIEW`
is exempt from the address comparison: the KV-cache copies (`ggml_cpy` of this token's K and V
into a view of the cache at its cell) move every token. If anything else changed (here the
attended KV length `n_kv`, padded to `KV_PAD` cells, or the number of tokens) the graph is
captured again; otherwise the captured graph is reused and, before launch, the destination
argument of every copy kernel node is patched to this token's cell (`cudaGraphKernelNodeSetParams`
in llama.cpp; here a small device tensor that only the graph's copy nodes read, standing for the
kernel-node parameters, so it is no static buffer the harness may poison). Graphs are used only
for a ubatch of one token (a node adding a multi-row tensor disables them for that step) and are
switched off for good after 4 consecutive updates, as in llama.cpp. The K cache is quantized
(`-ctk q8_0`: int8 codes plus an fp16 scale per head row, written by a quantizing copy kernel),
the V cache is f16 (a plain converting copy kernel), so the graph holds two different copy
kernels. The contract's paged KV cache is llama.cpp's cell array: a token's cell is `kv_slot` of
its position, attention reads the view of cells `[0, n_kv)` under a KQ mask input that admits
only the request's own cells up to its position (masked by `where`, so poisoned cells never leak).

The bug (`cpy_fn_single=True`): ggml-org/llama.cpp issue #7492 ("CUDA graphs break quantized K
cache", https://github.com/ggml-org/llama.cpp/issues/7492), fixed by PR #7565 ("Allow multiple
copy function pointers for CUDA graph kernel updates",
https://github.com/ggml-org/llama.cpp/pull/7565). The update step recognised copy nodes by a
single remembered copy-kernel function pointer, so with a quantized K cache beside an f16 V cache
only the nodes of one of the two kernels had their destination patched. The others kept the
destination they were captured with: on every reused replay the V copy writes this token's
values into the cell of the token at capture time, and the token's own V cell is never written.
Which kernel is remembered is modelled as the first copy node's (the K copy); the fix keeps a
list of every copy kernel seen. Perplexity with `-ctk q8_0 -b 1` went wrong until then.
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
    num_blocks=24,
    block_size=4,
    max_blocks_per_req=6,
    vocab_size=48,
    max_num_reqs=6,
    max_num_tokens=16,
    capture_sizes=(1,),  # llama.cpp graphs only a one-token ubatch
    features=frozenset({"decode", "prefill", "spec_decode", "sampling", "weight_update"}),
)
HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
CELLS = SPEC.num_slots
KV_PAD = 32  # n_kv is padded to this many cells, as llama.cpp pads it
MAX_UPDATES = 4  # consecutive graph updates before graphs are disabled
CPY_NODES = (("k_cpy", "cpy_f32_q8_0"), ("v_cpy", "cpy_f32_f16"))  # captured order, kernel
_M32 = 0xFFFFFFFF


class Weights:
    def __init__(self, seed: int, device: Any) -> None:
        shapes = {
            "embed": (SPEC.vocab_size, HIDDEN),
            "wq": (HIDDEN, HIDDEN),
            "wk": (HIDDEN, HIDDEN),
            "wv": (HIDDEN, HIDDEN),
            "wo": (HIDDEN, HIDDEN),
            "up": (HIDDEN, 2 * HIDDEN),
            "down": (2 * HIDDEN, HIDDEN),
            "output": (HIDDEN, SPEC.vocab_size),
        }
        self.t = {name: torch.empty(shape, device=device) for name, shape in shapes.items()}
        self.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
        self.load(seed)

    def load(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(self.t):  # in place: captured graphs read these tensors
            w = self.t[name]
            w.copy_((torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[0])).to(w.device))


def _norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
    angle = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


def _mix(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def sample(logits: Tensor, seeds: Tensor, positions: Tensor, sampled: Tensor, temps: Tensor):
    """Host-side sampler's job, done after the graph: noise from (seed, position, token id)."""
    key = _mix(_mix(seeds & _M32) ^ ((positions * 0x9E3779B1) & _M32))
    ids = torch.arange(logits.shape[-1], device=logits.device)
    bits = _mix(key[:, None] ^ ((ids * 0x85EBCA6B) & _M32)[None, :])
    uniform = (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24
    noisy = logits / temps[:, None] - torch.log(-torch.log(uniform))
    return torch.where(sampled, noisy.argmax(-1), logits.argmax(-1))


class LlamaCudaGraphRunner:
    def __init__(self, mode: str, *, seed: int, backend: str, cpy_fn_single: bool = False):
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} must be 'graph' or 'eager'")
        self.spec, self.mode, self.cpy_fn_single = SPEC, mode, cpy_fn_single
        self.be: Any = get_backend(backend)
        dev = self.device = self.be.device
        self.w = Weights(seed, dev)
        self.k_codes = torch.zeros(CELLS, HEADS, HEAD_DIM, dtype=torch.int8, device=dev)
        self.k_scale = torch.zeros(CELLS, HEADS, dtype=torch.float16, device=dev)
        self.v_cache = torch.zeros(CELLS, HEADS, HEAD_DIM, dtype=torch.float16, device=dev)
        # ggml_cuda_graph's state
        self.graph: Any = None
        self.graph_logits: Tensor | None = None
        self.props: list[tuple] | None = None
        self.consecutive_updates = 0
        self.disabled_too_many_updates = False
        self.buffers: dict[str, Tensor] = {}
        self.cpy_params = torch.zeros(len(CPY_NODES), dtype=torch.int64, device=dev)
        if mode == "graph":
            self.buffers = {
                "inp_tokens": torch.zeros(1, dtype=torch.int64, device=dev),
                "inp_pos": torch.zeros(1, dtype=torch.int64, device=dev),
                "kq_mask": torch.zeros(1, CELLS, dtype=torch.bool, device=dev),
            }

    # -- the ggml graph ---------------------------------------------------------------------------

    def forward(self, tokens, pos, mask, k_dest, v_dest, n_kv: int, last=None) -> Tensor:
        w = self.w.t
        x = w["embed"][tokens]
        h = _norm(x)
        q = _rope((h @ w["wq"]).view(-1, HEADS, HEAD_DIM), pos, self.w.inv_freq)
        k = _rope((h @ w["wk"]).view(-1, HEADS, HEAD_DIM), pos, self.w.inv_freq)
        v = (h @ w["wv"]).view(-1, HEADS, HEAD_DIM)
        # GGML_OP_CPY, kernel cpy_f32_q8_0: quantize this ubatch's K into its cells
        amax = k.abs().amax(-1)
        d = (amax / 127.0).to(torch.float16)
        inv = torch.where(d > 0, 1.0 / d.to(torch.float32), torch.zeros((), device=k.device))
        codes = torch.round(k * inv[..., None]).clamp(-127, 127).to(torch.int8)
        self.k_codes.index_copy_(0, k_dest, codes)
        self.k_scale.index_copy_(0, k_dest, d)
        # GGML_OP_CPY, kernel cpy_f32_f16
        self.v_cache.index_copy_(0, v_dest, v.to(torch.float16))
        # views of cells [0, n_kv) and the KQ mask
        keys = self.k_codes[:n_kv].to(torch.float32) * self.k_scale[:n_kv, :, None].float()
        vals = self.v_cache[:n_kv].to(torch.float32)
        m = mask[:, :n_kv]
        scores = torch.einsum("thd,chd->thc", q, keys) / math.sqrt(HEAD_DIM)
        scores = torch.where(m[:, None, :], scores, torch.full((), -math.inf, device=q.device))
        vals = torch.where(m[:, :, None, None], vals[None], torch.zeros((), device=q.device))
        attn = torch.einsum("thc,tchd->thd", scores.softmax(-1), vals).flatten(1)
        x = x + attn @ w["wo"]
        x = x + torch.nn.functional.silu(_norm(x) @ w["up"]) @ w["down"]
        if last is not None:
            x = x[last]
        return _norm(x) @ w["output"]

    def node_props(self, n_tokens: int, n_kv: int, cells: tuple[int, ...]) -> list[tuple]:
        """(name, op, ne, data address, source addresses) of the nodes the comparison sees."""
        t, kv = (n_tokens,), (n_kv, HEADS, HEAD_DIM)
        return [
            ("inp_tokens", "NONE", t, ("inp_tokens", 0), ()),
            ("inp_pos", "NONE", t, ("inp_pos", 0), ()),
            ("kq_mask", "NONE", (n_tokens, n_kv), ("kq_mask", 0), ()),
            (
                "k_cpy",
                "CPY",
                (n_tokens, HEADS, HEAD_DIM),
                ("k", cells),
                (("kcur", 0), ("k", cells)),
            ),
            (
                "v_cpy",
                "CPY",
                (n_tokens, HEADS, HEAD_DIM),
                ("v", cells),
                (("vcur", 0), ("v", cells)),
            ),
            ("k_view", "VIEW", kv, ("k", 0), (("k", 0),)),
            ("v_view", "VIEW", kv, ("v", 0), (("v", 0),)),
            ("kq", "MUL_MAT", (n_tokens, HEADS, n_kv), ("kq", 0), (("k", 0), ("q", 0))),
            ("ffn_inp", "ADD", (n_tokens, HIDDEN), ("x", 0), (("attn", 0), ("inp", 0))),
            ("result_output", "MUL_MAT", (n_tokens, SPEC.vocab_size), ("out", 0), ()),
        ]

    @staticmethod
    def node_matches(node: tuple, stored: tuple) -> bool:
        _name, op, ne, data, srcs = node
        moving = op in ("CPY", "VIEW")  # addresses of these may change between tokens
        if data != stored[3] and not moving:
            return False
        if op != stored[1] or ne != stored[2]:
            return False
        return moving or srcs == stored[4]

    def update_required(self, props: list[tuple]) -> bool:
        required = self.graph is None or self.props is None or len(self.props) != len(props)
        if not required:
            assert self.props is not None
            required = not all(map(self.node_matches, props, self.props))
        self.props = props  # stored for the next token, whatever happens next
        return required

    # -- steps ------------------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        if batch.num_reqs == 0:
            empty = torch.zeros(0, SPEC.vocab_size, device=self.device)
            return StepResult(empty, torch.zeros(0, dtype=torch.int64), "eager", None, "empty")
        cells = tuple(
            kv_slot(r.block_ids, r.context_len + i, SPEC.block_size)
            for r in batch.requests
            for i in range(len(r.tokens))
        )
        top = max((max(r.block_ids) + 1) * SPEC.block_size for r in batch.requests)
        n_kv = min(CELLS, -(-top // KV_PAD) * KV_PAD)
        if self.mode == "eager":
            return self.run_eager(batch, cells, n_kv, "graphs disabled (eager twin)")
        if self.disabled_too_many_updates:
            return self.run_eager(batch, cells, n_kv, "graphs disabled: too many updates")
        required = self.update_required(self.node_props(batch.num_tokens, n_kv, cells))
        if batch.num_tokens > 1:  # the ADD node's src[1] has ne[1] > 1
            self.consecutive_updates = 0
            return self.run_eager(batch, cells, n_kv, "batch size > 1")
        self.consecutive_updates = self.consecutive_updates + 1 if required else 0
        if self.consecutive_updates >= MAX_UPDATES:
            self.disabled_too_many_updates = True  # from the next token on
        return self.run_graph(batch.requests[0], cells[0], n_kv, required)

    def run_graph(self, req: Request, cell: int, n_kv: int, required: bool) -> StepResult:
        buf = self.buffers
        buf["inp_tokens"].fill_(req.tokens[0])
        buf["inp_pos"].fill_(req.context_len)
        buf["kq_mask"].copy_(_mask([req], n_kv=CELLS).to(self.device))
        updated_kernel_arg = [cell for _ in CPY_NODES]  # each CPY node's dest, in node order
        if required:
            # the copy kernels are captured with this token's destinations
            self.cpy_params.copy_(torch.tensor(updated_kernel_arg, device=self.device))
            graph = self.be.Graph()
            with self.be.graph(graph):
                logits = self.forward(
                    buf["inp_tokens"],
                    buf["inp_pos"],
                    buf["kq_mask"],
                    self.cpy_params[0:1],
                    self.cpy_params[1:2],
                    n_kv,
                )
            if self.graph is not None:
                self.graph.reset()
            self.graph, self.graph_logits = graph, logits
        else:
            self.maintain(updated_kernel_arg)
        self.graph.replay()
        assert self.graph_logits is not None
        logits = self.graph_logits.clone()
        tokens = self.sample(logits, [req])
        return StepResult(logits, tokens, "full", ("ggml_cuda_graph", 1, n_kv))

    def maintain(self, updated_kernel_arg: list[int]) -> None:
        """Patch the destination argument of each copy kernel node before the launch."""
        if self.cpy_fn_single:  # one remembered copy-kernel pointer (before PR #7565)
            cpy_fns = [CPY_NODES[0][1]]
        else:  # every copy kernel the graph holds (PR #7565)
            cpy_fns = list(dict.fromkeys(kernel for _, kernel in CPY_NODES))
        k = 0
        for i, (_, kernel) in enumerate(CPY_NODES):
            if kernel in cpy_fns:
                self.cpy_params[i].fill_(updated_kernel_arg[k])
                k += 1

    def run_eager(self, batch: Batch, cells: tuple[int, ...], n_kv: int, reason: str):
        reqs = batch.requests
        tok = [t for r in reqs for t in r.tokens]
        pos = [r.context_len + i for r in reqs for i in range(len(r.tokens))]
        last, n = [], 0
        for r in reqs:
            n += len(r.tokens)
            last.append(n - 1)
        dev = self.device
        dest = torch.tensor(cells, dtype=torch.int64, device=dev)
        logits = self.forward(
            torch.tensor(tok, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            _mask(reqs, n_kv).to(dev),
            dest,
            dest,
            n_kv,
            last=torch.tensor(last, dtype=torch.int64, device=dev),
        )
        return StepResult(logits, self.sample(logits, reqs), "eager", None, reason)

    def sample(self, logits: Tensor, reqs: Sequence[Request]) -> Tensor:
        dev = self.device
        greedy = [r.seed is None for r in reqs]
        return sample(
            logits,
            torch.tensor([0 if r.seed is None else r.seed & _M32 for r in reqs], device=dev),
            torch.tensor([r.context_len + len(r.tokens) - 1 for r in reqs], device=dev),
            torch.tensor([not g for g in greedy], dtype=torch.bool, device=dev),
            torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev),
        )

    # -- contract ---------------------------------------------------------------------------------

    def state(self) -> Mapping[str, Tensor]:
        return {"k_codes": self.k_codes, "k_scale": self.k_scale, "v": self.v_cache}

    def static_buffers(self) -> Mapping[str, Tensor]:
        return self.buffers

    def address_views(self) -> Sequence[AddressView]:
        return []

    def update_weights(self, seed: int) -> None:
        self.w.load(seed)

    def close(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.graph_logits = None


def _mask(reqs: Sequence[Request], n_kv: int) -> Tensor:
    """KQ mask [tokens, n_kv]: a token sees its request's cells up to its own position."""
    rows = []
    for r in reqs:
        cells = [kv_slot(r.block_ids, p, SPEC.block_size) for p in range(r.seq_len)]
        for i in range(len(r.tokens)):
            row = [False] * n_kv
            for c in cells[: r.context_len + i + 1]:
                row[c] = True
            rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def make_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return LlamaCudaGraphRunner(mode, seed=seed, backend=backend)


def make_buggy_target(mode: Literal["graph", "eager"], *, seed: int, backend: str):
    return LlamaCudaGraphRunner(mode, seed=seed, backend=backend, cpy_fn_single=True)
